-- Replicas (issue 14, decision 0037). Portable SQL (SQLite and PostgreSQL); times are unix
-- ms. A sandbox created with `replicas` 1 has its snapshots sent to a second node, which
-- keeps them; a row here says which node, the newest snapshot it holds whole (what a restore
-- after the loss of the sandbox's node comes back from), the ids it holds (JSON), and the
-- bytes the last replication sent.
CREATE TABLE IF NOT EXISTS sandbox_replicas (
    sandbox_id   TEXT PRIMARY KEY,
    node_id      TEXT NOT NULL,
    snapshot_id  TEXT NOT NULL,
    snapshots    TEXT NOT NULL,
    last_bytes   BIGINT NOT NULL,
    updated_at   BIGINT NOT NULL
);

-- The replicas a template's creates get when they name none (NULL: 0).
ALTER TABLE template_settings ADD COLUMN replicas BIGINT;
