"""The one home of back-off for the worker processes' long-running loops (and for the restarts
`modelforge dev` makes of its workers): a failure of Temporal or Postgres (a timeout, a refused
connection, a restart) is ridden out, never the end of the process.

The delays are deterministic: `initial_s`, doubling, capped at `cap_s` (1 s to 30 s unless
configured), without jitter, so a test or an operator can say when the next try comes. Each
failure is one structured log line. `asyncio.CancelledError` (and any other BaseException that
is not an Exception: KeyboardInterrupt, SystemExit) always goes through: cancelling is how a
worker stops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from modelforge.logging import get_logger

T = TypeVar("T")

_log = get_logger("modelforge.retrying")


@dataclass(frozen=True)
class Backoff:
    """Delays of `initial_s`, doubling per failure, at most `cap_s`."""

    initial_s: float = 1.0
    cap_s: float = 30.0

    def delay_s(self, failures: int) -> float:
        """The wait after the `failures`-th failure in a row (1 for the first)."""
        if failures <= 0:
            return 0.0
        # 2**n overflows float for a loop failing for days: past the cap the doubling is moot.
        exponent = min(failures - 1, 64)
        return min(self.cap_s, self.initial_s * 2.0**exponent)


# The default of every loop; a test may replace it (module attribute, read at each call).
DEFAULT_BACKOFF = Backoff()


def describe(error: BaseException) -> str:
    """`Type: first line of the message`, at most 300 characters: one log field."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return line[:300]


async def retrying(
    step: Callable[[], Awaitable[T]],
    what: str,
    *,
    logger: Any = None,
    backoff: Backoff | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    **fields: Any,
) -> T:
    """`await step()` until it returns, backing off after each Exception it raises (logged as
    `retrying`, with `what`, the attempt, the wait and the error). Never gives up: the caller
    cancels it to stop."""
    policy = backoff or DEFAULT_BACKOFF
    log = logger or _log
    failures = 0
    while True:
        try:
            result = await step()
        except Exception as error:
            failures += 1
            delay = policy.delay_s(failures)
            log.warning("retrying", what=what, attempt=failures, retry_in_s=delay, error=describe(error), **fields)
            await sleep(delay)
            continue
        if failures:
            log.info("retry_succeeded", what=what, attempts=failures + 1, **fields)
        return result


async def supervised(
    loop: Callable[[], Awaitable[None]],
    what: str,
    *,
    logger: Any = None,
    backoff: Backoff | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    **fields: Any,
) -> None:
    """Run the long-running `loop()`; whenever it raises an Exception, log `loop_failed` and run
    it again after the back-off. It returns when `loop()` returns. A run that lasted at least
    the cap before it failed starts the back-off afresh (a loop failing once a day is restarted
    after `initial_s`, not after the cap)."""
    policy = backoff or DEFAULT_BACKOFF
    log = logger or _log
    failures = 0
    while True:
        started = clock()
        try:
            await loop()
            return
        except Exception as error:
            if clock() - started >= policy.cap_s:
                failures = 0
            failures += 1
            delay = policy.delay_s(failures)
            log.warning(
                "loop_failed", loop=what, failures=failures, restart_in_s=delay, error=describe(error), **fields
            )
            await sleep(delay)
