-- Secret versions and metadata (decision 0027, E2B's secrets API). Portable SQL (SQLite and
-- PostgreSQL). version: 1 for a new secret, one more for every change of its value.
-- metadata: a JSON object of the caller's labels. A secret made through E2B's API has
-- hosts '[]' and header '': only headers the proxy sets (secret_headers) can use it.
ALTER TABLE secrets ADD COLUMN version BIGINT NOT NULL DEFAULT 1;
ALTER TABLE secrets ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';
