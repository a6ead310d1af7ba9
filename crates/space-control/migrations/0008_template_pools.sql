-- Warm pools per template (decision 0013). Portable SQL (SQLite and PostgreSQL); times are
-- unix ms. The sizes are the ones requested through the API (the node clamps them to its
-- capacity when it applies them; a later start with more capacity gets closer to them).
-- min = max = 0 is kept as a row: the pool was turned off, and stays off after a restart
-- (no default pool is applied to a template that has a row). Absent row = no pool, except
-- for `base`, which gets spaced's `--warm-pool` default.

CREATE TABLE IF NOT EXISTS template_pools (
    template    TEXT PRIMARY KEY,
    min         BIGINT NOT NULL,
    max         BIGINT NOT NULL,
    runtime     TEXT NOT NULL,
    updated_at  BIGINT NOT NULL
);
