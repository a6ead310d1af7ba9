-- Which node each sandbox is on, and the limits it claims there (issue 14, decision 0034).
-- Portable SQL (SQLite and PostgreSQL). A placement is made in a transaction that first
-- locks the node's row (an UPDATE of it), sums the claims of the node's live sandboxes and
-- inserts only if the new one fits, so that concurrent control-plane replicas never place
-- beyond a node's capacity.
CREATE TABLE IF NOT EXISTS sandbox_nodes (
    sandbox_id  TEXT PRIMARY KEY,
    node_id     TEXT NOT NULL,
    cpu_millis  BIGINT NOT NULL,
    memory_mib  BIGINT NOT NULL,
    placed_at   BIGINT NOT NULL
);

CREATE INDEX IF NOT EXISTS sandbox_nodes_by_node ON sandbox_nodes (node_id);
