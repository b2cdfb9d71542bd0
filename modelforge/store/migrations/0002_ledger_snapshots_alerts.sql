-- Alerts are events with an alert name (GPU_PRESSURE, CAPABILITY_CAPACITY): filterable, never a control.
ALTER TABLE events ADD COLUMN alert text;
CREATE INDEX events_alert ON events (alert) WHERE alert IS NOT NULL;
CREATE INDEX events_kind ON events (kind);

-- One row per lease, written from its lease_granted and lease_released events. Either event may
-- land first (writes are retried independently), so each fills only its own columns.
CREATE TABLE lease_ledger (
    lease_id      text PRIMARY KEY,
    request_id    text NOT NULL DEFAULT '',
    pool          text,
    tenant        text,
    capability    text,
    deployment    text,
    priority      text,
    accelerators  text[],
    bytes         bigint,
    granted_at    timestamptz,
    ended_at      timestamptz,
    outcome       text,
    held_s        double precision,
    gpu_seconds   double precision,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX lease_ledger_granted ON lease_ledger (granted_at);
CREATE INDEX lease_ledger_tenant ON lease_ledger (tenant, granted_at);

-- The capacity history: one row per accelerator per snapshot (once a minute by default).
CREATE TABLE telemetry_snapshots (
    accelerator          text NOT NULL,
    at                   timestamptz NOT NULL,
    pool                 text NOT NULL,
    node                 text NOT NULL,
    simulated            boolean NOT NULL,
    total_bytes          bigint NOT NULL,
    observed_used_bytes  bigint,
    external_bytes       bigint NOT NULL,
    resident_bytes       bigint NOT NULL,
    leased_bytes         bigint NOT NULL,
    reserve_bytes        bigint NOT NULL,
    schedulable_bytes    bigint NOT NULL,
    pressure             boolean NOT NULL,
    healthy              boolean NOT NULL,
    fresh                boolean NOT NULL,
    observed_at          timestamptz,
    received_at          timestamptz,
    PRIMARY KEY (accelerator, at)
);
CREATE INDEX telemetry_snapshots_at ON telemetry_snapshots (at);
