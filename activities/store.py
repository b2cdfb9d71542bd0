"""Activities of the control worker that touch Postgres."""

from __future__ import annotations

from temporalio import activity

from modelforge.domain import Catalog
from modelforge.events import EventRecord
from modelforge.logging import get_logger
from modelforge.messages import OpenLease, SnapshotBatch, UsageQuery
from modelforge.metrics import Metrics
from modelforge.store import Store

log = get_logger("modelforge.events")


class StoreActivities:
    def __init__(
        self, store: Store, snapshot_retention_s: float = 30 * 86400.0, metrics: Metrics | None = None
    ) -> None:
        self._store = store
        self._snapshot_retention_s = snapshot_retention_s
        self._metrics = metrics

    @activity.defn(name="load_catalog")
    async def load_catalog(self) -> Catalog:
        return await self._store.load_catalog()

    @activity.defn(name="record_events")
    async def record_events(self, events: list[EventRecord]) -> int:
        written = await self._store.record_events(events)
        if self._metrics is not None:
            self._metrics.observe_events(events)
        if activity.info().attempt == 1:
            for event in events:
                log.info(
                    event.kind,
                    failure_class=event.failure_class,
                    request_id=event.request_id,
                    lease_id=event.lease_id,
                    accelerator=event.accelerator,
                    deployment=event.deployment,
                    message=event.message,
                    alert=event.alert,
                )
        return written

    @activity.defn(name="usage_from_ledger")
    async def usage_from_ledger(self, query: UsageQuery) -> dict[str, float]:
        return await self._store.decayed_usage(pool=query.pool, half_life_s=query.half_life_s, as_of=query.as_of)

    @activity.defn(name="open_leases")
    async def open_leases(self, pool: str) -> list[OpenLease]:
        return await self._store.open_leases(pool)

    @activity.defn(name="record_snapshots")
    async def record_snapshots(self, batch: SnapshotBatch) -> int:
        return await self._store.record_snapshots(batch, self._snapshot_retention_s)
