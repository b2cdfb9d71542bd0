"""The store's history queries behind `modelforge events` and `usage` refuse out-of-range
arguments as REQUEST_INVALID instead of passing them to Postgres (which answered with a
traceback: a negative LIMIT, an interval out of range), and filter text that Postgres cannot
hold (NUL, lone surrogates) is compared as the store keeps it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from modelforge.events import EventRecord
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.store import Store
from tests.store.cli import modelforge


@pytest.mark.parametrize(
    "kwargs",
    [{"limit": -1}, {"limit": 0}, {"limit": 10**30}, {"after_seq": -5}, {"after_seq": 2**70}, {"limit": True}],
)
async def test_events_out_of_range_are_request_invalid(database_url: str, kwargs: dict[str, Any]) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        with pytest.raises(ModelForgeError) as raised:
            await store.list_events(**kwargs)
        assert raised.value.failure == FailureClass.REQUEST_INVALID
    finally:
        await store.close()


@pytest.mark.parametrize("since_s", [1e300 * 86400, float("inf"), float("nan"), -1.0, 0.0])
async def test_usage_out_of_range_is_request_invalid(database_url: str, since_s: float) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        with pytest.raises(ModelForgeError) as raised:
            await store.usage(since_s=since_s)
        assert raised.value.failure == FailureClass.REQUEST_INVALID
        assert await store.usage(since_s=36500 * 86400.0) == []  # the longest window is a query
    finally:
        await store.close()


async def test_filters_postgres_cannot_hold_match_as_stored(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        await store.record_events([EventRecord(event_id="e1", at=time.time(), kind="load", request_id="r1")])
        for field in ("request_id", "kind", "failure_class", "accelerator", "alert"):
            for text in ("r1\x00", "\ud800", "r1\n"):
                assert await store.list_events(**{field: text}) == []
        [row] = await store.list_events(request_id="r1")
        assert row["event_id"] == "e1"
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["events", "--limit", "-1"], "--limit must be between 1 and 100000"),
        (["events", "--kind", "load\x01"], None),
        (["usage", "--since", "1e300d"], "at most 36500d"),
        (["usage", "--since", "36500d", "--json"], None),
    ],
)
async def test_history_commands_against_a_real_database(
    database_url: str, tmp_path: Path, args: list[str], fragment: str | None
) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
    finally:
        await store.close()
    done = modelforge(database_url, tmp_path, *args)
    assert "Traceback" not in done.stderr, done.stderr
    if fragment is None:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2
    assert "REQUEST_INVALID" in done.stderr and fragment in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
