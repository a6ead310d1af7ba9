-- Events and audit (decision 0009). Append-only; rows outlive their sandbox. `id` is made by
-- spaced (unix ms << 12 | sequence), so no dialect-specific autoincrement is needed.

CREATE TABLE IF NOT EXISTS events (
    id          BIGINT PRIMARY KEY,
    time        BIGINT NOT NULL,
    actor       TEXT NOT NULL,
    sandbox_id  TEXT NOT NULL,
    action      TEXT NOT NULL,
    result      TEXT NOT NULL,
    detail      TEXT NOT NULL
);

CREATE INDEX IF NOT EXISTS events_by_sandbox ON events (sandbox_id, id);
