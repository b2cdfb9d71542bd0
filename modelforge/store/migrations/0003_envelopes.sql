-- Envelopes measured by `modelforge profile`: one row per deployment and accelerator model. A
-- deployment is production eligible on an accelerator model it has a measured envelope for.
CREATE TABLE envelopes (
    deployment        text NOT NULL,
    accelerator_model text NOT NULL,
    accelerator       text NOT NULL,
    idle_bytes        bigint NOT NULL,
    peak_bytes        bigint NOT NULL,
    runtime           text NOT NULL,
    runtime_version   text NOT NULL,
    configuration     jsonb NOT NULL,
    cases             jsonb NOT NULL,
    simulated         boolean NOT NULL,
    measured_at       timestamptz NOT NULL,
    PRIMARY KEY (deployment, accelerator_model)
);
