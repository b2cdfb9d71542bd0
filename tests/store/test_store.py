"""The Postgres store against a real server (embedded pgserver or MODELFORGE_DATABASE_URL)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.events import EventRecord
from modelforge.failures import ModelForgeError
from modelforge.messages import SnapshotBatch
from modelforge.store import Store, redact
from tests.store.records import accelerator_status, granted_event, released_event


async def test_migrations_apply_once_and_catalog_round_trips(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        assert await store.migrate() == [
            "0001_initial.sql",
            "0002_ledger_snapshots_alerts.sql",
            "0003_envelopes.sql",
            "0004_catalog_queues.sql",
            "0005_events_quarantine.sql",
            "0006_catalog_history.sql",
            "0007_ledger_open_leases.sql",
        ]
        assert await store.migrate() == []  # re-run: nothing new
        catalog, _ = load_catalog_file(example_catalog_path())
        await store.apply_catalog(catalog)
        await store.apply_catalog(catalog)  # idempotent
        loaded = await store.load_catalog()
        assert sorted(loaded.accelerators, key=lambda a: a.id) == sorted(catalog.accelerators, key=lambda a: a.id)
        assert sorted(loaded.deployments, key=lambda d: d.capability) == sorted(
            catalog.deployments, key=lambda d: d.capability
        )
        assert sorted(loaded.tenants, key=lambda t: t.name) == sorted(catalog.tenants, key=lambda t: t.name)
        # Applying a smaller catalog removes what it no longer declares.
        smaller = type(catalog)(
            accelerators=catalog.accelerators, deployments=catalog.deployments[:1], tenants=catalog.tenants
        )
        await store.apply_catalog(smaller)
        assert [d.capability for d in (await store.load_catalog()).deployments] == ["rag.embedding@1"]

        # Configured queues (queues-seed003.toml) round-trip in the file's order (it breaks ties between equal
        # priorities); a catalog without queues goes back to the built-in classes.
        queued, _ = load_catalog_file(example_catalog_path().parent / "queues-seed003.toml")
        await store.apply_catalog(queued)
        loaded = await store.load_catalog()
        assert loaded.queues == queued.queues
        assert list(loaded.classes) == list(queued.classes)
        assert sorted(loaded.tenants, key=lambda t: t.name) == sorted(queued.tenants, key=lambda t: t.name)
        await store.apply_catalog(catalog)
        assert (await store.load_catalog()).queues == []
    finally:
        await store.close()


async def test_event_writes_are_idempotent(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        events = [
            EventRecord(
                event_id=f"e{n}", at=1_700_000_000.0 + n, kind="lease_granted", request_id="r1", payload={"bytes": n}
            )
            for n in range(3)
        ]
        await store.record_events(events)
        await store.record_events(events)  # an activity retry writes nothing twice
        rows = await store.list_events(request_id="r1")
        assert [r["event_id"] for r in rows] == ["e0", "e1", "e2"]
        assert rows[2]["payload"] == {"bytes": 2}
    finally:
        await store.close()


def test_redacted_urls_never_show_the_password() -> None:
    shown = redact("postgresql://modelforge:s3cret@db.internal:5432/mf")
    assert "s3cret" not in shown and "db.internal" in shown


async def test_lease_ledger_is_whole_whichever_event_lands_first(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        now = time.time()
        # l1: grant then release; l2: the release batch lands first (a retried write), then the grant;
        # l3: a two-card gang lease; l4: still held.
        await store.record_events([granted_event("l1", now - 100)])
        await store.record_events([released_event("l1", now - 40, 60.0)])
        await store.record_events([released_event("l2", now - 10, 30.0, outcome="RUNTIME_CRASH", tenant="lab")])
        await store.record_events([granted_event("l2", now - 40, tenant="lab")])
        await store.record_events([released_event("l3", now - 5, 10.0, accelerators="node-a/0,node-a/1", tenant="lab")])
        await store.record_events([granted_event("l4", now - 1)])
        await store.record_events([released_event("l1", now - 40, 60.0)])  # a retry changes nothing
        rows = {row["lease_id"]: row for row in await store.ledger()}
        assert set(rows) == {"l1", "l2", "l3", "l4"}
        assert rows["l1"]["outcome"] == "ok" and rows["l1"]["gpu_seconds"] == 60.0
        assert rows["l2"]["outcome"] == "RUNTIME_CRASH" and rows["l2"]["tenant"] == "lab"
        assert rows["l2"]["granted_at"] is not None and rows["l2"]["ended_at"] is not None
        assert rows["l3"]["accelerators"] == ["node-a/0", "node-a/1"]
        assert rows["l3"]["gpu_seconds"] == 20.0  # 10 s on each of two cards
        assert rows["l4"]["ended_at"] is None
        usage = {row["tenant"]: row for row in await store.usage()}
        # acme: l1 60 GPU-s + l4 open; lab: l2 30 + l3 2 x 10 = 50 GPU-s.
        assert (usage["acme"]["leases"], usage["acme"]["open"], usage["acme"]["gpu_seconds"]) == (2, 1, 60.0)
        assert (usage["lab"]["leases"], usage["lab"]["gpu_seconds"], usage["lab"]["not_ok"]) == (2, 50.0, 1)
        # 2 GiB x 60 GPU-s
        assert usage["acme"]["gib_gpu_seconds"] == pytest.approx(120.0)
        recent = {row["tenant"]: row for row in await store.usage(since_s=30)}
        assert set(recent) == {"lab", "acme"} and recent["acme"]["leases"] == 1  # only l4 started within 30 s
        by_capability = await store.usage(by="capability")
        assert [row["capability"] for row in by_capability] == ["chat.llm@1"]
        with pytest.raises(ModelForgeError, match="tenant or capability"):
            await store.usage(by="priority; DROP TABLE lease_ledger")
    finally:
        await store.close()


async def test_open_leases_are_the_pools_rows_without_an_end_and_a_lease_ends_once(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        now = time.time()
        await store.record_events(
            [granted_event("o1", now - 30), granted_event("o2", now - 20), granted_event("o3", now - 10)]
        )
        await store.record_events([released_event("o2", now - 5, 15.0)])
        other = granted_event("o4", now - 8)
        await store.record_events([replace(other, payload={**other.payload, "pool": "lab"})])
        opened = await store.open_leases("default")
        assert [lease.lease_id for lease in opened] == ["o1", "o3"]  # oldest first, o2 ended, o4 elsewhere
        assert opened[0].request_id == "r-o1" and opened[0].capability == "chat.llm@1"
        assert opened[0].accelerators == ["node-a/0"] and opened[0].bytes == 2 << 30
        assert opened[0].granted_at == pytest.approx(now - 30, abs=0.01)
        assert [lease.lease_id for lease in await store.open_leases("lab")] == ["o4"]
        # A second end of the same lease (a release reapplied after a reset, a forgotten lease
        # closed as its holder's own end landed) keeps the first.
        second = released_event("o2", now, 20.0, outcome="reclaimed: no longer held")
        await store.record_events([replace(second, event_id="x2-o2")])
        [row] = await store.ledger(lease_id="o2")
        assert row["outcome"] == "ok" and row["held_s"] == 15.0
    finally:
        await store.close()


async def test_snapshots_keep_the_retention_and_show_the_trend(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        now = time.time()
        day = 86400.0
        old = SnapshotBatch(pool="default", at=now - 3 * day, accelerators=[accelerator_status("a/0", 1, 1)])
        await store.record_snapshots(old, retention_s=7 * day)
        for minutes_ago, schedulable, external, pressure in [(50, 10, 5, False), (20, 3, 12, True), (5, 8, 6, False)]:
            batch = SnapshotBatch(
                pool="default",
                at=now - minutes_ago * 60,
                accelerators=[accelerator_status("a/0", schedulable << 30, external << 30, pressure=pressure)],
            )
            await store.record_snapshots(batch, retention_s=7 * day)
            await store.record_snapshots(batch, retention_s=7 * day)  # a retry inserts nothing twice
        assert len(await store.snapshots()) == 4
        # A shorter retention drops the three-day-old row at the next write.
        await store.record_snapshots(
            SnapshotBatch(pool="default", at=now, accelerators=[accelerator_status("a/0", 9 << 30, 5 << 30)]),
            retention_s=1 * day,
        )
        rows = await store.snapshots()
        assert len(rows) == 4 and min(r["at"].timestamp() for r in rows) > now - day
        assert rows[0]["received_at"].timestamp() == pytest.approx(now - 2.0, abs=0.01)
        whole = await store.capacity(since_s=3600, buckets=1)
        # One bucket may straddle the hour's edge: at most two, and the worst values are those of 20 min ago.
        assert 1 <= len(whole) <= 2
        assert min(r["min_schedulable_bytes"] for r in whole) == 3 << 30
        assert max(r["max_external_bytes"] for r in whole) == 12 << 30
        assert any(r["pressure"] for r in whole) and sum(r["samples"] for r in whole) == 4
        fine = await store.capacity(since_s=3600, buckets=60)
        assert sum(r["samples"] for r in fine) == 4 and len(fine) == 4
        assert await store.capacity(since_s=3600, accelerator="other/0") == []
    finally:
        await store.close()


async def test_events_filter_by_alert(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        await store.record_events(
            [
                EventRecord(event_id="p1", at=1.0, kind="gpu_pressure_entered", alert="GPU_PRESSURE"),
                EventRecord(event_id="c1", at=2.0, kind="capacity_alert_raised", alert="CAPABILITY_CAPACITY"),
                EventRecord(event_id="n1", at=3.0, kind="lease_granted"),
            ]
        )
        assert [e["event_id"] for e in await store.list_events(alert="GPU_PRESSURE")] == ["p1"]
        assert [e["event_id"] for e in await store.list_events(alert="*")] == ["p1", "c1"]
    finally:
        await store.close()


async def test_decayed_usage_from_the_ledger(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        now = time.time()
        hour = 3600.0
        # acme: 100 GPU-s ended now, 100 ended one half-life ago -> 100 + 50 = 150.
        # lab: 80 GPU-s ended two half-lives ago -> 20; an open lease counts nothing yet.
        await store.record_events(
            [
                released_event("a1", now, 100.0),
                released_event("a2", now - hour, 100.0),
                released_event("b1", now - 2 * hour, 80.0, tenant="lab"),
                granted_event("b2", now, tenant="lab"),
            ]
        )
        usage = await store.decayed_usage(pool="default", half_life_s=hour, as_of=now)
        assert usage == {"acme": pytest.approx(150.0, rel=1e-6), "lab": pytest.approx(20.0, rel=1e-6)}
        assert await store.decayed_usage(pool="other", half_life_s=hour, as_of=now) == {}
    finally:
        await store.close()
