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
from modelforge.domain import Catalog
from modelforge.events import EventRecord
from modelforge.failures import FailureClass, ModelForgeError

_MIGRATION_LOCK = 0x6D666F7267  # "mforg": one migrator at a time


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
        return {
            "accelerators": len(catalog.accelerators),
            "deployments": len(catalog.deployments),
            "tenants": len(catalog.tenants),
        }

    async def load_catalog(self) -> Catalog:
        async with self._pool.connection() as conn:
            accs = await (await conn.execute("SELECT spec FROM catalog_accelerators ORDER BY id")).fetchall()
            deps = await (await conn.execute("SELECT spec FROM catalog_deployments ORDER BY capability")).fetchall()
            tenants = await (await conn.execute("SELECT spec FROM catalog_tenants ORDER BY name")).fetchall()
        catalog, _ = parse_catalog(
            {
                "accelerators": [row[0] for row in accs],
                "deployments": [row[0] for row in deps],
                "tenants": [row[0] for row in tenants],
            }
        )
        return catalog

    async def record_events(self, events: list[EventRecord]) -> int:
        if not events:
            return 0
        async with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO events (event_id, at, kind, failure_class, request_id, lease_id, accelerator,"
                " deployment, workflow_id, message, payload) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (event_id) DO NOTHING",
                [
                    (
                        e.event_id,
                        datetime.fromtimestamp(e.at, tz=UTC),
                        e.kind,
                        e.failure_class,
                        e.request_id,
                        e.lease_id,
                        e.accelerator,
                        e.deployment,
                        e.workflow_id,
                        e.message,
                        Jsonb(e.payload),
                    )
                    for e in events
                ],
            )
        return len(events)

    async def list_events(
        self,
        *,
        after_seq: int = 0,
        limit: int = 200,
        request_id: str | None = None,
        kind: str | None = None,
        failure_class: str | None = None,
        accelerator: str | None = None,
    ) -> list[dict[str, Any]]:
        async with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                "SELECT seq, event_id, at, kind, failure_class, request_id, lease_id, accelerator, deployment,"
                " workflow_id, message, payload FROM ("
                "  SELECT * FROM events WHERE seq > %(after)s"
                "  AND (%(request_id)s::text IS NULL OR request_id = %(request_id)s)"
                "  AND (%(kind)s::text IS NULL OR kind = %(kind)s)"
                "  AND (%(failure)s::text IS NULL OR failure_class = %(failure)s)"
                "  AND (%(accelerator)s::text IS NULL OR accelerator = %(accelerator)s)"
                "  ORDER BY seq DESC LIMIT %(limit)s) newest ORDER BY seq",
                {
                    "after": after_seq,
                    "request_id": request_id,
                    "kind": kind,
                    "failure": failure_class,
                    "accelerator": accelerator,
                    "limit": limit,
                },
            )
            rows = await cur.fetchall()
        for row in rows:
            row["at"] = row["at"].isoformat()
        return rows


def dumps(value: Any) -> str:
    return json.dumps(value, default=str, sort_keys=True)
