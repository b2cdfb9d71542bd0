-- The open rows of a pool's lease ledger: what its scheduler compares with the leases it holds,
-- once a minute (a lease it no longer knows is reclaimed and its row closed). Few rows, however
-- long the ledger grows.
CREATE INDEX lease_ledger_open ON lease_ledger (pool) WHERE ended_at IS NULL;
