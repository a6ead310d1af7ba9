-- Portable SQL: runs on SQLite (embedded default) and PostgreSQL.
-- Timestamps are unix milliseconds (BIGINT); the spec is JSON text.

CREATE TABLE IF NOT EXISTS sandboxes (
    id          TEXT PRIMARY KEY,
    spec        TEXT NOT NULL,
    state       TEXT NOT NULL,
    error       TEXT,
    generation  BIGINT NOT NULL,
    deleted_at  BIGINT,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL
);

CREATE INDEX IF NOT EXISTS sandboxes_by_created ON sandboxes (created_at, id);

CREATE TABLE IF NOT EXISTS api_keys (
    id          TEXT PRIMARY KEY,
    hash        TEXT NOT NULL UNIQUE,
    name        TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
