-- Tenants and scoped API keys (decision 0040). Portable SQL (SQLite and PostgreSQL).
CREATE TABLE IF NOT EXISTS tenants (
    id          TEXT PRIMARY KEY,
    created_at  BIGINT NOT NULL,
    -- Replicas of its sandboxes when neither the create nor the template says (NULL: 0).
    replicas    BIGINT,
    -- Quotas (NULL: none): sandboxes not deleted, the CPU and memory their limits claim,
    -- snapshots of its sandboxes.
    max_sandboxes   BIGINT,
    max_cpu_millis  BIGINT,
    max_memory_mib  BIGINT,
    max_snapshots   BIGINT
);

-- Objects that predate tenants, and those an admin key makes, belong to `default`.
INSERT INTO tenants (id, created_at) VALUES ('default', 0) ON CONFLICT (id) DO NOTHING;

-- Existing keys are admin keys of `default`. A key stops working at `expires_at` (a
-- rotation's overlap) or once `revoked_at` is set.
ALTER TABLE api_keys ADD COLUMN tenant_id TEXT NOT NULL DEFAULT 'default';
ALTER TABLE api_keys ADD COLUMN scope TEXT NOT NULL DEFAULT 'admin';
ALTER TABLE api_keys ADD COLUMN expires_at BIGINT;
ALTER TABLE api_keys ADD COLUMN revoked_at BIGINT;
-- Requests a second the key may make (a token bucket of twice that); NULL: its scope's
-- default (none for admin keys).
ALTER TABLE api_keys ADD COLUMN rate_per_sec BIGINT;

-- Every sandbox belongs to a tenant.
ALTER TABLE sandboxes ADD COLUMN tenant_id TEXT NOT NULL DEFAULT 'default';
CREATE INDEX IF NOT EXISTS sandboxes_by_tenant ON sandboxes (tenant_id, created_at, id);
