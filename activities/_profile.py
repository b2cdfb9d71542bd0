"""`modelforge profile`: a deployment's envelope measured on the node that holds it, under a lease
like any other request (so profiling never disrupts production), by running invokes of growing
size and concurrency while sampling the bytes of the model's processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import PROFILE_OPERATION

__all__ = ["PROFILE_OPERATION", "ProfileCase", "case_payload", "profile_cases", "run_profile"]
# PROFILE_OPERATION is asked for by RequestInput.operation (the CLI's `modelforge profile`), copied
# by the request workflow to InvokeInput.operation: never by a key in a client's input.

MAX_CASES = 64
MAX_WORDS = 32_768
MAX_BATCH = 1024
MAX_CONCURRENCY = 64
# Words in flight at once in one case (batch x words x concurrency), and over all cases: what a
# profile may make the node build and send, so one request cannot balloon the worker.
MAX_CASE_WORDS = 262_144
MAX_TOTAL_WORDS = 2_097_152
_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
]


@dataclass(frozen=True)
class ProfileCase:
    batch_size: int
    context_words: int
    concurrency: int


def _counts(spec: dict[str, Any], name: str, default: list[int], high: int) -> list[int]:
    values = spec.get(name, default)
    if (
        not isinstance(values, list)
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= high for v in values)
    ):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"profile {name}: a list of whole numbers from 1 to {high}")
    return sorted(set(values))


def profile_cases(spec: dict[str, Any], chat: bool) -> list[ProfileCase]:
    batch_sizes = [1] if chat else _counts(spec, "batch_sizes", [1, 8, 32], MAX_BATCH)
    words = _counts(spec, "context_words", [16, 256], MAX_WORDS)
    concurrency = _counts(spec, "concurrency", [1, 2], MAX_CONCURRENCY)
    cases = [ProfileCase(b, w, c) for c in concurrency for w in words for b in batch_sizes]
    if len(cases) > MAX_CASES:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"profile: {len(cases)} cases, at most {MAX_CASES}")
    largest = max(c.batch_size * c.context_words * c.concurrency for c in cases)
    if largest > MAX_CASE_WORDS:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID,
            f"profile: a case of {largest} words in flight (batch x words x concurrency), at most {MAX_CASE_WORDS}",
        )
    total = sum(c.batch_size * c.context_words * c.concurrency for c in cases)
    if total > MAX_TOTAL_WORDS:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, f"profile: {total} words over all cases, at most {MAX_TOTAL_WORDS}"
        )
    return cases


def case_payload(case: ProfileCase, chat: bool, serial: int) -> dict[str, Any]:
    def text(n: int) -> str:
        return " ".join(_WORDS[(serial + n + i) % len(_WORDS)] for i in range(case.context_words))

    if chat:
        return {"messages": [{"role": "user", "content": text(0)}], "max_tokens": 16}
    return {"texts": [text(n) for n in range(case.batch_size)]}


def _payloads(case: ProfileCase, chat: bool, number: int) -> list[dict[str, Any]]:
    return [case_payload(case, chat, number + n) for n in range(case.concurrency)]


async def run_profile(
    spec: dict[str, Any],
    chat: bool,
    invoke: Callable[[dict[str, Any]], Awaitable[Any]],
    held_bytes: Callable[[], int],
    heartbeat: Callable[[str], None],
    interval_s: float = 0.05,
) -> dict[str, Any]:
    """Idle bytes before any case, then each case's peak, sampled every `interval_s` while its
    invokes run (`held_bytes` runs in a thread: NVML calls block)."""
    cases = profile_cases(spec, chat)
    idle = await asyncio.to_thread(held_bytes)
    results = []
    for number, case in enumerate(cases):
        done = asyncio.Event()
        peaks = [idle]

        async def sample(done: asyncio.Event = done, peaks: list[int] = peaks) -> None:
            while not done.is_set():
                peaks.append(await asyncio.to_thread(held_bytes))
                await asyncio.sleep(interval_s)

        # Built in a thread: even a bounded case is megabytes of text, never made on the event loop.
        payloads = await asyncio.to_thread(_payloads, case, chat, number)
        sampler = asyncio.create_task(sample())
        started = time.monotonic()
        try:
            await asyncio.gather(*(invoke(payload) for payload in payloads))
        finally:
            done.set()
            await sampler
        peak = max([*peaks, await asyncio.to_thread(held_bytes)])
        results.append(
            {
                "batch_size": case.batch_size,
                "context_words": case.context_words,
                "concurrency": case.concurrency,
                "peak_bytes": peak,
                "seconds": round(time.monotonic() - started, 4),
            }
        )
        del payloads
        heartbeat(f"profiled {number + 1}/{len(cases)} cases")
    return {
        "idle_bytes": idle,
        "peak_bytes": max([idle, *(r["peak_bytes"] for r in results)]),
        "cases": results,
    }
