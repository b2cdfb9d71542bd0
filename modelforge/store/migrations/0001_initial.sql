-- Catalog: the declared installation. Each row keeps its validated spec as JSON.
CREATE TABLE catalog_accelerators (
    id          text PRIMARY KEY,
    pool        text NOT NULL,
    node        text NOT NULL,
    spec        jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE catalog_deployments (
    capability  text PRIMARY KEY,
    spec        jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE catalog_tenants (
    name        text PRIMARY KEY,
    spec        jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- The event log: every lease, load, health check, invoke, release, unload and typed failure.
-- event_id is chosen by the writer, so a retried write inserts nothing twice.
CREATE TABLE events (
    event_id       text PRIMARY KEY,
    at             timestamptz NOT NULL,
    kind           text NOT NULL,
    failure_class  text,
    request_id     text NOT NULL DEFAULT '',
    lease_id       text NOT NULL DEFAULT '',
    accelerator    text NOT NULL DEFAULT '',
    deployment     text NOT NULL DEFAULT '',
    workflow_id    text NOT NULL DEFAULT '',
    message        text NOT NULL DEFAULT '',
    payload        jsonb NOT NULL DEFAULT '{}'::jsonb,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    seq            bigserial
);
CREATE INDEX events_at ON events (at);
CREATE INDEX events_seq ON events (seq);
CREATE INDEX events_request ON events (request_id) WHERE request_id <> '';
