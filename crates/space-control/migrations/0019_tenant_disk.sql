-- A tenant's disk quota (issue 15): the disk its namespace sandboxes' limits claim, summed,
-- in MiB (NULL: none). Portable SQL (SQLite and PostgreSQL).
ALTER TABLE tenants ADD COLUMN max_disk_mib BIGINT;
