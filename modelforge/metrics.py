"""Prometheus metrics of the control worker (`/metrics` on MODELFORGE_METRICS_PORT).

Gauges come from the scheduler's `status` query, sampled every few seconds; counters and the
admission-latency histogram come from the event batches the control worker writes to Postgres,
so they count what the event log holds (at least once: a batch retried after a write that did
land is counted again).

`GatewayMetrics` are the HTTP gateway's own (`/metrics` on the gateway, behind its API key):
requests, their duration and their tokens, by capability, tenant, class and status. With API
keys a tenant's key reads only its own series (`TenantSeries`); an operator's, all of them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from modelforge.events import EventRecord
from modelforge.logging import get_logger
from modelforge.policy import PoolStatus, Verdict, WaitReason

log = get_logger("modelforge.metrics")

BYTE_KINDS = ("total", "external", "resident", "leased", "reserve", "schedulable")
# Seconds from submission to lease: a warm grant is milliseconds, a cold load seconds, a queue minutes.
ADMISSION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
# A verdict's ETA error (predicted minus actual start), seconds: either sign, seconds to an hour.
ETA_ERROR_BUCKETS = (-3600, -900, -300, -120, -60, -30, -10, -5, -1, 0, 1, 5, 10, 30, 60, 120, 300, 900, 3600)
ETA_ABS_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
# Seconds a gateway request takes, answer written: a refusal is microseconds, a warm embedding
# milliseconds, a cold load seconds, a queued batch minutes.
GATEWAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.accelerator_bytes = Gauge(
            "modelforge_accelerator_bytes",
            "Bytes per accelerator by kind (the admission invariant's terms)",
            ["pool", "accelerator", "kind", "simulated"],
            registry=r,
        )
        self.accelerator_state = Gauge(
            "modelforge_accelerator_state",
            "1 when the accelerator is in the state: pressure, unhealthy, stale",
            ["pool", "accelerator", "state"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "modelforge_queue_depth", "Requests waiting per priority class", ["pool", "priority"], registry=r
        )
        self.queue_waiting = Gauge(
            "modelforge_queue_waiting",
            "Requests waiting per typed reason (their verdicts: modelforge/verdicts.py)",
            ["pool", "reason"],
            registry=r,
        )
        self.eta_error = Histogram(
            "modelforge_eta_error_seconds",
            "A granted request's first predicted start minus its actual start (negative: later than said)",
            ["pool", "reason"],
            buckets=ETA_ERROR_BUCKETS,
            registry=r,
        )
        self.eta_abs_error = Histogram(
            "modelforge_eta_abs_error_seconds",
            "The absolute error of a granted request's first predicted start",
            ["pool", "reason"],
            buckets=ETA_ABS_BUCKETS,
            registry=r,
        )
        self.active_leases = Gauge("modelforge_active_leases", "Leases held now", ["pool"], registry=r)
        self.residents = Gauge(
            "modelforge_resident_models", "Resident model instances by state", ["pool", "state"], registry=r
        )
        self.scrape_ok = Gauge(
            "modelforge_scheduler_up", "1 when the last status query of the scheduler answered", ["pool"], registry=r
        )
        self.admission_seconds = Histogram(
            "modelforge_admission_seconds",
            "Seconds from submission to lease grant",
            ["priority"],
            buckets=ADMISSION_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "modelforge_failures",
            "Typed failures recorded, by class and event kind",
            ["failure_class", "kind"],
            registry=r,
        )
        self.loads = Counter("modelforge_loads", "Model loads completed", ["deployment"], registry=r)
        self.unloads = Counter(
            "modelforge_unloads",
            "Unloads requested, by why (ttl, eviction, other)",
            ["deployment", "reason"],
            registry=r,
        )
        self.alerts = Counter("modelforge_alerts", "Alert events raised or cleared", ["alert", "kind"], registry=r)
        self.events = Counter("modelforge_events", "Events recorded, by kind", ["kind"], registry=r)

    def observe_events(self, events: list[EventRecord]) -> None:
        for event in events:
            self.events.labels(event.kind).inc()
            if event.failure_class:
                self.failures.labels(event.failure_class, event.kind).inc()
            if event.alert:
                self.alerts.labels(event.alert, event.kind).inc()
            if event.kind == "lease_granted":
                waited = event.payload.get("waited_s")
                if isinstance(waited, int | float):
                    self.admission_seconds.labels(str(event.payload.get("priority", ""))).observe(max(0.0, waited))
                error = event.payload.get("eta_error_s")
                if isinstance(error, int | float) and not isinstance(error, bool):
                    labels = (str(event.payload.get("pool", "")), str(event.payload.get("eta_reason", "")))
                    self.eta_error.labels(*labels).observe(error)
                    self.eta_abs_error.labels(*labels).observe(abs(error))
            elif event.kind == "load":
                self.loads.labels(event.deployment).inc()
            elif event.kind == "unload_requested":
                reason = (
                    "ttl"
                    if "keep_warm TTL" in event.message
                    else "eviction"
                    if "making room" in event.message
                    else "other"
                )
                self.unloads.labels(event.deployment, reason).inc()

    def observe_status(self, status: PoolStatus) -> None:
        pool = status.pool
        self.scrape_ok.labels(pool).set(1)
        for acc in status.accelerators:
            values = {
                "total": acc.total_bytes,
                "external": acc.external_bytes,
                "resident": acc.resident_bytes,
                "leased": acc.leased_bytes,
                "reserve": acc.reserve_bytes,
                "schedulable": acc.schedulable_bytes,
            }
            for kind in BYTE_KINDS:
                self.accelerator_bytes.labels(pool, acc.id, kind, str(acc.simulated).lower()).set(values[kind])
            self.accelerator_state.labels(pool, acc.id, "pressure").set(int(acc.pressure))
            self.accelerator_state.labels(pool, acc.id, "unhealthy").set(int(not acc.healthy))
            self.accelerator_state.labels(pool, acc.id, "stale").set(int(not acc.fresh))
        for priority, depth in status.queue_depth.items():
            self.queue_depth.labels(pool, priority).set(depth)
        self.active_leases.labels(pool).set(status.active_leases)
        states: dict[str, int] = {}
        for resident in status.residents:
            states[resident.state] = states.get(resident.state, 0) + 1
        for state in ("loading", "ready", "unloading", "unreclaimed"):
            self.residents.labels(pool, state).set(states.get(state, 0))

    def observe_verdicts(self, pool: str, verdicts: Iterable[Verdict]) -> None:
        """Queue depth by reason: every reason is set (0 when none waits for it)."""
        counts = dict.fromkeys((reason.value for reason in WaitReason), 0)
        for verdict in verdicts:
            counts[verdict.reason] = counts.get(verdict.reason, 0) + 1
        for reason, count in counts.items():
            self.queue_waiting.labels(pool, reason).set(count)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics; returns the bound port (0 picks a free one)."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        bound: int = server.server_address[1]
        return bound

    async def poll(
        self,
        pool: str,
        query: Callable[[], Awaitable[PoolStatus]],
        interval_s: float = 5.0,
        stop: Any = None,
        verdicts: Callable[[], Awaitable[list[Verdict]]] | None = None,
    ) -> None:
        """Sample the scheduler's status (and its queue's verdicts, when `verdicts` is given)
        until cancelled or `stop` is set (at least once)."""
        while True:
            try:
                self.observe_status(await query())
                if verdicts is not None:
                    self.observe_verdicts(pool, await verdicts())
            except Exception as error:  # a scheduler that does not answer shows as down, not a crash
                self.scrape_ok.labels(pool).set(0)
                log.warning("metrics_status_failed", pool=pool, error=type(error).__name__)
            if stop is not None and stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                if stop is None:
                    await asyncio.sleep(interval_s)
                else:
                    await asyncio.wait_for(stop.wait(), timeout=interval_s)


class GatewayMetrics:
    """The gateway's request metrics. Labels: `route` (the route's template, `unmatched` for none,
    so no client-chosen path becomes a series), `capability` (the catalog's, empty when the
    model was unknown or never resolved), `tenant` (the API key's, or the header's without
    keys; empty when refused before one was known), `priority` (the class granted, else the
    one asked for, else empty: the tenant's default), `status` (HTTP) and, on the counter,
    `failure_class`. Tokens count the server's figures where it reported them, and the
    gateway's estimates (`estimated="true"`) otherwise."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "modelforge_gateway_requests",
            "HTTP requests the gateway answered",
            ["route", "capability", "tenant", "priority", "status", "failure_class"],
            registry=r,
        )
        self.seconds = Histogram(
            "modelforge_gateway_request_seconds",
            "Seconds from a request's arrival at the gateway to its answer",
            ["route", "capability", "tenant", "priority", "status"],
            buckets=GATEWAY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "modelforge_gateway_tokens",
            "Tokens of answered requests, by kind (prompt, completion); estimated=true where the model "
            "server reported no counts",
            ["capability", "tenant", "priority", "kind", "estimated"],
            registry=r,
        )
        self.workflow_starts = Gauge(
            "modelforge_gateway_workflow_starts",
            "Request workflows the gateway started, by whether the server handed their first workflow task "
            "back in the start's reply (eager=true: a node worker in the gateway's process polls their queue)",
            ["eager"],
            registry=r,
        )
        self.first_token = Histogram(
            "modelforge_gateway_time_to_first_token_seconds",
            "Seconds from a streamed request's arrival at the gateway to its first piece of text",
            ["route", "capability", "tenant", "priority"],
            buckets=GATEWAY_BUCKETS,
            registry=r,
        )

    def count_starts(self, requester: object) -> None:
        """`workflow_starts` read from the requester's own counts at each scrape (a
        `ModelForgeClient`'s `workflow_starts` and `eager_starts`; a requester without them
        shows none)."""
        self.workflow_starts.labels(eager="true").set_function(lambda: getattr(requester, "eager_starts", 0))
        self.workflow_starts.labels(eager="false").set_function(
            lambda: getattr(requester, "workflow_starts", 0) - getattr(requester, "eager_starts", 0)
        )

    def observe(
        self,
        *,
        route: str,
        capability: str,
        tenant: str,
        priority: str,
        status: int,
        failure_class: str,
        seconds: float,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        estimated: bool = False,
        first_token_s: float | None = None,
    ) -> None:
        code = str(status)
        if first_token_s is not None:
            self.first_token.labels(route, capability, tenant, priority).observe(max(0.0, first_token_s))
        self.requests.labels(route, capability, tenant, priority, code, failure_class).inc()
        self.seconds.labels(route, capability, tenant, priority, code).observe(max(0.0, seconds))
        flag = str(estimated).lower()
        if prompt_tokens:
            self.tokens.labels(capability, tenant, priority, "prompt", flag).inc(prompt_tokens)
        if completion_tokens:
            self.tokens.labels(capability, tenant, priority, "completion", flag).inc(completion_tokens)


class TenantSeries(Collector):
    """The samples of `registry` labelled `tenant=<tenant>`, and nothing else: what one tenant's
    API key reads on the gateway's `/metrics` (no other tenant's traffic, no series without a
    tenant label). Collected at each scrape from the live registry."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry = registry
        self.tenant = tenant

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            samples = [sample for sample in family.samples if sample.labels.get("tenant") == self.tenant]
            if samples:
                mine = Metric(family.name, family.documentation, family.type, family.unit)
                mine.samples = samples
                yield mine
