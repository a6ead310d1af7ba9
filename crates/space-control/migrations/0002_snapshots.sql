-- Snapshots of sandboxes (a tree through parent_id). Portable SQL (SQLite and PostgreSQL).
-- kind: 'disk' | 'checkpoint'; spec: the sandbox spec JSON at snapshot time (what a
-- namespace checkpoint restarts from); parent_id may name a snapshot of another sandbox
-- (a fork's first snapshot). Timestamps are unix milliseconds.

CREATE TABLE IF NOT EXISTS snapshots (
    id          TEXT PRIMARY KEY,
    sandbox_id  TEXT NOT NULL,
    parent_id   TEXT,
    label       TEXT,
    kind        TEXT NOT NULL,
    spec        TEXT,
    size_bytes  BIGINT,
    created_at  BIGINT NOT NULL
);

CREATE INDEX IF NOT EXISTS snapshots_by_sandbox ON snapshots (sandbox_id, created_at, id);
CREATE INDEX IF NOT EXISTS snapshots_by_parent ON snapshots (parent_id);

-- The snapshot a sandbox's current state descends from (its newest snapshot, the one it
-- was rolled back to, or the one it was forked from): the parent of its next snapshot.
CREATE TABLE IF NOT EXISTS snapshot_heads (
    sandbox_id  TEXT PRIMARY KEY,
    snapshot_id TEXT NOT NULL
);
