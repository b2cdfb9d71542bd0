"""Event records and statuses the store tests build. A helper module: tests import it, never each
other."""

from __future__ import annotations

from typing import Any

from modelforge.events import EventRecord
from modelforge.policy import AcceleratorStatus


def released_event(lease: str, at: float, held_s: float, outcome: str = "ok", **kwargs: Any) -> EventRecord:
    granted = granted_event(lease, at - held_s, **kwargs)
    return EventRecord(
        event_id=f"x-{lease}",
        at=at,
        kind="lease_released",
        request_id=granted.request_id,
        lease_id=lease,
        accelerator=granted.accelerator,
        deployment="chat",
        message=outcome,
        payload={**granted.payload, "held_s": held_s, "outcome": outcome, "granted_at": at - held_s},
    )


def accelerator_status(acc: str, schedulable: int, external: int, *, pressure: bool = False) -> AcceleratorStatus:
    return AcceleratorStatus(
        id=acc,
        node="node-a",
        kind="gpu",
        model="sim",
        production_eligible=True,
        simulated=True,
        total_bytes=24 << 30,
        observed_used_bytes=external + (4 << 30),
        external_bytes=external,
        resident_bytes=4 << 30,
        leased_bytes=0,
        reserve_bytes=1 << 30,
        schedulable_bytes=schedulable,
        pressure=pressure,
        healthy=True,
        fresh=True,
        observation_age_s=2.0,
        observed_at=None,
    )


def granted_event(
    lease: str, at: float, *, tenant: str = "acme", accelerators: str = "node-a/0", nbytes: int = 2 << 30
):
    return EventRecord(
        event_id=f"g-{lease}",
        at=at,
        kind="lease_granted",
        request_id=f"r-{lease}",
        lease_id=lease,
        accelerator=accelerators.split(",")[0],
        deployment="chat",
        payload={
            "bytes": nbytes,
            "tenant": tenant,
            "capability": "chat.llm@1",
            "priority": "production",
            "pool": "default",
            "accelerators": accelerators,
        },
    )
