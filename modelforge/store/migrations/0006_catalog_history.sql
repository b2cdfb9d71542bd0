-- Every catalog applied, whole, with when: what was in force at any moment of the record, so a
-- replay of past days runs under the catalog of those days (`modelforge simulate --from-record`).
CREATE TABLE catalog_history (
    id          bigserial PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    spec        jsonb NOT NULL
);
CREATE INDEX catalog_history_applied ON catalog_history (applied_at);
