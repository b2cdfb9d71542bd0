"""The one place the gateway reads what a waiting request waits on: `GET /v1/requests/{id}`, the
verdict lines of OpenAI and Ollama streams, the status page and the dry runs all ask here, and
here asks `modelforge.verdicts` (the scheduler's `verdicts` and `admission_check` queries, as the
CLI's `queue`, `why` and `--dry-run` do), so every surface says the same thing about the same
request. A verdict and a check are the JSON those define (`Verdict.to_json()`,
`AdmissionCheck.to_json()`; modelforge/verdicts.py). Asking writes no workflow history.

One request's verdict (a waiting stream asks every couple of seconds, `GET /v1/requests/{id}`
on each call) is read from its pool's whole queue of verdicts, one `verdicts` query per pool
shared by every caller for `WAITING_TTL_S`: a hundred waiting streams cost their scheduler one
query a second, not fifty. The status page's cards and residents come from the schedulers'
`state` query (where each card's memory goes, by process), one answer per pool shared by every
caller for `SNAPSHOT_TTL_S`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from modelforge import verdicts as scheduler_verdicts
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.names import scheduler_id
from modelforge.policy import PoolState

# How long one pool's state answers every verdict asked of it (streams ask about twice a second).
SNAPSHOT_TTL_S = 1.0
# How long one pool's queue of verdicts answers every request's verdict asked of it.
WAITING_TTL_S = 1.0


@dataclass
class _Snapshot:
    state: PoolState
    taken_at: float


@dataclass
class _Waiting:
    """One pool's waiting requests' verdicts by request id (an id names one request per
    capability, so a list)."""

    by_id: dict[str, list[scheduler_verdicts.Verdict]]
    taken_at: float


class VerdictSource:
    """Verdicts of waiting requests, from the requester's Temporal client (a requester without
    one, a test's fake, has none: every answer is None or empty)."""

    def __init__(self, requester: Any) -> None:
        self._requester = requester
        self._snapshots: dict[str, _Snapshot] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._waiting_locks: dict[str, asyncio.Lock] = {}

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
        waiting: admitted, done, or not yet asked) or none answers."""
        if not self.available:
            return None
        for pool in await self.pools():
            for found in (await self._waiting_in(pool)).get(request_id, ()):
                if not capability or found.capability == capability:
                    return found.to_json()
        return None

    async def _waiting_in(self, pool: str) -> dict[str, list[scheduler_verdicts.Verdict]]:
        """The pool's waiting requests' verdicts, as of at most WAITING_TTL_S ago (empty when its
        scheduler does not answer)."""
        lock = self._waiting_locks.setdefault(pool, asyncio.Lock())
        async with lock:
            cached = self._waiting.get(pool)
            if cached is not None and time.monotonic() - cached.taken_at < WAITING_TTL_S:
                return cached.by_id
            try:
                found = await scheduler_verdicts.pool_verdicts(self._requester, pool)
            except ModelForgeError:
                found = []
            by_id: dict[str, list[scheduler_verdicts.Verdict]] = {}
            for verdict in found:
                by_id.setdefault(verdict.request_id, []).append(verdict)
            self._waiting[pool] = _Waiting(by_id, time.monotonic())
            return by_id

    async def of_pool(self, pool: str) -> list[dict[str, Any]]:
        """Every waiting request's verdict in one pool, in its queue order ([] when its scheduler
        does not answer)."""
        try:
            found = await scheduler_verdicts.pool_verdicts(self._requester, pool)
        except ModelForgeError:
            return []
        return [verdict.to_json() for verdict in found]

    async def check(self, spec: scheduler_verdicts.CheckSpec) -> dict[str, Any]:
        """The dry run of `spec` (now, later or never), as the scheduler's policy decides it."""
        if not self.available:
            raise ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, "this gateway has no pools to ask")
        return (await scheduler_verdicts.admission_check(self._requester, spec)).to_json()


def verdict_status(verdict: dict[str, Any]) -> str:
    """A verdict as one line of text (an Ollama progress line's `status`)."""
    position = verdict.get("position") or {}
    eta = verdict.get("eta") or {}
    said = (
        f"waiting: #{position.get('in_class', '?')} of {position.get('class_depth', '?')} in "
        f"{verdict.get('priority', '?')}: {verdict.get('message') or verdict.get('reason', '')}"
    )
    seconds, at_most, at_least = eta.get("seconds"), eta.get("at_most_s"), eta.get("at_least_s")
    if isinstance(seconds, int | float):
        said += f"; about {seconds:.0f} s ({eta.get('basis', '')})"
    elif isinstance(at_most, int | float):
        said += f"; at most {at_most:.0f} s ({eta.get('basis', '')})"
    elif isinstance(at_least, int | float):
        said += f"; at least {at_least:.0f} s ({eta.get('basis', '')})"
    if eta.get("after_expiry"):
        said += ", past its expiry"
    return said
