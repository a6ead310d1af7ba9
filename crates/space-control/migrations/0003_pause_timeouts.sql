-- Pause, auto-pause and timeouts (decision 0008). One row per sandbox that has any of them
-- set or has been paused; absent = none. Deleted with the sandbox. Times are unix ms.

CREATE TABLE IF NOT EXISTS sandbox_lifecycle (
    id                TEXT PRIMARY KEY,
    -- Absolute deadline; only POST /v1/sandboxes/{id}/timeout (or create) changes it.
    timeout_at        BIGINT,
    -- 'pause' or 'delete'.
    on_timeout        TEXT NOT NULL,
    auto_pause_secs   BIGINT,
    paused_at         BIGINT,
    -- Last API activity, written on pause (in memory otherwise).
    last_activity_at  BIGINT
);
