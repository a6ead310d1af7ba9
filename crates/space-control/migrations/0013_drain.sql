-- A node being drained (issue 14, decision 0035): nothing new is placed on it, and
-- `space node drain` moves its sandboxes to the others.
ALTER TABLE cluster_nodes ADD COLUMN draining BIGINT NOT NULL DEFAULT 0;
