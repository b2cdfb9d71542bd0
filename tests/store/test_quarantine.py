"""No text can wedge the event log: NUL (which Postgres refuses in text and jsonb), lone
surrogates (not UTF-8), control characters and any other Unicode are stored escaped or as they
are; an event that still cannot be stored on its data is quarantined, readable, with an event
saying so, and the rest of its batch lands. Retries are for outages only."""

from __future__ import annotations

import uuid

from modelforge.events import EventRecord
from modelforge.store import Store

HOSTILE = [
    "a\x00b",  # NUL: the original wedge (a tenant from a gateway body)
    "\ud800lone",  # a lone surrogate: not encodable as UTF-8
    "line\nbreak\r\x1b[31m",  # control characters and an ANSI escape
    "\u202eevil\u200b",  # bidi override, zero-width space
    "名前🙂\U0001d518",  # CJK, emoji, astral plane
    "x" * 20_000,  # long
]


def _event(kind: str, text: str, **kw: object) -> EventRecord:
    return EventRecord(
        event_id=str(uuid.uuid4()),
        at=kw.pop("at", 1_800_000_000.0),  # type: ignore[arg-type]
        kind=kind,
        request_id=text[:300],
        message=text,
        payload={"tenant": text, text[:50]: [text, {"deep": text}], "nan": float("nan")},
        **kw,  # type: ignore[arg-type]
    )


async def test_hostile_text_in_any_field_is_stored_escaped_and_nothing_is_lost(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        events = [_event("request_refused", text) for text in HOSTILE]
        assert await store.record_events(events) == len(events)
        stored = await store.list_events(kind="request_refused", limit=100)
        assert len(stored) == len(HOSTILE)
        by_id = {row["event_id"]: row for row in stored}
        nul = by_id[events[0].event_id]
        assert nul["message"] == "a\\u0000b" and nul["payload"]["tenant"] == "a\\u0000b"
        assert by_id[events[1].event_id]["message"] == "\\ud800lone"
        assert by_id[events[4].event_id]["message"] == "名前🙂\U0001d518"  # kept as it is
        # Retried (an activity retry after a lost reply): nothing twice.
        await store.record_events(events)
        assert len(await store.list_events(kind="request_refused", limit=100)) == len(HOSTILE)
    finally:
        await store.close()


async def test_an_event_that_cannot_be_stored_is_quarantined_and_its_batch_lands(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        good = _event("lease_granted", "ok", lease_id="lease-1")
        bad = _event("invoke_failed", "model server said \x00", at=1e300)  # no timestamp can hold it
        after = _event("lease_released", "ok", lease_id="lease-1")
        # The write returns: the scheduler's retry loop is never stuck on this batch.
        assert await store.record_events([good, bad, after]) == 3
        kinds = [row["kind"] for row in await store.list_events(limit=100)]
        assert kinds.count("lease_granted") == 1 and kinds.count("lease_released") == 1
        [quarantined] = await store.quarantined_events()
        assert quarantined["event_id"] == bad.event_id
        assert "invoke_failed" in quarantined["record"] and "\\u0000" in quarantined["record"]
        assert quarantined["error"]
        [notice] = await store.list_events(kind="event_quarantined")
        assert notice["request_id"] == bad.request_id.replace("\x00", "\\u0000")
        assert "quarantined" in notice["message"]
        # The ledger row of the good events is whole: granted and ended.
        [row] = await store.ledger(lease_id="lease-1")
        assert row["granted_at"] is not None and row["ended_at"] is not None
        # Again (a retried activity): no duplicates anywhere.
        await store.record_events([good, bad, after])
        assert len(await store.quarantined_events()) == 1
        assert len(await store.list_events(kind="event_quarantined")) == 1
    finally:
        await store.close()
