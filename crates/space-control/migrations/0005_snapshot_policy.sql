-- Snapshot policy per sandbox (decision 0010). Portable SQL (SQLite and PostgreSQL);
-- booleans are 0/1 integers; times are unix ms. Absent row = snapshots on demand only.

CREATE TABLE IF NOT EXISTS snapshot_policies (
    sandbox_id     TEXT PRIMARY KEY,
    every_secs     BIGINT,
    after_exec     BIGINT NOT NULL,
    keep_last      BIGINT,
    keep_labelled  BIGINT NOT NULL,
    -- When the periodic check last ran (or the policy was set).
    checked_at     BIGINT NOT NULL
);

-- Snapshots taken by a policy (not through the API); reason: 'every' | 'exec'.
CREATE TABLE IF NOT EXISTS auto_snapshots (
    snapshot_id  TEXT PRIMARY KEY,
    sandbox_id   TEXT NOT NULL,
    reason       TEXT NOT NULL
);

CREATE INDEX IF NOT EXISTS auto_snapshots_by_sandbox ON auto_snapshots (sandbox_id);
