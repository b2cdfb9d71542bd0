-- Events that could not be stored on their data (not on an outage): kept readable as escaped
-- JSON text with the error, so one bad row never blocks the event log, the ledger or the
-- scheduler waiting on them. Each has an `event_quarantined` event in the log.
CREATE TABLE events_quarantine (
    event_id        text PRIMARY KEY,
    quarantined_at  timestamptz NOT NULL DEFAULT now(),
    record          text NOT NULL,
    error           text NOT NULL
);
