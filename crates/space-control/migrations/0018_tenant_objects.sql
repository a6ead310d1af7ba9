-- Secrets and templates belong to tenants (decision 0048). Portable SQL (SQLite and
-- PostgreSQL); times are unix ms.

-- A secret's name is unique within its tenant: the table is made again with the tenant in
-- its key, and the secrets made before this migration belong to `default`.
CREATE TABLE secrets_by_tenant (
    tenant_id   TEXT NOT NULL,
    name        TEXT NOT NULL,
    hosts       TEXT NOT NULL,
    header      TEXT NOT NULL,
    nonce       TEXT NOT NULL,
    ciphertext  TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL,
    version     BIGINT NOT NULL DEFAULT 1,
    metadata    TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (tenant_id, name)
);
INSERT INTO secrets_by_tenant
    (tenant_id, name, hosts, header, nonce, ciphertext, created_at, updated_at, version, metadata)
    SELECT 'default', name, hosts, header, nonce, ciphertext, created_at, updated_at, version,
           metadata
    FROM secrets;
DROP TABLE secrets;
ALTER TABLE secrets_by_tenant RENAME TO secrets;

-- Who owns a template name (NULL, or no row: `default`), and whether other tenants may use
-- it read-only (NULL: the owner's default, shared for `default`, the operator's catalogue,
-- and private for every other tenant). The owner is set once, when a tenant's key first
-- writes the name, and stays when the template is removed.
ALTER TABLE template_settings ADD COLUMN tenant_id TEXT;
ALTER TABLE template_settings ADD COLUMN shared BIGINT;
