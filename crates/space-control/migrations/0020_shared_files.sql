-- The files every control-plane replica shares (issue 14, decision 0054): admin.key,
-- ports.key and the cluster CA, sealed under secrets.key (nonce and ciphertext in base64).
-- A replica started on an empty data dir with the first one's secrets.key writes them from
-- here. Portable SQL (SQLite and PostgreSQL).
CREATE TABLE IF NOT EXISTS shared_files (
    name        TEXT PRIMARY KEY,
    nonce       TEXT NOT NULL,
    ciphertext  TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
