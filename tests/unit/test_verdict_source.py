"""The gateway's one reader of verdicts: many waiting streams of one pool share one query of its
scheduler a second, and each still reads its own request's verdict."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from modelforge import verdicts as scheduler_verdicts
from modelforge.gateway._verdict_source import WAITING_TTL_S, VerdictSource
from modelforge.policy import PoolState, apply_decisions, decide, enqueue, validate_request, verdicts
from modelforge.policy._state import note_service
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state


def _admit(s: PoolState, request_id: str, now: float) -> None:
    request = ask(request_id, "llm@1")
    _, priority = validate_request(s, request)
    enqueue(s, request, priority, now)
    apply_decisions(s, decide(s, now), now, {})


def _waiting_pool() -> list[Any]:
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    note_service(s, "llm@1", 10.0)
    _admit(s, "running", NOW)
    for n in range(10):
        _admit(s, f"w{n}", NOW + 1 + n)
    return verdicts(s, NOW + 20)


def test_many_waiting_streams_share_one_query_per_pool_and_each_reads_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = _waiting_pool()
    asked: list[str] = []

    async def pool_verdicts(client: object, pool: str | None = None, *, tenant: str = "") -> list[Any]:
        asked.append(str(pool))
        await asyncio.sleep(0.01)  # a query's round trip: the others arrive meanwhile
        return waiting

    monkeypatch.setattr(scheduler_verdicts, "pool_verdicts", pool_verdicts)
    source = VerdictSource(SimpleNamespace(temporal=object(), pool="default"))

    async def streams() -> list[dict[str, Any] | None]:
        return await asyncio.gather(*(source.of_request(f"w{n}", "llm@1") for n in range(10)))

    found = asyncio.run(streams())
    assert asked == ["default"], "ten waiting streams: one query"
    assert [v["request_id"] if v else None for v in found] == [f"w{n}" for n in range(10)]
    assert [v["position"]["in_class"] for v in found if v] == list(range(1, 11))
    # Another capability's request of the same id is not this one; an unknown id waits nowhere.
    assert asyncio.run(source.of_request("w0", "other@1")) is None
    assert asyncio.run(source.of_request("nobody")) is None
    assert asked == ["default"], f"within {WAITING_TTL_S} s the same answer serves"
