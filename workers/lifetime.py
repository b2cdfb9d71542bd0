"""How a worker process runs and stops: its Temporal workers are run until cancelled or until
one fails (then the caller's `supervised` loop starts fresh ones: a Worker cannot run twice),
and SIGTERM cancels the process's main task, so its `finally` blocks run (the node worker's
stop its model servers) instead of Python's default of ending the process on the spot."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine, Sequence
from typing import Any

from temporalio.worker import Worker

# How long a shutdown waits for the Temporal workers (in-flight activities are cancelled at
# once: the SDK's graceful timeout is 0) before it goes on without them.
SHUTDOWN_S = 10.0


async def run_workers(workers: Sequence[Worker], shutdown_s: float = SHUTDOWN_S) -> None:
    """Run these Temporal workers until cancelled. If one stops on its own (a fatal error: the
    namespace check timed out, a poll failed for good), the others are shut down too and its
    error raised, for the caller to start fresh ones."""
    runs = [asyncio.create_task(worker.run(), name=f"temporal-worker:{worker.task_queue}") for worker in workers]
    try:
        done, _ = await asyncio.wait(runs, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # the fatal error, if that is why it stopped
        raise RuntimeError(f"the Temporal worker on {sorted(w.task_queue for w in workers)} stopped")
    finally:
        stopping = asyncio.gather(*(worker.shutdown() for worker in workers), return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping, shutdown_s)
        for task in runs:
            task.cancel()
        await asyncio.wait(runs, timeout=2.0)
        for task in runs:  # retrieved, so none is reported as never retrieved
            if task.done() and not task.cancelled():
                task.exception()


async def until_sigterm(main: Coroutine[Any, Any, None], logger: Any, event: str) -> None:
    """Run `main` until it returns or SIGTERM arrives: then it is cancelled (its `finally` blocks
    run), `event` is logged and this returns normally (exit status 0)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    signalled = False

    def on_sigterm() -> None:
        nonlocal signalled
        signalled = True
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        installed = True
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread: no handler
        installed = False
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not signalled or (current is not None and current.cancelling()):
            raise
        logger.info(event, reason="SIGTERM")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if installed:
            loop.remove_signal_handler(signal.SIGTERM)
