-- The cluster's membership (issue 14, decision 0033). Portable SQL (SQLite and PostgreSQL);
-- times are unix ms.
--
-- A join token is used once: `used_at` is set in the same statement that checks it, so two
-- nodes presenting one token at once cannot both join. Only a hash of its secret is kept.
CREATE TABLE IF NOT EXISTS join_tokens (
    id             TEXT PRIMARY KEY,
    secret_sha256  TEXT NOT NULL,
    created_at     BIGINT NOT NULL,
    expires_at     BIGINT NOT NULL,
    used_at        BIGINT,
    node_id        TEXT
);

-- A node that joined: where its service is, the fingerprint of the certificate it was issued
-- (how its calls are recognized; a removed node's row is gone, so its certificate is no
-- longer accepted), and what its last heartbeat said.
CREATE TABLE IF NOT EXISTS cluster_nodes (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    address       TEXT NOT NULL,
    cert_sha256   TEXT NOT NULL UNIQUE,
    joined_at     BIGINT NOT NULL,
    heartbeat_at  BIGINT NOT NULL,
    info          TEXT
);
