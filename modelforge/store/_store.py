"""Postgres: ordered migrations, the catalog, and the event log (psycopg 3 with a pool).
Every statement is parameterized; nothing is built by string formatting."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from modelforge.catalog import parse_catalog
from modelforge.domain import Catalog, fair_share_entity
from modelforge.events import EventRecord
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.identifiers import storable, storable_text
from modelforge.messages import OpenLease, SnapshotBatch

_MIGRATION_LOCK = 0x6D666F7267  # "mforg": one migrator at a time
# The longest look-back a history query takes (a century; Postgres intervals are finite).
MAX_WINDOW_S = 36500 * 86400.0
# The most events one query returns.
MAX_EVENTS = 100_000


def _migrations() -> list[tuple[int, str, str]]:
    folder = resources.files("modelforge.store") / "migrations"
    found = []
    for entry in folder.iterdir():
        name = entry.name
        if name.endswith(".sql"):
            found.append((int(name.split("_", 1)[0]), name, entry.read_text(encoding="utf-8")))
    return sorted(found)


def redact(url: str) -> str:
    """A database URL safe to print: the password never leaves the process."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<unparseable database url>"
    host = info.get("host") or "localhost"
    return f"postgresql://{info.get('user') or ''}@{host}/{info.get('dbname') or ''}"


class Store:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self._pool = pool

    @classmethod
    async def open(cls, url: str, *, min_size: int = 1, max_size: int = 4, timeout: float = 10.0) -> Store:
        pool = AsyncConnectionPool(url, min_size=min_size, max_size=max_size, open=False, timeout=timeout)
        try:
            await pool.open(wait=True, timeout=timeout)
        except Exception as error:
            await pool.close()
            raise ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE, f"cannot reach Postgres at {redact(url)}: {type(error).__name__}"
            ) from None
        return cls(pool)

    async def close(self) -> None:
        await self._pool.close()

    async def migrate(self) -> list[str]:
        applied: list[str] = []
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version int PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            rows = await (await conn.execute("SELECT version FROM schema_migrations")).fetchall()
            done = {row[0] for row in rows}
            for version, name, sql in _migrations():
                if version in done:
                    continue
                await conn.execute(sql.encode())  # a trusted file from the package, not user input
                await conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, name))
                applied.append(name)
        return applied

    async def apply_catalog(self, catalog: Catalog) -> dict[str, int]:
        """Replace the catalog atomically: every row of the file, nothing else, or no change."""
        async with self._pool.connection() as conn, conn.transaction():
            for acc in catalog.accelerators:
                await conn.execute(
                    "INSERT INTO catalog_accelerators (id, pool, node, spec) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (id) DO UPDATE SET pool = EXCLUDED.pool, node = EXCLUDED.node,"
                    " spec = EXCLUDED.spec, updated_at = now() WHERE catalog_accelerators.spec <> EXCLUDED.spec",
                    (acc.id, acc.pool, acc.node, Jsonb(dataclasses.asdict(acc))),
                )
            for dep in catalog.deployments:
                await conn.execute(
                    "INSERT INTO catalog_deployments (capability, spec) VALUES (%s, %s)"
                    " ON CONFLICT (capability) DO UPDATE SET spec = EXCLUDED.spec, updated_at = now()"
                    " WHERE catalog_deployments.spec <> EXCLUDED.spec",
                    (dep.capability, Jsonb(dataclasses.asdict(dep))),
                )
            for tenant in catalog.tenants:
                await conn.execute(
                    "INSERT INTO catalog_tenants (name, spec) VALUES (%s, %s)"
                    " ON CONFLICT (name) DO UPDATE SET spec = EXCLUDED.spec, updated_at = now()"
                    " WHERE catalog_tenants.spec <> EXCLUDED.spec",
                    (tenant.name, Jsonb(dataclasses.asdict(tenant))),
                )
            await conn.execute(
                "DELETE FROM catalog_accelerators WHERE NOT (id = ANY(%s))", ([a.id for a in catalog.accelerators],)
            )
            await conn.execute(
                "DELETE FROM catalog_deployments WHERE NOT (capability = ANY(%s))",
                ([d.capability for d in catalog.deployments],),
            )
            await conn.execute(
                "DELETE FROM catalog_tenants WHERE NOT (name = ANY(%s))", ([t.name for t in catalog.tenants],)
            )
            for position, queue in enumerate(catalog.queues):
                await conn.execute(
                    "INSERT INTO catalog_queues (name, position, spec) VALUES (%s, %s, %s)"
                    " ON CONFLICT (name) DO UPDATE SET position = EXCLUDED.position, spec = EXCLUDED.spec,"
                    " updated_at = now()"
                    " WHERE catalog_queues.spec <> EXCLUDED.spec OR catalog_queues.position <> EXCLUDED.position",
                    (queue.name, position, Jsonb(dataclasses.asdict(queue))),
                )
            await conn.execute(
                "DELETE FROM catalog_queues WHERE NOT (name = ANY(%s))", ([q.name for q in catalog.queues],)
            )
            # The catalog history: what a replay of these days runs under (simulate --from-record).
            await conn.execute("INSERT INTO catalog_history (spec) VALUES (%s)", (Jsonb(catalog_document(catalog)),))
        return {
            "accelerators": len(catalog.accelerators),
            "deployments": len(catalog.deployments),
            "tenants": len(catalog.tenants),
            "queues": len(catalog.queues),
        }

    async def load_catalog(self) -> Catalog:
        async with self._pool.connection() as conn:
            accs = await (await conn.execute("SELECT spec FROM catalog_accelerators ORDER BY id")).fetchall()
            deps = await (await conn.execute("SELECT spec FROM catalog_deployments ORDER BY capability")).fetchall()
            tenants = await (await conn.execute("SELECT spec FROM catalog_tenants ORDER BY name")).fetchall()
            queues = await (await conn.execute("SELECT spec FROM catalog_queues ORDER BY position, name")).fetchall()
            measured = await (
                await conn.execute(
                    "SELECT deployment, accelerator_model, idle_bytes, peak_bytes FROM envelopes"
                    " ORDER BY deployment, accelerator_model"
                )
            ).fetchall()
        catalog, _ = parse_catalog(
            {
                "accelerators": [row[0] for row in accs],
                "deployments": [row[0] for row in deps],
                "tenants": [row[0] for row in tenants],
                "queues": [row[0] for row in queues],
            }
        )
        return with_measured_envelopes(catalog, [(str(d), str(m), int(i), int(p)) for d, m, i, p in measured])

    async def catalog_history(self, *, until_s: float) -> list[tuple[float, Catalog]]:
        """Every catalog applied up to `until_s` (epoch seconds), oldest first, with when it was
        applied; the measured envelopes folded in as `load_catalog` does."""
        async with self._pool.connection() as conn:
            rows = await (
                await conn.execute(
                    "SELECT extract(epoch FROM applied_at)::float8, spec FROM catalog_history"
                    " WHERE applied_at <= %s ORDER BY applied_at, id",
                    (_timestamp(until_s),),
                )
            ).fetchall()
            measured = await (
                await conn.execute("SELECT deployment, accelerator_model, idle_bytes, peak_bytes FROM envelopes")
            ).fetchall()
        envelopes = [(str(d), str(m), int(i), int(p)) for d, m, i, p in measured]
        return [(float(at), with_measured_envelopes(parse_catalog(spec)[0], envelopes)) for at, spec in rows]

    async def record_rows(self, *, since_s: float, until_s: float, pool: str | None) -> dict[str, list[dict[str, Any]]]:
        """What happened between two moments (epoch seconds), as a replay needs it: the lease
        ledger's rows granted (or ended) in the window, the events that say when requests
        arrived, what they ran and why some never ran, the loads' measured times, and the
        per-minute capacity snapshots. Times are epoch seconds."""
        window = {"since": _timestamp(since_s), "until": _timestamp(until_s), "pool": pool}
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT lease_id, request_id, pool, tenant, capability, deployment, priority, accelerators, bytes,"
                " extract(epoch FROM granted_at)::float8 AS granted_at, extract(epoch FROM ended_at)::float8"
                " AS ended_at, outcome, held_s FROM lease_ledger"
                " WHERE coalesce(granted_at, ended_at) >= %(since)s AND coalesce(granted_at, ended_at) < %(until)s"
                " AND (%(pool)s::text IS NULL OR pool = %(pool)s) ORDER BY coalesce(granted_at, ended_at), lease_id",
                window,
            )
            ledger = await cur.fetchall()
            await cur.execute(
                "SELECT kind, failure_class, request_id, lease_id, accelerator, deployment, message, payload,"
                " extract(epoch FROM at)::float8 AS at FROM events"
                " WHERE at >= %(since)s AND at < %(until)s AND kind = ANY(%(kinds)s) ORDER BY at, seq",
                {**window, "kinds": list(RECORD_EVENT_KINDS)},
            )
            events = await cur.fetchall()
            await cur.execute(
                "SELECT accelerator, pool, extract(epoch FROM at)::float8 AS at, total_bytes, external_bytes,"
                " resident_bytes, leased_bytes, reserve_bytes FROM telemetry_snapshots"
                # A card never observed yet says nothing of its memory (its external reads 0).
                " WHERE at >= %(since)s AND at < %(until)s AND observed_at IS NOT NULL"
                " AND (%(pool)s::text IS NULL OR pool = %(pool)s) ORDER BY accelerator, at",
                window,
            )
            snapshots = await cur.fetchall()
        return {"ledger": ledger, "events": events, "snapshots": snapshots}

    async def record_envelope(self, envelope: dict[str, Any]) -> None:
        """Store one measured envelope (replacing the last one for its deployment and model)."""
        async with self._pool.connection() as conn:
            await conn.execute(
                "INSERT INTO envelopes (deployment, accelerator_model, accelerator, idle_bytes, peak_bytes, runtime,"
                " runtime_version, configuration, cases, simulated, measured_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (deployment, accelerator_model) DO UPDATE SET accelerator = EXCLUDED.accelerator,"
                " idle_bytes = EXCLUDED.idle_bytes, peak_bytes = EXCLUDED.peak_bytes, runtime = EXCLUDED.runtime,"
                " runtime_version = EXCLUDED.runtime_version, configuration = EXCLUDED.configuration,"
                " cases = EXCLUDED.cases, simulated = EXCLUDED.simulated, measured_at = EXCLUDED.measured_at",
                (
                    envelope["deployment"],
                    envelope["accelerator_model"],
                    envelope["accelerator"],
                    envelope["idle_bytes"],
                    envelope["peak_bytes"],
                    envelope["runtime"],
                    envelope["runtime_version"],
                    Jsonb(envelope["configuration"]),
                    Jsonb(envelope["cases"]),
                    envelope["simulated"],
                    _timestamp(envelope["measured_at"]),
                ),
            )

    async def envelopes(self, *, deployment: str | None = None) -> list[dict[str, Any]]:
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT deployment, accelerator_model, accelerator, idle_bytes, peak_bytes, runtime, runtime_version,"
                " configuration, cases, simulated, extract(epoch from measured_at)::float8 AS measured_at"
                " FROM envelopes"
                " WHERE %(deployment)s::text IS NULL OR deployment = %(deployment)s"
                " ORDER BY deployment, accelerator_model",
                {"deployment": deployment},
            )
            columns = [c.name for c in cursor.description or []]
            return [dict(zip(columns, row, strict=True)) for row in await cursor.fetchall()]

    async def record_events(self, events: list[EventRecord]) -> int:
        """Write events and the lease-ledger rows they imply, in one transaction. Idempotent:
        the writer chooses event ids, and ledger columns are set from their own event only.

        Text is made storable first (Postgres refuses NUL in text and jsonb; UTF-8 refuses lone
        surrogates). A batch that still fails on its data, not on an outage, is written event by
        event, and each event that fails alone goes to `events_quarantine` (kept readable, with
        the error) with an `event_quarantined` event in the log: one bad row never holds the
        rest, and the caller's retries are for outages only."""
        if not events:
            return 0
        clean = [_storable_event(e) for e in events]
        try:
            await self._write_events(clean)
        except _DATA_ERRORS:
            for event in clean:
                try:
                    await self._write_events([event])
                except _DATA_ERRORS as error:
                    await self._quarantine(event, error)
        return len(events)

    async def _quarantine(self, event: EventRecord, error: BaseException) -> None:
        record = json.dumps(dataclasses.asdict(event), default=repr, ensure_ascii=True, sort_keys=True)
        reason = storable_text(f"{type(error).__name__}: {error}")[:2000]
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO events_quarantine (event_id, record, error) VALUES (%s, %s, %s)"
                " ON CONFLICT (event_id) DO NOTHING",
                (storable_text(event.event_id)[:200], record, reason),
            )
            await conn.execute(
                "INSERT INTO events (event_id, at, kind, request_id, lease_id, message, payload)"
                " VALUES (%s, now(), 'event_quarantined', %s, %s, %s, %s) ON CONFLICT (event_id) DO NOTHING",
                (
                    "quarantined:" + storable_text(event.event_id)[:200],
                    storable_text(event.request_id)[:200],
                    storable_text(event.lease_id)[:200],
                    f"event {storable_text(event.kind)[:100]!r} could not be stored and was quarantined: {reason}",
                    Jsonb({"event_id": storable_text(event.event_id)[:200], "kind": storable_text(event.kind)[:100]}),
                ),
            )

    async def quarantined_events(self, *, limit: int = 100) -> list[dict[str, Any]]:
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT event_id, quarantined_at, record, error FROM events_quarantine"
                " ORDER BY quarantined_at DESC LIMIT %(limit)s",
                {"limit": max(0, limit)},
            )
            return await cur.fetchall()

    async def _write_events(self, events: list[EventRecord]) -> None:
        grants = [e for e in events if e.kind == "lease_granted" and e.lease_id]
        ends = [e for e in events if e.kind == "lease_released" and e.lease_id]
        rows = [
            (
                e.event_id,
                _timestamp(e.at),
                e.kind,
                e.failure_class,
                e.request_id,
                e.lease_id,
                e.accelerator,
                e.deployment,
                e.workflow_id,
                e.message,
                Jsonb(e.payload),
                e.alert,
            )
            for e in events
        ]
        grant_rows = [_ledger_grant(e) for e in grants]
        end_rows = [_ledger_end(e) for e in ends]
        async with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO events (event_id, at, kind, failure_class, request_id, lease_id, accelerator,"
                " deployment, workflow_id, message, payload, alert)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (event_id) DO NOTHING",
                rows,
            )
            if grant_rows:
                await cur.executemany(
                    "INSERT INTO lease_ledger (lease_id, request_id, pool, tenant, capability, deployment, priority,"
                    " accelerators, bytes, granted_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                    " ON CONFLICT (lease_id) DO UPDATE SET request_id = EXCLUDED.request_id,"
                    " pool = EXCLUDED.pool, tenant = EXCLUDED.tenant, capability = EXCLUDED.capability,"
                    " deployment = EXCLUDED.deployment, priority = EXCLUDED.priority,"
                    " accelerators = EXCLUDED.accelerators, bytes = EXCLUDED.bytes,"
                    " granted_at = EXCLUDED.granted_at, updated_at = now()",
                    grant_rows,
                )
            if end_rows:
                await cur.executemany(
                    "INSERT INTO lease_ledger (lease_id, request_id, pool, tenant, capability, deployment, priority,"
                    " accelerators, bytes, granted_at, ended_at, outcome, held_s, gpu_seconds)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                    " ON CONFLICT (lease_id) DO UPDATE SET ended_at = EXCLUDED.ended_at,"
                    " outcome = EXCLUDED.outcome,"
                    # No held_s (a release its scheduler did not hold): from the row's own grant.
                    " held_s = COALESCE(EXCLUDED.held_s,"
                    " GREATEST(0, EXTRACT(EPOCH FROM EXCLUDED.ended_at - lease_ledger.granted_at))),"
                    " gpu_seconds = COALESCE(EXCLUDED.gpu_seconds,"
                    " GREATEST(0, EXTRACT(EPOCH FROM EXCLUDED.ended_at - lease_ledger.granted_at))"
                    " * GREATEST(1, COALESCE(cardinality(lease_ledger.accelerators), 1))),"
                    # A lease ends once: a second end (a release reapplied after a reset of the
                    # scheduler's run, a forgotten lease closed as its holder's end landed) keeps
                    # the first.
                    " updated_at = now() WHERE lease_ledger.ended_at IS NULL",
                    end_rows,
                )

    async def record_snapshots(self, batch: SnapshotBatch, retention_s: float) -> int:
        """One row per accelerator at the batch's moment (a retry inserts nothing twice), then
        rows older than the retention dropped."""
        at = _timestamp(batch.at)
        async with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO telemetry_snapshots (accelerator, at, pool, node, simulated, total_bytes,"
                " observed_used_bytes, external_bytes, resident_bytes, leased_bytes, reserve_bytes,"
                " schedulable_bytes, pressure, healthy, fresh, observed_at, received_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (accelerator, at) DO NOTHING",
                [
                    (
                        a.id,
                        at,
                        batch.pool,
                        a.node,
                        a.simulated,
                        a.total_bytes,
                        a.observed_used_bytes,
                        a.external_bytes,
                        a.resident_bytes,
                        a.leased_bytes,
                        a.reserve_bytes,
                        a.schedulable_bytes,
                        a.pressure,
                        a.healthy,
                        a.fresh,
                        _timestamp(a.observed_at) if a.observed_at else None,
                        _timestamp(batch.at - a.observation_age_s) if a.observation_age_s is not None else None,
                    )
                    for a in batch.accelerators
                ],
            )
            await cur.execute(
                "DELETE FROM telemetry_snapshots WHERE at < %s - make_interval(secs => %s)", (at, retention_s)
            )
        return len(batch.accelerators)

    async def capacity(
        self, *, since_s: float, buckets: int = 12, accelerator: str | None = None
    ) -> list[dict[str, Any]]:
        """The capacity trend: per accelerator and time bucket, the least schedulable, the most
        external and the mean leased and resident bytes, and whether pressure or staleness was seen."""
        bucket_s = max(1.0, since_s / max(1, buckets))
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT accelerator, date_bin(make_interval(secs => %(bucket)s), at,"
                "  TIMESTAMPTZ '2000-01-01') AS bucket,"
                " count(*) AS samples, max(total_bytes) AS total_bytes,"
                " min(schedulable_bytes) AS min_schedulable_bytes, max(external_bytes) AS max_external_bytes,"
                " avg(resident_bytes)::bigint AS mean_resident_bytes, avg(leased_bytes)::bigint AS mean_leased_bytes,"
                " max(reserve_bytes) AS max_reserve_bytes, bool_or(pressure) AS pressure,"
                " bool_and(healthy) AS healthy, bool_and(fresh) AS fresh, bool_or(simulated) AS simulated"
                " FROM telemetry_snapshots WHERE at >= now() - make_interval(secs => %(since)s)"
                " AND (%(accelerator)s::text IS NULL OR accelerator = %(accelerator)s)"
                " GROUP BY accelerator, bucket ORDER BY accelerator, bucket",
                {"bucket": bucket_s, "since": since_s, "accelerator": accelerator},
            )
            rows = await cur.fetchall()
        for row in rows:
            row["bucket"] = row["bucket"].isoformat()
        return rows

    async def snapshots(self, *, accelerator: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT * FROM telemetry_snapshots"
                " WHERE (%(accelerator)s::text IS NULL OR accelerator = %(accelerator)s)"
                " ORDER BY at DESC, accelerator LIMIT %(limit)s",
                {"accelerator": accelerator, "limit": limit},
            )
            return await cur.fetchall()

    async def usage(self, *, since_s: float | None = None, by: str = "tenant") -> list[dict[str, Any]]:
        """Per-tenant (or per-capability) accounting from the lease ledger: leases, GPU-seconds
        of ended leases, GiB-seconds, outcomes, and leases still open."""
        if by not in ("tenant", "capability"):
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"usage --by must be tenant or capability, not {by!r}")
        if since_s is not None and not (isinstance(since_s, int | float) and 0 < since_s <= MAX_WINDOW_S):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"usage --since must be between 0 and {MAX_WINDOW_S:.0f} seconds"
            )
        group = psycopg.sql.Identifier(by)
        query = psycopg.sql.SQL(
            "SELECT coalesce({group}, '?') AS {group}, count(*) AS leases,"
            " count(*) FILTER (WHERE ended_at IS NULL) AS open,"
            " coalesce(sum(gpu_seconds), 0) AS gpu_seconds,"
            " coalesce(sum(gpu_seconds * bytes), 0) / 1073741824.0 AS gib_gpu_seconds,"
            " count(*) FILTER (WHERE outcome = 'ok') AS ok,"
            " count(*) FILTER (WHERE outcome IS NOT NULL AND outcome <> 'ok') AS not_ok"
            " FROM lease_ledger WHERE (%(since)s::float8 IS NULL"
            "  OR coalesce(granted_at, ended_at) >= now() - make_interval(secs => %(since)s))"
            " GROUP BY 1 ORDER BY gpu_seconds DESC, 1"
        ).format(group=group)
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(query, {"since": since_s})
            return await cur.fetchall()

    async def decayed_usage(self, *, pool: str, half_life_s: float, as_of: float) -> dict[str, float]:
        """GPU-seconds per fair-share entity (the tenant within its class's queue: the tenant's
        name in the default queue, `queue/tenant` in others) from the ledger, each lease decayed
        from its end to `as_of` with the fair-share half-life: what a fresh scheduler starts its
        fair share from."""
        if half_life_s <= 0:
            return {}
        async with self._pool.connection() as conn:
            rows = await (
                await conn.execute(
                    "SELECT tenant, coalesce(priority, ''), sum(gpu_seconds * power(0.5,"
                    "  greatest(0, extract(epoch FROM (%(as_of)s - ended_at)))::float8 / %(half)s))"
                    " FROM lease_ledger WHERE pool = %(pool)s AND tenant IS NOT NULL AND ended_at IS NOT NULL"
                    " AND gpu_seconds > 0 AND ended_at > %(as_of)s - make_interval(secs => %(half)s * 30)"
                    " GROUP BY 1, 2 ORDER BY 1, 2",
                    {"as_of": _timestamp(as_of), "half": half_life_s, "pool": pool},
                )
            ).fetchall()
        usage: dict[str, float] = {}
        for tenant, class_id, total in rows:
            if total:
                entity = fair_share_entity(str(class_id), str(tenant))
                usage[entity] = usage.get(entity, 0.0) + float(total)
        return usage

    async def open_leases(self, pool: str, *, limit: int = 10_000) -> list[OpenLease]:
        """The pool's ledger rows that were granted and have no end yet, oldest first."""
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT lease_id, request_id, tenant, capability, deployment, priority, accelerators, bytes,"
                " granted_at FROM lease_ledger WHERE pool = %(pool)s AND ended_at IS NULL"
                " ORDER BY granted_at NULLS LAST, lease_id LIMIT %(limit)s",
                {"pool": pool, "limit": max(0, limit)},
            )
            rows = await cur.fetchall()
        return [
            OpenLease(
                lease_id=str(row["lease_id"]),
                request_id=str(row["request_id"] or ""),
                tenant=str(row["tenant"] or ""),
                capability=str(row["capability"] or ""),
                deployment=str(row["deployment"] or ""),
                priority=str(row["priority"] or ""),
                accelerators=[str(a) for a in row["accelerators"] or []],
                bytes=int(row["bytes"] or 0),
                granted_at=row["granted_at"].timestamp() if row["granted_at"] is not None else 0.0,
            )
            for row in rows
        ]

    async def ledger(self, *, lease_id: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT * FROM lease_ledger WHERE (%(lease)s::text IS NULL OR lease_id = %(lease)s)"
                " ORDER BY granted_at NULLS LAST, lease_id LIMIT %(limit)s",
                {"lease": lease_id, "limit": limit},
            )
            return await cur.fetchall()

    async def list_events(
        self,
        *,
        after_seq: int = 0,
        limit: int = 200,
        request_id: str | None = None,
        kind: str | None = None,
        failure_class: str | None = None,
        accelerator: str | None = None,
        alert: str | None = None,
    ) -> list[dict[str, Any]]:
        """The newest `limit` events after `after_seq`, oldest first. A filter is compared with
        text as the store keeps it (storable_text: NUL and lone surrogates escaped)."""
        for name, number, low, high in (("limit", limit, 1, MAX_EVENTS), ("after_seq", after_seq, 0, 2**63 - 1)):
            if isinstance(number, bool) or not isinstance(number, int) or not low <= number <= high:
                raise ModelForgeError(FailureClass.REQUEST_INVALID, f"events {name} must be between {low} and {high}")
        filters = {"request_id": request_id, "kind": kind, "failure": failure_class, "accelerator": accelerator}
        filters = {key: None if value is None else storable_text(str(value)) for key, value in filters.items()}
        alert = None if alert is None else storable_text(str(alert))
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT seq, event_id, at, kind, failure_class, request_id, lease_id, accelerator, deployment,"
                " workflow_id, message, payload, alert FROM ("
                "  SELECT * FROM events WHERE seq > %(after)s"
                "  AND (%(request_id)s::text IS NULL OR request_id = %(request_id)s)"
                "  AND (%(kind)s::text IS NULL OR kind = %(kind)s)"
                "  AND (%(failure)s::text IS NULL OR failure_class = %(failure)s)"
                "  AND (%(accelerator)s::text IS NULL OR accelerator = %(accelerator)s)"
                "  AND (%(alert)s::text IS NULL OR alert = %(alert)s OR (%(alert)s = '*' AND alert IS NOT NULL))"
                "  ORDER BY seq DESC LIMIT %(limit)s) newest ORDER BY seq",
                {"after": after_seq, **filters, "alert": alert, "limit": limit},
            )
            rows = await cur.fetchall()
        for row in rows:
            row["at"] = row["at"].isoformat()
        return rows


# The events a replay of the record reads (modelforge/simulate/_record.py).
RECORD_EVENT_KINDS = (
    "lease_granted",
    "invoke",
    "invoke_failed",
    "request_refused",
    "request_rejected",
    "admission_failed",
    "resident_ready",
)


def catalog_document(catalog: Catalog) -> dict[str, Any]:
    """A catalog as `parse_catalog` reads it back (the rows `load_catalog` reads, in one)."""
    return {
        "accelerators": [dataclasses.asdict(a) for a in catalog.accelerators],
        "deployments": [dataclasses.asdict(d) for d in catalog.deployments],
        "tenants": [dataclasses.asdict(t) for t in catalog.tenants],
        "queues": [dataclasses.asdict(q) for q in catalog.queues],
    }


def with_measured_envelopes(catalog: Catalog, measured: list[tuple[str, str, int, int]]) -> Catalog:
    """The catalog as admission uses it: a deployment is eligible for production on every
    accelerator model it has a measured envelope for, and its envelope is never smaller than the
    largest peak measured (a declared envelope below a measured peak would admit what crashes)."""
    by_deployment: dict[str, list[tuple[str, int, int]]] = {}
    for deployment, model, idle, peak in measured:
        by_deployment.setdefault(deployment, []).append((model, idle, peak))
    if not by_deployment:
        return catalog
    deployments = []
    for dep in catalog.deployments:
        rows = by_deployment.get(dep.deployment_id, [])
        if rows:
            envelope = max([dep.envelope_bytes, *(peak for _, _, peak in rows)])
            idle = max(idle for _, idle, _ in rows)
            models = sorted({*dep.measured_on, *(model for model, _, _ in rows)})
            resident = dep.idle_bytes if dep.idle_bytes is not None else idle
            dep = dataclasses.replace(
                dep, envelope_bytes=envelope, idle_bytes=min(envelope, max(resident, idle)), measured_on=models
            )
        deployments.append(dep)
    return dataclasses.replace(catalog, deployments=deployments)


def _timestamp(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


# Errors that come from a row's data, not from an outage: retrying cannot help, so the row is
# quarantined. psycopg's OperationalError and InterfaceError (connection lost, server down) are
# not here: those are retried until Postgres is back.
_DATA_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.DataError,
    psycopg.IntegrityError,
    psycopg.ProgrammingError,
    psycopg.NotSupportedError,
    ValueError,  # includes UnicodeEncodeError and a timestamp out of range
    OverflowError,
    TypeError,
)


def _storable_event(e: EventRecord) -> EventRecord:
    return dataclasses.replace(
        e,
        event_id=storable_text(e.event_id),
        kind=storable_text(e.kind),
        failure_class=None if e.failure_class is None else storable_text(e.failure_class),
        request_id=storable_text(e.request_id),
        lease_id=storable_text(e.lease_id),
        accelerator=storable_text(e.accelerator),
        deployment=storable_text(e.deployment),
        workflow_id=storable_text(e.workflow_id),
        message=storable_text(e.message),
        payload=storable(e.payload),
        alert=None if e.alert is None else storable_text(e.alert),
    )


def _accelerators(payload: dict[str, Any], fallback: str) -> list[str]:
    listed = str(payload.get("accelerators") or "")
    return [a for a in listed.split(",") if a] or ([fallback] if fallback else [])


def _ledger_lease(e: EventRecord) -> tuple[Any, ...]:
    """The columns both lease events carry: lease, request, pool, tenant, capability,
    deployment, class, accelerators, bytes."""
    p = e.payload
    return (
        e.lease_id,
        e.request_id,
        p.get("pool"),
        p.get("tenant"),
        p.get("capability"),
        e.deployment,
        p.get("priority"),
        _accelerators(p, e.accelerator),
        p.get("bytes"),
    )


def _ledger_grant(e: EventRecord) -> tuple[Any, ...]:
    # When the lease began: the payload says (a delegated run's grant is written at the node's
    # sync after it ran); else the event's own time.
    granted_at = e.payload.get("granted_at")
    return (
        *_ledger_lease(e),
        _timestamp(float(granted_at)) if isinstance(granted_at, int | float) else _timestamp(e.at),
    )


def _ledger_end(e: EventRecord) -> tuple[Any, ...]:
    lease = _ledger_lease(e)
    # An end its scheduler did not hold the lease for (its holder released it after a reset)
    # says nothing of how long it was held: the row's own grant time does (below).
    held = e.payload.get("held_s")
    held_s = None if held is None and e.payload.get("unheld") else float(held or 0.0)
    granted_at = e.payload.get("granted_at")
    ended_at = e.payload.get("ended_at")
    return (
        *lease,
        _timestamp(float(granted_at)) if granted_at is not None else None,
        _timestamp(float(ended_at)) if ended_at is not None else _timestamp(e.at),
        str(e.payload.get("outcome") or e.message),
        held_s,
        # A gang lease holds every card it names for the whole time.
        None if held_s is None else held_s * len(lease[7]),
    )


def dumps(value: Any) -> str:
    return json.dumps(value, default=str, sort_keys=True)
