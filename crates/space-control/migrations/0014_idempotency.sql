-- The Idempotency-Key of a create (issue 14): a create retried with the same key (through
-- any replica, after any failure) answers the sandbox the first one made instead of making
-- another. A key is kept 24 h; the request's hash tells a retry from a different request.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    idem_key       TEXT PRIMARY KEY,
    sandbox_id     TEXT NOT NULL,
    request_sha256 TEXT NOT NULL,
    created_at     BIGINT NOT NULL
);
