-- Per-template settings (decision 0014): the runtime creates of a template get when they
-- name none. Portable SQL (SQLite and PostgreSQL); times are unix ms. Absent row, or NULL:
-- the node's default runtime.

CREATE TABLE IF NOT EXISTS template_settings (
    template    TEXT PRIMARY KEY,
    runtime     TEXT,
    updated_at  BIGINT NOT NULL
);
