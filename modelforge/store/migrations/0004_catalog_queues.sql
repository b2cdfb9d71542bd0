-- Configured queues ([[queues]]): each named queue with its levels, preemption and weight.
-- `position` keeps the file's order (equal priorities are ordered by it; a tenant without
-- classes defaults to the first queue's lowest level). No rows: the five built-in classes.
CREATE TABLE catalog_queues (
    name        text PRIMARY KEY,
    position    int NOT NULL,
    spec        jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
