"""A record made in virtual time: a scenario replayed through the production policy with every
event the policy emits kept, stamped as the scheduler workflow stamps them (`EventRecord`s the
store writes, the lease ledger following from them), plus a capacity snapshot a minute per card
(the external processes' memory, as the telemetry workflow stores it).

What it is for: a long record without running the stack for days (the 7-day what-if speed
measurement, bench/whatif.py) and records whose effect under a catalog change is known (the
tests). The cards are simulated, and say so in every snapshot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from modelforge.domain import Accelerator
from modelforge.events import EventRecord
from modelforge.simulate._engine import Simulation
from modelforge.simulate._modelforge import ModelForgeScheduler
from modelforge.simulate._scenario import Scenario

SNAPSHOT_S = 60.0


@dataclass
class MadeRecord:
    events: list[EventRecord] = field(default_factory=list)
    # (epoch seconds, accelerator, pool, node, total, external, reserve) a minute per card.
    snapshots: list[tuple[float, str, str, str, int, int, int]] = field(default_factory=list)


def make_record(scenario: Scenario, start_epoch: float, *, snapshot_s: float = SNAPSHOT_S) -> MadeRecord:
    """Replay `scenario` (its t=0 at `start_epoch`) and keep what production would have
    recorded."""
    scheduler = ModelForgeScheduler(scenario)
    scheduler.events = []
    Simulation(scenario, scheduler).run()
    record = MadeRecord()
    for number, (now, event) in enumerate(scheduler.events):
        record.events.append(
            EventRecord(
                event_id=f"sim-{number}",
                at=start_epoch + now,
                kind=event.kind,
                failure_class=event.failure.value if event.failure else None,
                request_id=event.request_id,
                lease_id=event.lease_id,
                accelerator=event.accelerator,
                deployment=event.deployment,
                workflow_id=event.workflow_id,
                message=event.message,
                payload=_shifted(dict(event.payload), start_epoch),
                alert=event.alert.value if event.alert else None,
            )
        )
    end = max([r.t + r.service_s for r in scenario.requests] or [0.0])
    steps = int(end // snapshot_s) + 1
    # Each card of the catalog in force at a moment is snapshotted then (a card a change
    # brought in from its moment on, one it took out no more).
    in_force = sorted([(0.0, scenario.catalog), *scenario.catalog_changes], key=lambda change: change[0])
    cards: dict[str, list[tuple[float, float, Accelerator]]] = {}
    for n, (since, catalog) in enumerate(in_force):
        until = in_force[n + 1][0] if n + 1 < len(in_force) else math.inf
        for card in catalog.accelerators:
            cards.setdefault(card.id, []).append((since, until, card))
    for card_id, spans in cards.items():
        usage = [e for e in scenario.external if e.accelerator == card_id]
        for step in range(steps):
            t = step * snapshot_s
            at = next((c for since, until, c in spans if since <= t < until), None)
            if at is None:
                continue
            external = sum(e.bytes for e in usage if e.start_s <= t < e.end_s)
            record.snapshots.append(
                (start_epoch + t, at.id, at.pool, at.node, at.total_bytes, external, at.reserve_bytes)
            )
    return record


def _shifted(payload: dict[str, Any], start_epoch: float) -> dict[str, Any]:
    """Virtual moments in a payload (a grant's submission, a release's grant) as epoch seconds."""
    for key in ("submitted_at", "granted_at", "ended_at"):
        value = payload.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            payload[key] = start_epoch + value
    return payload


def record_rows(record: MadeRecord) -> dict[str, list[dict[str, Any]]]:
    """The rows `Store.record_rows` would return for this record, without a database: the
    ledger derived from the lease events the way the store derives it."""
    from modelforge.store._store import RECORD_EVENT_KINDS

    ledger: dict[str, dict[str, Any]] = {}
    for e in record.events:
        if e.kind not in ("lease_granted", "lease_released") or not e.lease_id:
            continue
        p = e.payload
        row = ledger.get(e.lease_id)
        if row is None or e.kind == "lease_granted":
            # As the store: a grant writes the row's lease columns; an end writes them only for
            # a row it creates.
            row = ledger.setdefault(e.lease_id, {"lease_id": e.lease_id, "granted_at": None, "ended_at": None})
            row.update(
                request_id=e.request_id,
                pool=p.get("pool"),
                tenant=p.get("tenant"),
                capability=p.get("capability"),
                deployment=e.deployment,
                priority=p.get("priority"),
            )
        if e.kind == "lease_granted":
            granted_at = p.get("granted_at")
            row["granted_at"] = float(granted_at) if isinstance(granted_at, int | float) else e.at
        elif row["ended_at"] is None:  # a lease ends once: the first end is kept
            ended_at = p.get("ended_at")
            row["ended_at"] = float(ended_at) if isinstance(ended_at, int | float) else e.at
            row["outcome"] = str(p.get("outcome") or e.message)
            if row["granted_at"] is None and p.get("granted_at") is not None:
                row["granted_at"] = float(p["granted_at"])
            held = p.get("held_s")
            if held is None and p.get("unheld") and row["granted_at"] is not None:
                held = max(0.0, row["ended_at"] - row["granted_at"])  # as the store, from the row's grant
            row["held_s"] = float(held or 0.0)
    kinds = set(RECORD_EVENT_KINDS)
    events = [
        {
            "kind": e.kind,
            "failure_class": e.failure_class,
            "request_id": e.request_id,
            "lease_id": e.lease_id,
            "accelerator": e.accelerator,
            "deployment": e.deployment,
            "message": e.message,
            "payload": e.payload,
            "at": e.at,
        }
        for e in record.events
        if e.kind in kinds
    ]
    snapshots = [
        {"accelerator": a, "pool": pool, "at": at, "total_bytes": total, "external_bytes": ext, "reserve_bytes": res}
        for at, a, pool, _, total, ext, res in record.snapshots
    ]
    rows = sorted(ledger.values(), key=lambda r: (r["granted_at"] or r["ended_at"] or 0.0, r["lease_id"]))
    return {"ledger": rows, "events": events, "snapshots": snapshots}
