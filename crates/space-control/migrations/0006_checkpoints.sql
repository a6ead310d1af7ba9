-- Checkpoints (decision 0007): the extra state of a snapshot of kind 'checkpoint'.
-- Portable SQL (SQLite and PostgreSQL); booleans are 0/1 integers.
-- memory: 1 when process memory was kept (microvm, later); 0 for the namespace runtime.
-- processes: JSON list of {cmd, cwd, user, tty, tag} to restart (never env values).

CREATE TABLE IF NOT EXISTS checkpoints (
    snapshot_id  TEXT PRIMARY KEY,
    memory       BIGINT NOT NULL,
    processes    TEXT NOT NULL
);
