-- Networking and secrets (decision 0012). Portable SQL (SQLite and PostgreSQL).
-- A sandbox's egress policy and secret bindings live in its spec JSON (sandboxes.spec:
-- "network", "secrets"); absent there = rows written before this migration (open, none).

-- Secrets: the value is sealed with CHACHA20-POLY1305 under <data_dir>/secrets.key; the
-- name is the associated data, so a ciphertext cannot be moved to another name.
-- hosts: JSON list of host patterns; header: "Name: template with {}".
CREATE TABLE IF NOT EXISTS secrets (
    name        TEXT PRIMARY KEY,
    hosts       TEXT NOT NULL,
    header      TEXT NOT NULL,
    nonce       TEXT NOT NULL,
    ciphertext  TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL
);
