"""What each invoke on this node came to, kept a while after it ends, so that an answer whose
completion was lost in flight is not lost with it.

The Temporal SDK reports an activity's completion with a retry budget of about 10 s of its
own (its worker calls do not take the client's `retry_config`): when Temporal is away longer
than that as an invoke ends, the completion is dropped with a log line, the work done and its
lease released. The request workflow then hears only its invoke's heartbeat timeout and asks
this node for the outcome (`collect_invoke`) before it calls the request failed or runs it
again: seen in tests/faults/test_restart_temporal.py, one request in 40 at a 12 s restart
under load."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from modelforge.messages import InvokeResult

# Long enough for the request workflow to ask: its invoke's heartbeat timeout (60 s) after the
# last heartbeat, plus Temporal coming back. Bounded in number too (the earliest ended go
# first): at a sustained rate above KEEP / KEEP_S invokes a second the window is shorter.
KEEP_S = 600.0
KEEP = 4096


@dataclass
class InvokeOutcome:
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    result: InvokeResult | None = None
    # The failure as its class, message and retryability: no exception object is kept (its
    # traceback would hold the call's frames, its payload and model, for KEEP_S).
    failure: tuple[str, str, bool] | None = None
    cancelled: bool = False  # stopped on the node before it ended (Temporal timed it out)
    ended_at: float = 0.0


class InvokeOutcomes:
    """By (lease id, request id): a slot lent to the node serves many requests under one lease
    id. Running invokes are apart from ended ones, which are kept in the order they ended, so
    forgetting is O(1) an invoke and one long invoke holds nothing else back."""

    def __init__(self, keep_s: float = KEEP_S, keep: int = KEEP, clock: Callable[[], float] = time.monotonic) -> None:
        self._keep_s = keep_s
        self._keep = keep
        self._clock = clock
        self._running: dict[tuple[str, str], InvokeOutcome] = {}
        self._ended: OrderedDict[tuple[str, str], InvokeOutcome] = OrderedDict()

    def begin(self, lease_id: str, request_id: str) -> InvokeOutcome:
        key = (lease_id, request_id)
        self._ended.pop(key, None)
        outcome = self._running[key] = InvokeOutcome()
        return outcome

    def end(
        self,
        lease_id: str,
        request_id: str,
        result: InvokeResult | None = None,
        failure: tuple[str, str, bool] | None = None,
        cancelled: bool = False,
    ) -> None:
        key = (lease_id, request_id)
        outcome = self._running.pop(key, None)
        if outcome is None:
            return
        outcome.result, outcome.failure, outcome.cancelled = result, failure, cancelled
        outcome.ended_at = self._clock()
        outcome.ended.set()
        self._ended[key] = outcome
        self._prune()

    def find(self, lease_id: str, request_id: str) -> InvokeOutcome | None:
        """The invoke of `lease_id` for `request_id`, running or ended; None when this node never
        ran it, was restarted since, or forgot it."""
        self._prune()
        key = (lease_id, request_id)
        return self._running.get(key) or self._ended.get(key)

    def _prune(self) -> None:
        horizon = self._clock() - self._keep_s
        while self._ended:
            oldest = next(iter(self._ended.values()))
            if oldest.ended_at >= horizon and len(self._ended) <= self._keep:
                return
            self._ended.popitem(last=False)

    def __len__(self) -> int:
        return len(self._running) + len(self._ended)
