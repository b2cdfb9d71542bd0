"""What one tenant's API key is shown of the pool and of the gateway's metrics:
its own leases, queued requests and series, never another tenant's; an operator's or
observer's key, and any caller without keys configured, sees everything as before."""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Any

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from modelforge.catalog import example_catalog_path, parse_catalog
from modelforge.domain import Catalog, Priority
from modelforge.gateway import GatewayConfig, create_app
from modelforge.metrics import GatewayMetrics, TenantSeries
from modelforge.policy import (
    PoolState,
    PoolStatus,
    SlotSync,
    apply_decisions,
    decide,
    enqueue,
    pool_status,
    sync_slots,
    tenant_view,
)
from modelforge.policy._transitions import note_outcome
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state, tenant

CAP = "emb@1"
OTHER = "chat@1"


def busy_pool() -> PoolState:
    """Two residents; tenant `a` holds a lease on one, `b` two leases on the other and one
    queued request; a node holds free lent slots; `b`'s request failed with a message."""
    s = state(
        [gpu("n/0")],
        [deployment(CAP, gib=2, concurrency=4), deployment(OTHER, gib=2, concurrency=2)],
        tenants=[tenant("a"), tenant("b")],
    )
    observe(s, "n/0", managed_gib=4, loaded=[f"{CAP}@n/0", f"{OTHER}@n/0"])
    resident(s, CAP, "n/0", 2)
    resident(s, OTHER, "n/0", 2)
    sync_slots(s, SlotSync(node="n", boot="b1", wanted=[CAP]), NOW)  # 3 of emb's 4 slots lent (one spare)
    for request_id, capability, who in [("a1", CAP, "a"), ("b1", OTHER, "b"), ("b2", OTHER, "b"), ("b3", OTHER, "b")]:
        enqueue(s, ask(request_id, capability, tenant_name=who), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    note_outcome(s, OTHER, "RUNTIME_CRASH", "b's prompt was: secret", NOW)
    return s


def test_a_tenant_sees_every_resident_but_only_its_own_leases_and_queue() -> None:
    whole = pool_status(busy_pool(), NOW)
    assert whole.tenant_leases == {"a": 1, "b": 2} and whole.active_leases == 3 and whole.lent_slots == 3
    assert whole.tenant_queue_depth == {"b": {"interactive": 1}}
    for who, leases, queued in [("a", 1, 0), ("b", 2, 1), ("c", 0, 0)]:
        seen = tenant_view(whole, who)
        assert [r.deployment for r in seen.residents] == [CAP, OTHER], "every model is everyone's to use"
        assert seen.active_leases == leases and seen.lent_slots == 0
        assert sum(r.active_leases for r in seen.residents) == leases
        assert all(set(r.tenant_leases) <= {who} and r.lent_slots == 0 for r in seen.residents)
        assert set(seen.tenant_leases) <= {who} and set(seen.tenant_queue_depth) <= {who}
        assert seen.queue_depth["interactive"] == queued and sum(seen.queue_depth.values()) == queued
        assert [c.last_message for c in seen.capabilities] == [""]  # another's failure text
        assert [c.consecutive_failures for c in seen.capabilities] == [1]
        assert seen.accelerators == whole.accelerators
    by_model = {r.deployment: r.active_leases for r in tenant_view(whole, "a").residents}
    assert by_model == {CAP: 1, OTHER: 0}


def test_a_tenant_reads_only_its_own_series() -> None:
    metrics = GatewayMetrics()
    for who in ("a", "b"):
        metrics.observe(
            route="/v1/embeddings", capability=CAP, tenant=who, priority="", status=200, failure_class="",
            seconds=0.1, prompt_tokens=3,
        )  # fmt: skip
    text = generate_latest(TenantSeries(metrics.registry, "a")).decode()
    tenants = {s.labels.get("tenant") for f in text_string_to_metric_families(text) for s in f.samples}
    assert tenants == {"a"}
    assert 'tenant="b"' not in text and "modelforge_gateway_tokens_total" in text
    assert generate_latest(TenantSeries(metrics.registry, "nobody")) == b""


class _Pool:
    """A requester whose pool is `busy_pool`'s; nothing is ever requested."""

    async def status(self) -> PoolStatus:
        return pool_status(busy_pool(), NOW)


async def _catalog() -> Catalog:
    catalog, _ = parse_catalog(tomllib.loads(example_catalog_path().read_text()))
    return catalog


KEYS = {"sk-a-0123456789abcdef": "a", "sk-b-0123456789abcdef": "b", "sk-ops-0123456789abcde": "ops",
        "sk-prom-0123456789abcd": "prom"}  # fmt: skip


async def _seen(config: GatewayConfig, headers: dict[str, str]) -> dict[str, Any]:
    app = create_app(_Pool(), _catalog, config)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers) as http:
        for who in ("a", "b"):  # a request of each tenant, for the metrics (refused: unknown model)
            key = next(k for k, t in KEYS.items() if t == who)
            auth = {"Authorization": f"Bearer {key}"}
            await http.post("/v1/embeddings", json={"model": "nope", "input": "x"}, headers=auth)
        status = (await http.get("/v1/status")).json()
        ps = (await http.get("/api/ps")).json()
        metrics = (await http.get("/metrics")).text
    tenants = {s.labels.get("tenant") for f in text_string_to_metric_families(metrics) for s in f.samples}
    return {"status": status, "ps": ps, "metric_tenants": tenants}


async def test_the_gateway_shows_a_tenants_key_its_own_and_an_operators_everything() -> None:
    config = GatewayConfig(api_keys=KEYS, operator_tenants=frozenset({"ops"}), observer_tenants=frozenset({"prom"}))
    whole = dataclasses.asdict(pool_status(busy_pool(), NOW))
    mine = await _seen(config, {"Authorization": "Bearer sk-a-0123456789abcdef"})
    assert mine["status"] == dataclasses.asdict(tenant_view(pool_status(busy_pool(), NOW), "a"))
    assert mine["status"]["active_leases"] == 1 and mine["status"]["tenant_leases"] == {"a": 1}
    assert {m["name"]: m["modelforge"]["active_leases"] for m in mine["ps"]["models"]} == {
        f"{CAP}:latest": 1,
        f"{OTHER}:latest": 0,
    }
    assert mine["metric_tenants"] == {"a"}
    for everything in ("sk-ops-0123456789abcde", "sk-prom-0123456789abcd"):
        seen = await _seen(config, {"Authorization": f"Bearer {everything}"})
        assert seen["status"] == whole
        assert sorted(m["modelforge"]["active_leases"] for m in seen["ps"]["models"]) == [1, 2]
        assert {"a", "b"} <= seen["metric_tenants"]
    # Without keys (a single-user host): everything, whatever the header says.
    open_ = await _seen(GatewayConfig(), {"X-ModelForge-Tenant": "a"})
    assert open_["status"] == whole
