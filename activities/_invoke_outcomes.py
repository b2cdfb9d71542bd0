"""What each invoke on this node came to, kept a while after it ends, so that an answer whose
completion was lost in flight is not lost with it.

The Temporal SDK reports an activity's completion with a retry budget of about 10 s of its
own (its worker calls do not take the client's `retry_config`): when Temporal is away longer
than that as an invoke ends, the completion is dropped with a log line, the work done and its
lease released. The request workflow then hears only its invoke's heartbeat timeout, with
heartbeats recorded (it ran), and asks this node for the outcome (`collect_invoke`) before it
calls the request failed: seen in tests/faults/test_restart_temporal.py, one request in 40 at
a 12 s restart under load."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from modelforge.messages import InvokeResult

# Long enough for the request workflow to ask: its invoke's heartbeat timeout (60 s) after the
# last heartbeat, plus Temporal coming back; bounded in number too (oldest ended first).
KEEP_S = 600.0
KEEP = 4096


@dataclass
class InvokeOutcome:
    request_id: str
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    result: InvokeResult | None = None
    error: BaseException | None = None
    ended_at: float = 0.0


class InvokeOutcomes:
    """By lease id: one invoke a lease (a retried request runs on a fresh lease)."""

    def __init__(self, keep_s: float = KEEP_S, keep: int = KEEP, clock: Callable[[], float] = time.monotonic) -> None:
        self._keep_s = keep_s
        self._keep = keep
        self._clock = clock
        self._outcomes: OrderedDict[str, InvokeOutcome] = OrderedDict()

    def begin(self, lease_id: str, request_id: str) -> InvokeOutcome:
        self._prune()
        outcome = InvokeOutcome(request_id)
        self._outcomes.pop(lease_id, None)
        self._outcomes[lease_id] = outcome
        return outcome

    def end(self, outcome: InvokeOutcome, result: InvokeResult | None, error: BaseException | None) -> None:
        outcome.result, outcome.error, outcome.ended_at = result, error, self._clock()
        outcome.ended.set()

    def find(self, lease_id: str, request_id: str) -> InvokeOutcome | None:
        """The invoke of `lease_id` for `request_id`, running or ended; None when this node never
        ran it, was restarted since, or forgot it (ended more than KEEP_S ago)."""
        self._prune()
        outcome = self._outcomes.get(lease_id)
        return outcome if outcome is not None and outcome.request_id == request_id else None

    def _prune(self) -> None:
        """From the oldest begun: O(1) an invoke amortized (this is on the warm path). One still
        running at the front holds the rest until it ends; a node runs few at once."""
        horizon = self._clock() - self._keep_s
        while self._outcomes:
            key, oldest = next(iter(self._outcomes.items()))
            if not oldest.ended.is_set() or (oldest.ended_at >= horizon and len(self._outcomes) <= self._keep):
                return
            del self._outcomes[key]

    def __len__(self) -> int:
        return len(self._outcomes)
