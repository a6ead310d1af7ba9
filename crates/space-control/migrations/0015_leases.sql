-- Leases (issue 14, decision 0036): which control-plane replica works on a sandbox now. A
-- replica takes a sandbox's lease for each reconcile step and for a move; another replica
-- skips that sandbox until the lease is released or lapses (its holder died).
CREATE TABLE IF NOT EXISTS leases (
    name        TEXT PRIMARY KEY,
    holder      TEXT NOT NULL,
    expires_at  BIGINT NOT NULL
);
