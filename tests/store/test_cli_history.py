"""`modelforge usage`, `capacity` and `events --alert` as an operator runs them: a subprocess each
against a real database, as a table and as JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

from modelforge.events import EventRecord
from modelforge.messages import SnapshotBatch
from modelforge.store import Store
from tests.store.cli import modelforge
from tests.store.records import accelerator_status, released_event


async def test_usage_capacity_and_alerts_as_tables_and_json(database_url: str, tmp_path: Path) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
        now = time.time()
        await store.record_events(
            [
                released_event("l1", now - 10, 7200.0),  # acme: 2 GPU-hours
                released_event("l2", now - 5, 1800.0, tenant="lab", accelerators="a/0,a/1"),  # lab: 2 x 0.5 h
                EventRecord(event_id="p", at=now - 3, kind="gpu_pressure_entered", alert="GPU_PRESSURE"),
            ]
        )
        for minutes_ago, schedulable_gib in ((30, 10), (10, 2)):
            await store.record_snapshots(
                SnapshotBatch(
                    pool="default",
                    at=now - minutes_ago * 60,
                    accelerators=[accelerator_status("a/0", schedulable_gib << 30, 6 << 30)],
                ),
                retention_s=86400.0,
            )
    finally:
        await store.close()

    usage = json.loads(modelforge(database_url, tmp_path, "usage", "--json").stdout)
    assert {(u["tenant"], u["gpu_seconds"]) for u in usage} == {("acme", 7200.0), ("lab", 3600.0)}
    table = modelforge(database_url, tmp_path, "usage").stdout
    assert "GPU-hours" in table and "2.000" in table and "1.000" in table

    trend = json.loads(
        modelforge(database_url, tmp_path, "capacity", "--since", "1h", "--buckets", "1", "--json").stdout
    )
    assert sum(r["samples"] for r in trend) == 2 and min(r["min_schedulable_bytes"] for r in trend) == 2 << 30
    shown = modelforge(database_url, tmp_path, "capacity", "--since", "1h").stdout
    assert "a/0" in shown and "2.00 GiB" in shown and "10.00 GiB" in shown and "simulated" in shown
    empty = modelforge(database_url, tmp_path, "capacity", "--since", "1m").stdout
    assert "no snapshots in the last 1m" in empty

    alerts = modelforge(database_url, tmp_path, "events", "--alert", "*").stdout
    assert "ALERT GPU_PRESSURE" in alerts and "lease_released" not in alerts
