"""The Postgres store against a real server (embedded pgserver or MODELFORGE_DATABASE_URL)."""

from __future__ import annotations

from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.events import EventRecord
from modelforge.store import Store, redact


async def test_migrations_apply_once_and_catalog_round_trips(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        assert await store.migrate() == ["0001_initial.sql"]
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
