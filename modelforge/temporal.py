"""Connecting to Temporal (TLS, mTLS and API keys from settings), the workers' SDK metrics and the
search attributes."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from temporalio.client import Client, RetryConfig, TLSConfig
from temporalio.common import SearchAttributeKey
from temporalio.converter import DataConverter
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.payloads import data_converter
from modelforge.payloads import input_limit as input_limit  # the client's input check
from modelforge.settings import TEMPORAL_METRICS_ADDRESS as TEMPORAL_METRICS_ADDRESS
from modelforge.settings import TEMPORAL_METRICS_DEFAULTS as TEMPORAL_METRICS_DEFAULTS
from modelforge.settings import Settings

CAPABILITY = SearchAttributeKey.for_keyword("ModelForgeCapability")
PRIORITY = SearchAttributeKey.for_keyword("ModelForgePriority")
TENANT = SearchAttributeKey.for_keyword("ModelForgeTenant")
ACCELERATOR = SearchAttributeKey.for_keyword("ModelForgeAccelerator")
OUTCOME = SearchAttributeKey.for_keyword("ModelForgeOutcome")
SEARCH_ATTRIBUTES = [CAPABILITY, PRIORITY, TENANT, ACCELERATOR, OUTCOME]

# The calls a worker process makes through its client (a node's release and lease heartbeats to
# the scheduler, the control worker's queries and starts) are retried through a server restart
# of up to five minutes; the SDK's default gives up after 10 s. The SDK's own worker calls do
# not take it: an activity's completion or heartbeat is given up after about 10 s of Temporal
# being away (measured: `respond_activity_task_completed` dropped 10 s into a 12 s restart),
# which is why a node keeps each invoke's outcome (activities/_invoke_outcomes.py).
# Interactive clients keep the default: they should hear of an outage, not hang in it.
WORKER_RETRY = RetryConfig(max_interval_millis=5_000, max_elapsed_time_millis=300_000, max_retries=100)


WorkerRole = Literal["control", "node"]
# The Temporal SDK's own worker metrics (task slots, poll and schedule-to-start latencies, sticky
# cache, activity and workflow task failures) on a Prometheus endpoint of the worker process:
# MODELFORGE_TEMPORAL_METRICS_ADDRESS (host:port, or "off"; `Settings.temporal_metrics_address`).
# Loopback unless configured, and one port per role so a control and a node worker on one host do
# not collide (compose sets 0.0.0.0 inside its network, where Prometheus scrapes both).
_runtimes: dict[str, Runtime] = {}


def temporal_metrics_address(role: WorkerRole, environ: Mapping[str, str] | None = None) -> str | None:
    """Where a worker of this role serves the SDK's metrics per the environment (os.environ, or
    `environ`); None when switched off. REQUEST_INVALID naming the variable for a bad one."""
    return Settings.from_env(environ).temporal_metrics_bind(role)


def worker_runtime(role: WorkerRole, settings: Settings | Mapping[str, str] | None = None) -> Runtime | None:
    """The Temporal runtime of this process's workers, with the SDK's metrics on Prometheus (at
    `settings.temporal_metrics_bind(role)`; a mapping is read as the environment, None is
    os.environ); None, the SDK's default runtime, when switched off or when the address cannot be
    bound (a second worker of the role on this host): the worker runs without them rather than
    not at all. One per process and address."""
    if not isinstance(settings, Settings):
        settings = Settings.from_env(settings)
    address = settings.temporal_metrics_bind(role)
    if address is None:
        return None
    if address not in _runtimes:
        try:
            _runtimes[address] = Runtime(
                telemetry=TelemetryConfig(
                    metrics=PrometheusConfig(bind_address=address), global_tags={"modelforge_role": role}
                )
            )
        except Exception as error:  # address in use, or not an interface of this host
            from modelforge.logging import get_logger

            get_logger("modelforge.temporal").warning(
                "temporal_sdk_metrics_unavailable",
                address=address,
                error=f"{type(error).__name__}: {error}",
                note=f"set {TEMPORAL_METRICS_ADDRESS} to a free host:port, or off",
            )
            return None
    return _runtimes[address]


def _tls(settings: Settings) -> TLSConfig | bool:
    if not (settings.temporal_tls or settings.temporal_tls_cert or settings.temporal_tls_ca):
        return bool(settings.temporal_api_key)

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return TLSConfig(
        server_root_ca_cert=read(settings.temporal_tls_ca),
        client_cert=read(settings.temporal_tls_cert),
        client_private_key=read(settings.temporal_tls_key),
    )


def converter(settings: Settings) -> DataConverter:
    """The data converter of every ModelForge client and worker: large payloads leave the
    event history for the payload store (modelforge/payloads.py). A client or worker built
    without it cannot read a payload another one stored."""
    return data_converter(settings.resolved_payload_dir(), settings.payload_threshold_bytes, settings.max_payload_bytes)


async def connect(
    settings: Settings, timeout_s: float = 15.0, worker: bool = False, role: WorkerRole | None = None
) -> Client:
    """`worker`: for a worker process, whose calls ride out a Temporal restart (WORKER_RETRY).
    `role`: the worker process's, whose SDK metrics it serves (`worker_runtime`)."""
    runtime = worker_runtime(role, settings) if role is not None else None
    try:
        return await asyncio.wait_for(
            Client.connect(
                settings.temporal_address,
                namespace=settings.temporal_namespace,
                tls=_tls(settings),
                api_key=settings.temporal_api_key,
                retry_config=WORKER_RETRY if worker else None,
                data_converter=converter(settings),
                runtime=runtime,
            ),
            timeout_s,
        )
    except TimeoutError:
        raise ModelForgeError(
            FailureClass.CAPABILITY_UNAVAILABLE,
            f"Temporal at {settings.temporal_address} did not answer within {timeout_s:.0f} s",
        ) from None
    except RuntimeError as error:
        raise ModelForgeError(
            FailureClass.CAPABILITY_UNAVAILABLE,
            f"cannot reach Temporal at {settings.temporal_address} (is `modelforge dev` running?): {error}",
        ) from None


async def register_search_attributes(client: Client) -> None:
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
    from temporalio.service import RPCError, RPCStatusCode

    namespace = client.namespace
    try:
        listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
        existing = set(listed.custom_attributes)
    except RPCError as error:
        # The time-skipping test server cannot list, but can add.
        if error.status != RPCStatusCode.UNIMPLEMENTED:
            raise
        existing = set()
    missing = {
        key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for key in SEARCH_ATTRIBUTES if key.name not in existing
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
        )
