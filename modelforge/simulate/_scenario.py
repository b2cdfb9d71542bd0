"""Scenario files (docs/SIMULATOR.md): a catalog TOML (accelerators, external usage, deployments, tenants)
plus `[requests] path` to a JSON-lines file, one request a line. Validated strictly: an error
names the line and the field."""

from __future__ import annotations

import json
import math
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from modelforge.catalog import CatalogError, ExternalSpec, parse_catalog
from modelforge.domain import Catalog, Deployment

MAX_REQUESTS = 10_000_000
_REQUEST_FIELDS = {
    "t",
    "capability",
    "priority",
    "tenant",
    "service_s",
    "deadline_s",
    "gpu_count",
    "bytes_per_gpu",
    "nvlink_required",
    "preemptible",
    "max_duration_s",
    "lease_timeout_s",
    "input_bytes",
    "id",
}


class ScenarioError(CatalogError):
    """A scenario file or request line that cannot be simulated; the message names where."""


@dataclass(frozen=True)
class SimRequest:
    index: int
    request_id: str
    t: float
    # The capability as the scheduler sees it: a request line that overrides its deployment's
    # shape (a batch job's own size) gets a variant deployment of its own, see `_variant`.
    capability: str
    priority: str | None  # a class id of the scenario's catalog
    tenant: str
    service_s: float
    deadline_s: float | None = None
    # A run longer than this is cut there and ends TIMEOUT.
    max_duration_s: float | None = None
    # The capability the line named, for reports.
    base_capability: str = ""
    # How long it may wait for a lease (None: the scenario's [simulation] lease_timeout_s).
    lease_timeout_s: float | None = None
    # The input's size as JSON (from a record; None: not known). Carried into the replay's
    # events: the service time is what the simulator replays, not the input.
    input_bytes: int | None = None


@dataclass(frozen=True)
class SimulationConfig:
    # How long a preempted holder takes to checkpoint and release (its progress is kept).
    checkpoint_s: float = 1.0
    # Simulated telemetry: a card is sampled whenever its memory changes, and at least this
    # often while it is under GPU_PRESSURE (so the hysteresis can clear).
    telemetry_s: float = 10.0
    # How long a request may wait for a lease before LEASE_TIMEOUT (ModelForge's policy).
    lease_timeout_s: float = 300.0
    # The Ollama baseline's one global overhead reserve per GPU (OLLAMA_GPU_OVERHEAD).
    ollama_overhead_bytes: int = 512 * 1024**2


@dataclass(frozen=True)
class ExternalUsage:
    accelerator: str
    bytes: int
    start_s: float
    end_s: float
    name: str = "external"


@dataclass(frozen=True)
class Scenario:
    catalog: Catalog
    requests: list[SimRequest]
    external: list[ExternalUsage] = field(default_factory=list)
    config: SimulationConfig = field(default_factory=SimulationConfig)
    name: str = ""
    # Catalogs applied during the run, each at its moment (on the requests' clock), as
    # `catalog apply` tells a running scheduler: a record's window replayed as it was. The cards
    # stay `catalog`'s (the simulated world does not grow or lose cards).
    catalog_changes: list[tuple[float, Catalog]] = field(default_factory=list)

    def catalog_at(self, t: float) -> Catalog:
        return in_force_at(self.catalog, self.catalog_changes, t)


def in_force_at(first: Catalog, changes: list[tuple[float, Catalog]], t: float) -> Catalog:
    """The catalog in force at `t`: `first`, or the last of `changes` (in time order) applied
    at or before `t` (a change at `t` already judges what arrives then)."""
    catalog = first
    for at, changed in changes:
        if at > t:
            break
        catalog = changed
    return catalog


def _external(specs: list[ExternalSpec]) -> list[ExternalUsage]:
    return [
        ExternalUsage(s.accelerator, s.bytes, s.start_s, math.inf if s.end_s is None else s.end_s, s.name)
        for s in specs
    ]


_FLOAT_MAX = sys.float_info.max


def _number(line: int, data: dict[str, Any], name: str, *, minimum: float, required: bool) -> float | None:
    value: Any = data.get(name)
    # A well-formed value passes on one comparison (NaN and infinities fail it, a bool is not
    # an int here): a week's record parses some 700,000 of them per replay.
    kind = type(value)
    if (kind is float or kind is int) and minimum <= value <= _FLOAT_MAX:
        return float(value)
    if value is None:
        if required:
            raise ScenarioError(f"request line {line}: {name} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not -_FLOAT_MAX <= value <= _FLOAT_MAX:
        raise ScenarioError(f"request line {line}: {name} must be a finite number, got {value!r}")
    if value < minimum:
        raise ScenarioError(f"request line {line}: {name} must be at least {minimum}, got {value!r}")
    return float(value)


# A request line's own shape: served by a variant of its deployment (`ShapeVariants`).
_SHAPE_FIELDS = ("gpu_count", "bytes_per_gpu", "nvlink_required", "preemptible")


class ShapeVariants:
    """Request lines that carry their own shape (gpu_count, bytes_per_gpu, nvlink_required,
    preemptible, max_duration_s) are served by a copy of their deployment with that shape:
    one copy per distinct shape, named `<capability>#<n>`, sharing the deployment's limits."""

    def __init__(self) -> None:
        self.by_shape: dict[tuple[str, int, int, bool, bool], str] = {}
        self.added: list[Deployment] = []

    def capability(self, line: int, base: Deployment, data: dict[str, Any]) -> str:
        if data.keys().isdisjoint(_SHAPE_FIELDS):
            return base.capability
        overrides = {k: data[k] for k in _SHAPE_FIELDS if k in data}
        if not overrides:
            return base.capability
        gpu_count = overrides.get("gpu_count", base.gpu_count)
        if isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or not 1 <= gpu_count <= 1024:
            raise ScenarioError(f"request line {line}: gpu_count must be an integer from 1 to 1024, got {gpu_count!r}")
        nbytes = overrides.get("bytes_per_gpu", base.envelope_bytes)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= 2**50:
            raise ScenarioError(f"request line {line}: bytes_per_gpu must be a positive integer, got {nbytes!r}")
        flags = []
        for name in ("nvlink_required", "preemptible"):
            value = overrides.get(name, getattr(base, name))
            if not isinstance(value, bool):
                raise ScenarioError(f"request line {line}: {name} must be true or false, got {value!r}")
            flags.append(value)
        shape = (base.capability, gpu_count, nbytes, flags[0], flags[1])
        if (
            gpu_count == base.gpu_count
            and nbytes == base.envelope_bytes
            and flags == [base.nvlink_required, base.preemptible]
        ):
            return base.capability
        known = self.by_shape.get(shape)
        if known is not None:
            return known
        # A valid capability name (modelforge/identifiers.py): `job@1` becomes `job@1.shape1`.
        name = f"{base.capability}{'.' if '@' in base.capability else '@'}shape{len(self.by_shape) + 1}"
        self.by_shape[shape] = name
        self.added.append(
            replace(
                base,
                capability=name,
                name="",
                envelope_bytes=nbytes,
                idle_bytes=None if base.idle_bytes is None else min(base.idle_bytes, nbytes),
                gpu_count=gpu_count,
                nvlink_required=flags[0],
                preemptible=flags[1],
            )
        )
        return name


def parse_request_lines(lines: list[str], catalog: Catalog) -> tuple[list[SimRequest], Catalog]:
    """Request lines in, validated requests and the catalog with variant deployments out."""
    return parse_requests(_decoded(lines), catalog)


def _decoded(lines: list[str]) -> Iterator[tuple[int, object]]:
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            yield number, json.loads(text)
        except json.JSONDecodeError as error:
            raise ScenarioError(f"request line {number}: not JSON ({error.msg})") from None


def parse_requests(
    lines: Iterable[tuple[int, object]],
    catalog: Catalog,
    index_from: int = 0,
    variants: ShapeVariants | None = None,
) -> tuple[list[SimRequest], Catalog]:
    """`parse_request_lines` on lines already decoded, each with its line number (what a
    record's builder holds: no JSON text between it and the scenario). A record's lines are
    parsed a catalog's span at a time: `index_from` is the index of the first request, and
    `variants` the shapes named in the spans before (one name, one shape, in the whole run)."""
    variants = variants if variants is not None else ShapeVariants()
    requests: list[SimRequest] = []
    last_t = -math.inf
    ids: dict[str, int] = {}
    for number, data in lines:
        if len(requests) >= MAX_REQUESTS:
            raise ScenarioError(f"more than {MAX_REQUESTS} requests")
        if not isinstance(data, dict):
            raise ScenarioError(f"request line {number}: expected an object, got {type(data).__name__}")
        # (A week's record is some 200,000 lines: the checks below cost a line nothing it does
        # not carry: an absent optional field is not looked at twice.)
        if not data.keys() <= _REQUEST_FIELDS:
            unknown = sorted(set(data) - _REQUEST_FIELDS)
            raise ScenarioError(f"request line {number}: unknown field {unknown[0]!r}")
        t = _number(number, data, "t", minimum=0.0, required=True)
        service_s = _number(number, data, "service_s", minimum=0.0, required=True)
        deadline_s = _number(number, data, "deadline_s", minimum=0.0, required=False) if "deadline_s" in data else None
        max_duration = (
            _number(number, data, "max_duration_s", minimum=0.0, required=False) if "max_duration_s" in data else None
        )
        lease_timeout = (
            _number(number, data, "lease_timeout_s", minimum=0.0, required=False) if "lease_timeout_s" in data else None
        )
        input_bytes = (
            _number(number, data, "input_bytes", minimum=0.0, required=False) if "input_bytes" in data else None
        )
        assert t is not None and service_s is not None
        if t < last_t:
            raise ScenarioError(f"request line {number}: t={t} is earlier than the line before ({last_t})")
        last_t = t
        capability = data.get("capability")
        if not isinstance(capability, str) or not capability:
            raise ScenarioError(f"request line {number}: capability must be a non-empty string")
        base = catalog.deployment_for(capability)
        if base is None:
            raise ScenarioError(f"request line {number}: capability {capability!r} has no deployment in the scenario")
        tenant = data.get("tenant", "default")
        if not isinstance(tenant, str) or catalog.tenant(tenant) is None:
            raise ScenarioError(f"request line {number}: tenant {tenant!r} is not in the scenario's [[tenants]]")
        raw_priority = data.get("priority")
        priority: str | None = None
        if raw_priority is not None:
            if not isinstance(raw_priority, str) or catalog.priority_class(raw_priority) is None:
                choices = ", ".join(catalog.classes)
                raise ScenarioError(f"request line {number}: priority {raw_priority!r} is not one of {choices}")
            priority = raw_priority
        request_id = str(data["id"]) if "id" in data else f"r{number}"
        if request_id in ids:
            raise ScenarioError(f"request line {number}: id {request_id!r} repeats line {ids[request_id]}")
        ids[request_id] = number
        requests.append(
            SimRequest(
                index=index_from + len(requests),
                request_id=request_id,
                t=t,
                capability=variants.capability(number, base, data),
                priority=priority,
                tenant=tenant,
                service_s=service_s,
                deadline_s=deadline_s,
                max_duration_s=max_duration,
                base_capability=capability,
                lease_timeout_s=lease_timeout or None,
                input_bytes=None if input_bytes is None else int(input_bytes),
            )
        )
    if variants.added:
        catalog = replace(catalog, deployments=[*catalog.deployments, *variants.added])
    return requests, catalog


def _simulation_config(data: Any) -> SimulationConfig:
    if data is None:
        return SimulationConfig()
    if not isinstance(data, dict):
        raise ScenarioError("[simulation] must be a table")
    defaults = SimulationConfig()
    values: dict[str, float | int] = {}
    for name, value in data.items():
        if not hasattr(defaults, name):
            raise ScenarioError(f"simulation.{name}: unknown setting")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or not math.isfinite(value):
            raise ScenarioError(f"simulation.{name}: must be a non-negative number, got {value!r}")
        values[name] = int(value) if name.endswith("_bytes") else float(value)
    return replace(defaults, **values)  # type: ignore[arg-type]


def load_scenario(path: Path) -> Scenario:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"scenario file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ScenarioError(f"scenario file {path} is not valid TOML: {error}") from None
    requests_table = data.pop("requests", None)
    config = _simulation_config(data.pop("simulation", None))
    data.pop("name", None)
    if not isinstance(requests_table, dict) or not isinstance(requests_table.get("path"), str):
        raise ScenarioError(f'{path}: [requests] path = "...jsonl" is required')
    catalog, external = parse_catalog(data, path.parent)
    requests_path = (path.parent / requests_table["path"]).resolve()
    try:
        lines = requests_path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ScenarioError(f"requests file not found: {requests_path}") from None
    except UnicodeDecodeError as error:
        raise ScenarioError(f"requests file {requests_path} is not UTF-8: {error}") from None
    requests, catalog = parse_request_lines(lines, catalog)
    return Scenario(catalog=catalog, requests=requests, external=_external(external), config=config, name=path.stem)
