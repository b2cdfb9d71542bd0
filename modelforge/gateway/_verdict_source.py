"""The one place the gateway reads what a waiting request waits on: `GET /v1/requests/{id}`, the
verdict lines of OpenAI and Ollama streams and the status page all ask here, so every surface says
the same thing about the same request.

A verdict is the JSON object `modelforge.verdicts` defines (its module docstring): `request_id`,
`pool`, `capability`, `deployment`, `tenant`, `priority`, `waited_s`, `expires_at`, `reason` (a
typed wait reason) and `message` (the policy's own line), `position` (`in_class` of
`class_depth`, `in_deployment` of `deployment_depth`, `ahead_in_higher_classes`, `behind_class`)
and `eta` (`seconds`, `basis`, `quality`). Here it is read from the pool schedulers' `state`
query (one answer per pool, shared by every caller for `SNAPSHOT_TTL_S`): no workflow history is
written by asking; the typed reason and the ETA are not computed here (`reason` "pending" or
"other", `eta.basis` "unknown")."""

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

    async def of_request(self, request_id: str, capability: str = "") -> dict[str, Any] | None:
        """The verdict of one waiting request (by its id, and its capability when known: an id
        names one request per capability), or None when no scheduler holds it in its queue (not
        waiting: admitted, done, or not yet asked)."""
        for pool in await self.pools():
            state = await self.state(pool)
            if state is None:
                continue
            for verdict in queue_verdicts(state):
                if verdict["request_id"] == request_id and (not capability or verdict["capability"] == capability):
                    return verdict
        return None

    async def of_pool(self, pool: str) -> list[dict[str, Any]]:
        """Every waiting request's verdict in one pool, next to be served first."""
        state = await self.state(pool)
        return [] if state is None else queue_verdicts(state)


def queue_verdicts(state: PoolState, now: float | None = None) -> list[dict[str, Any]]:
    """The verdict of each request in the pool's queue, in the policy's own queue order: its
    position, the policy's own wait line (`message`; `reason` "pending" before a decision pass
    looked at it, else "other": not typed here), and no ETA (`eta.basis` "unknown")."""
    now = time.time() if now is None else now
    ordered = queue_order(state, now)
    deployments = {q.capability: _deployment_of(state, q.capability) for q in ordered}
    class_depth: dict[str, int] = {}
    deployment_depth: dict[str, int] = {}
    for queued in ordered:
        class_depth[queued.priority] = class_depth.get(queued.priority, 0) + 1
        deployment = deployments[queued.capability]
        deployment_depth[deployment] = deployment_depth.get(deployment, 0) + 1
    in_class: dict[str, int] = {}
    in_deployment: dict[str, int] = {}
    verdicts = []
    for ahead, queued in enumerate(ordered):
        deployment = deployments[queued.capability]
        in_class[queued.priority] = in_class.get(queued.priority, 0) + 1
        in_deployment[deployment] = in_deployment.get(deployment, 0) + 1
        higher = [q.priority for q in ordered[:ahead] if q.priority != queued.priority]
        reason = "other" if queued.waiting_reason else "pending"
        verdicts.append(
            {
                "request_id": queued.request_id,
                "pool": state.pool,
                "capability": queued.capability,
                "deployment": deployment,
                "tenant": queued.tenant,
                "priority": queued.priority,
                "state": "queued",
                "submitted_at": queued.submitted_at,
                "waited_s": round(max(0.0, now - queued.submitted_at), 3),
                "expires_at": queued.expires_at,
                "reason": reason,
                "reasons": [reason],
                "message": queued.waiting_reason,
                "position": {
                    "in_class": in_class[queued.priority],
                    "class_depth": class_depth[queued.priority],
                    "in_deployment": in_deployment[deployment],
                    "deployment_depth": deployment_depth[deployment],
                    "ahead_in_higher_classes": len(higher),
                    "behind_class": higher[0] if higher else None,
                },
                "eta": {"seconds": None, "at": None, "basis": "unknown", "quality": "none", "samples": 0},
                "load": None,
                "held_by": [],
                "computed_at": now,
            }
        )
    return verdicts


def _deployment_of(state: PoolState, capability: str) -> str:
    deployment = state.catalog.deployment_for(capability)
    return deployment.deployment_id if deployment is not None else capability


def verdict_status(verdict: dict[str, Any]) -> str:
    """A verdict as one line of text (an Ollama progress line's `status`)."""
    position = verdict.get("position") or {}
    eta = verdict.get("eta") or {}
    said = (
        f"waiting: #{position.get('in_class', '?')} of {position.get('class_depth', '?')} in "
        f"{verdict.get('priority', '?')}: {verdict.get('message') or verdict.get('reason', '')}"
    )
    seconds = eta.get("seconds")
    if isinstance(seconds, int | float):
        said += f"; about {seconds:.0f} s ({eta.get('basis', '')})"
    return said
