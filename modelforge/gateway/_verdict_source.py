"""The one place the gateway reads what a waiting request waits on: `GET /v1/requests/{id}`, the
verdict lines of OpenAI and Ollama streams and the status page all ask here, so every surface says
the same thing about the same request.

A verdict is a JSON object: `request_id`, `pool`, `capability`, `priority`, `position` (its place
among the waiting requests of its class, of its capability and of the whole pool, 1 = next),
`reason` (what it waits on, the scheduler's own words), `assigned_to` (the resident whose load it
waits on, or ""), `waited_s`, `expires_in_s` (until its lease timeout or deadline), and `eta_s`
with `eta_basis` (how the estimate was made; `eta_s` null with basis "none" when there is none).

It is read from the pool schedulers' `state` query (one answer per pool, shared by every caller
for `SNAPSHOT_TTL_S`), so asking costs no workflow history."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from modelforge.names import scheduler_id
from modelforge.policy import PoolState, queue_order

# How long one pool's state answers every verdict asked of it (streams ask about twice a second).
SNAPSHOT_TTL_S = 1.0


@dataclass
class _Snapshot:
    state: PoolState
    taken_at: float


class VerdictSource:
    """Verdicts of waiting requests, from the requester's Temporal client (a requester without
    one, a test's fake, has none: every answer is None or empty)."""

    def __init__(self, requester: Any) -> None:
        self._requester = requester
        self._snapshots: dict[str, _Snapshot] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def available(self) -> bool:
        return getattr(self._requester, "temporal", None) is not None

    async def pools(self) -> list[str]:
        if not self.available:
            return []
        bound = getattr(self._requester, "pool", None)
        if bound is not None:
            return [bound]
        pools: list[str] = await self._requester.router.pools()
        return pools

    async def state(self, pool: str) -> PoolState | None:
        """The pool's scheduler state as of at most SNAPSHOT_TTL_S ago; None when it does not answer."""
        lock = self._locks.setdefault(pool, asyncio.Lock())
        async with lock:
            snapshot = self._snapshots.get(pool)
            if snapshot is not None and time.monotonic() - snapshot.taken_at < SNAPSHOT_TTL_S:
                return snapshot.state
            try:
                state: PoolState = await self._requester.temporal.get_workflow_handle(scheduler_id(pool)).query(
                    "state", result_type=PoolState, rpc_timeout=timedelta(seconds=10)
                )
            except Exception:  # a scheduler that does not answer has no verdicts to give
                return None
            self._snapshots[pool] = _Snapshot(state, time.monotonic())
            return state

    async def of_request(self, request_id: str, workflow_id: str = "") -> dict[str, Any] | None:
        """The verdict of one waiting request (by its id, and its workflow id when known), or None
        when no scheduler holds it in its queue (not waiting: admitted, done, or not yet asked)."""
        for pool in await self.pools():
            state = await self.state(pool)
            if state is None:
                continue
            for verdict in queue_verdicts(state):
                if verdict["request_id"] == request_id and (not workflow_id or verdict["workflow_id"] == workflow_id):
                    return verdict
        return None

    async def of_pool(self, pool: str) -> list[dict[str, Any]]:
        """Every waiting request's verdict in one pool, next to be served first."""
        state = await self.state(pool)
        return [] if state is None else queue_verdicts(state)


def queue_verdicts(state: PoolState, now: float | None = None) -> list[dict[str, Any]]:
    """The verdict of each request in the pool's queue, in the policy's own queue order."""
    now = time.time() if now is None else now
    per_class: dict[str, int] = {}
    per_capability: dict[str, int] = {}
    verdicts = []
    for overall, queued in enumerate(queue_order(state, now), start=1):
        per_class[queued.priority] = per_class.get(queued.priority, 0) + 1
        per_capability[queued.capability] = per_capability.get(queued.capability, 0) + 1
        verdicts.append(
            {
                "request_id": queued.request_id,
                "workflow_id": queued.workflow_id,
                "pool": state.pool,
                "capability": queued.capability,
                "tenant": queued.tenant,
                "priority": queued.priority,
                "position": {
                    "class": per_class[queued.priority],
                    "capability": per_capability[queued.capability],
                    "pool": overall,
                },
                "reason": queued.waiting_reason or ("waiting for its load" if queued.assigned_to else "waiting"),
                "assigned_to": queued.assigned_to,
                "waited_s": round(max(0.0, now - queued.submitted_at), 3),
                "expires_in_s": round(queued.expires_at - now, 3),
                "eta_s": None,
                "eta_basis": "none",
            }
        )
    return verdicts


def verdict_status(verdict: dict[str, Any]) -> str:
    """A verdict as one line of text (an Ollama progress line's `status`, the status page's)."""
    position = verdict.get("position") or {}
    eta = verdict.get("eta_s")
    said = f"waiting: #{position.get('class', '?')} in {verdict.get('priority', '?')}, {verdict.get('reason', '')}"
    if isinstance(eta, int | float):
        said += f", about {eta:.0f} s ({verdict.get('eta_basis', '')})"
    return said
