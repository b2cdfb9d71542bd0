"""Catalog files (TOML): accelerators, deployments, tenants, plus the simulated external
processes of a simulated installation. Validated strictly: an error names the field and value."""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from modelforge.domain import (
    DEFAULT_QUEUES,
    Accelerator,
    Catalog,
    Deployment,
    GiB,
    Priority,
    PriorityClass,
    PriorityLevel,
    Queue,
    Residency,
    Tenant,
    build_classes,
    class_id,
    level_ref,
)
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.identifiers import identifier_problem
from modelforge.policy import shape_problems

ID = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")]
Bytes = Annotated[int, Field(ge=0, le=2**50)]
# A catalog nests tables a few levels deep; anything far deeper is refused before it is read
# further (a deeply nested value would otherwise exhaust the recursion of what reads it).
MAX_NESTING = 32


def _identifier(kind: str) -> AfterValidator:
    """The rules of modelforge/identifiers.py, the same a client's request is held to."""

    def check(value: str) -> str:
        problem = identifier_problem(kind, value)
        if problem is not None:
            raise ValueError(problem)
        return value

    return AfterValidator(check)


CapabilityName = Annotated[str, Field(min_length=1), _identifier("capability")]
TenantName = Annotated[str, Field(min_length=1), _identifier("tenant")]


def _known_runtime(name: str) -> str:
    """A runtime of the registry (modelforge/runtimes/_registry.py), imported only when a
    catalog is read: importing this module stays light."""
    from modelforge.runtimes import unknown_runtime

    problem = unknown_runtime(name)
    if problem is not None:
        raise ValueError(problem)
    return name


def _runtime_schema(schema: dict[str, Any]) -> None:
    from modelforge.runtimes import runtime_names

    schema["enum"] = runtime_names()


RuntimeName = Annotated[
    str, Field(min_length=1, max_length=100, json_schema_extra=_runtime_schema), AfterValidator(_known_runtime)
]


class CatalogError(ModelForgeError):
    def __init__(self, message: str) -> None:
        super().__init__(FailureClass.REQUEST_INVALID, message)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class AcceleratorSpec(_Strict):
    id: ID
    node: ID
    total_bytes: Annotated[int, Field(gt=0, le=2**50)]
    production_eligible: bool = False
    kind: Literal["gpu", "cpu"] = "gpu"
    model: str = Field(default="", max_length=200)
    uuid: str = Field(default="", max_length=200)
    pool: ID = "default"
    nvlink_group: str = Field(default="", max_length=200)
    nvlink_group_id: str = Field(default="", max_length=200)
    rack: str = Field(default="", max_length=200)
    rack_id: str = Field(default="", max_length=200)
    network_bandwidth_gbps: Annotated[float, Field(ge=0)] = 0.0
    reserve_bytes: Bytes = GiB
    simulated: bool = False


class ExternalSpec(_Strict):
    """Unmanaged usage of an accelerator: `bytes`, or every process (and the driver's reserved
    memory) of a real card's `nvidia-smi -q -x` recording (a path relative to the file)."""

    accelerator: ID
    bytes: Annotated[int, Field(gt=0, le=2**50)] = 0
    recording: str = Field(default="", max_length=4096)
    name: str = Field(default="external", max_length=100)
    start_s: Annotated[float, Field(ge=0)] = 0.0
    end_s: Annotated[float, Field(gt=0)] | None = None


class DeploymentSpec(_Strict):
    capability: CapabilityName
    envelope_bytes: Annotated[int, Field(gt=0, le=2**50)]
    residency: Residency = Residency.KEEP_WARM
    ttl_s: Annotated[float, Field(gt=0, le=30 * 24 * 3600)] = 300.0
    concurrency: Annotated[int, Field(ge=1, le=10_000)] = 1
    queue_limit: Annotated[int, Field(ge=0, le=1_000_000)] = 16
    load_s: Annotated[float, Field(ge=0, le=24 * 3600)] = 0.0
    unload_s: Annotated[float, Field(ge=0, le=24 * 3600)] = 0.0
    idle_bytes: Bytes | None = None
    sleep_bytes: Bytes | None = None
    sleep_s: Annotated[float, Field(ge=0, le=24 * 3600)] = 0.0
    wake_s: Annotated[float, Field(ge=0, le=24 * 3600)] = 0.0
    gpu_count: Annotated[int, Field(ge=1, le=1024)] = 1
    nvlink_required: bool = False
    gpu_per_node: Annotated[int, Field(ge=0, le=1024)] = 0
    node_count: Annotated[int, Field(ge=0, le=1024)] = 0
    gpu_memory_min: Bytes = 0
    anti_affinity: Literal["", "node", "rack"] = ""
    rack_affinity: Literal["preferred", "required", "none"] = "preferred"
    min_network_bandwidth_gbps: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    preemptible: bool = False
    production_eligible: bool = True
    accelerators: list[ID] = Field(default_factory=list)
    measured_on: list[str] = Field(default_factory=list)
    runtime: RuntimeName = "simulated"  # a name in modelforge.runtimes.RUNTIMES
    artifact: str = Field(default="", max_length=4096)
    artifact_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    runtime_config: dict[str, str] = Field(default_factory=dict)
    name: str = Field(default="", max_length=200)
    # subprocess_http: the server's argument list; {port} {host} {artifact} {served_model} are filled in.
    command: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(default_factory=list, max_length=200)
    # Model names OpenAI-compatible clients use for this capability (the gateway's mapping).
    openai_models: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(default_factory=list)
    # subprocess_http: environment variable -> the name of a node secret, never a secret's value.
    env_from_secrets: dict[Annotated[str, Field(max_length=200)], Annotated[str, Field(max_length=100)]] = Field(
        default_factory=dict, max_length=100
    )
    # The model's context window in tokens (0: not said); clients see it, num_ctx is checked against it.
    context_length: Annotated[int, Field(ge=0, le=100_000_000)] = 0
    # Ollama's capability names beyond completion/embedding that the model has.
    features: list[Literal["tools", "vision", "thinking", "insert"]] = Field(default_factory=list, max_length=4)


QueueName = Annotated[str, Field(min_length=1, max_length=60, pattern=r"^[a-z0-9][a-z0-9_-]*$")]


class LevelSpec(_Strict):
    name: QueueName
    # Orders levels across queues (higher first) and is the fair-share score's `priority` factor.
    priority: Annotated[int, Field(ge=1, le=1_000_000)]
    preempts: list[Annotated[str, Field(min_length=1, max_length=130)]] = Field(default_factory=list)
    production: bool = False
    # A request that cannot meet its deadline: "refuse" (DEADLINE_CANNOT_BE_MET as soon as that is
    # known) or "run_late" (served when its turn comes, however late).
    on_deadline: Literal["refuse", "run_late"] = "refuse"
    # Seconds a waiting request of this level may be overtaken by later work of its own level and
    # of lower levels while capacity for it exists; past that it reserves the card it needs
    # (higher levels still go first). Absent: no bound. At most a week.
    starvation_bound_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600, allow_inf_nan=False)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _stored(cls, value: Any) -> Any:
        """The store keeps a catalog as the domain's dataclasses, where a level says `run_late`:
        read back as this field (a TOML level never has it)."""
        if isinstance(value, dict) and "run_late" in value and "on_deadline" not in value:
            value = dict(value)
            value["on_deadline"] = "run_late" if value.pop("run_late") else "refuse"
        return value


class QueueSpec(_Strict):
    name: QueueName
    weight: Annotated[float, Field(gt=0, le=1_000_000)] = 1.0
    levels: list[LevelSpec] = Field(min_length=1, max_length=32)


class TenantSpec(_Strict):
    name: TenantName
    weight: Annotated[float, Field(gt=0, le=1_000_000)] = 1.0
    # Class ids; empty: `interactive` with the built-in classes, else the first queue's lowest level.
    default_priority: str = Field(default="", max_length=130)
    # Empty: the default class (a tenant asks for more only when the catalog says so).
    max_priority: str = Field(default="", max_length=130)
    queues: list[QueueName] = Field(default_factory=list)


class CatalogFile(_Strict):
    accelerators: list[AcceleratorSpec] = Field(default_factory=list)
    external: list[ExternalSpec] = Field(default_factory=list)
    deployments: list[DeploymentSpec] = Field(default_factory=list)
    tenants: list[TenantSpec] = Field(default_factory=list)
    queues: list[QueueSpec] = Field(default_factory=list, max_length=64)


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"])
        value = item.get("input")
        shown = repr(value)[:80] if not isinstance(value, dict) else "{...}"
        parts.append(f"{where}: {item['msg']} (got {shown})")
    more = len(error.errors()) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _expand_recordings(specs: list[ExternalSpec], base_dir: Path, problems: list[str]) -> list[ExternalSpec]:
    from modelforge.gpu import load_nvidia_smi

    expanded: list[ExternalSpec] = []
    for index, spec in enumerate(specs):
        if bool(spec.bytes) == bool(spec.recording):
            problems.append(f"external[{index}]: give bytes or recording, not {'both' if spec.bytes else 'neither'}")
            continue
        if not spec.recording:
            expanded.append(spec)
            continue
        try:
            [first, *_] = load_nvidia_smi(base_dir / spec.recording)
        except ModelForgeError as error:
            problems.append(f"external[{index}].recording: {error.message}")
            continue
        for process in first.external():
            expanded.append(
                spec.model_copy(update={"bytes": process.used_bytes, "recording": "", "name": process.name[:100]})
            )
    return expanded


def _deployment(spec: DeploymentSpec) -> Deployment:
    fields = spec.model_dump()
    if spec.node_count and spec.gpu_per_node and spec.gpu_count == 1:
        fields["gpu_count"] = spec.node_count * spec.gpu_per_node  # node_count x gpu_per_node
    return Deployment(**fields)


def _shape_problems(dep: DeploymentSpec) -> list[str]:
    if dep.node_count and not dep.gpu_per_node:
        return ["node_count: needs gpu_per_node (the gang is node_count x gpu_per_node cards)"]
    if dep.node_count and dep.gpu_count not in (1, dep.node_count * dep.gpu_per_node):
        return [f"gpu_count: {dep.gpu_count} is not node_count x gpu_per_node = {dep.node_count * dep.gpu_per_node}"]
    return shape_problems(_deployment(dep))


def _sleep_problems(dep: DeploymentSpec) -> list[str]:
    if dep.sleep_bytes is None:
        return []
    awake = dep.idle_bytes if dep.idle_bytes is not None else dep.envelope_bytes
    if dep.sleep_bytes >= awake:
        return [f"sleep_bytes: {dep.sleep_bytes} frees nothing (the model holds {awake} B awake)"]
    if dep.residency != Residency.KEEP_WARM:
        return [f"sleep_bytes: only keep_warm models sleep (a {dep.residency.value} one never idles warm)"]
    from modelforge.runtimes import RUNTIMES

    needs = RUNTIMES[dep.runtime].sleep_needs
    if not all(dep.runtime_config.get(key) for key in needs):
        return [f"sleep_bytes: {dep.runtime} needs runtime_config.{' and '.join(needs)} to sleep"]
    return []


def _runtime_problems(dep: DeploymentSpec) -> list[str]:
    """The runtime's own configuration, checked when the catalog is applied, not at first load."""
    from modelforge.runtimes import RUNTIMES, runtime_names
    from modelforge.runtimes._secrets import secret_problems

    secrets = secret_problems(dep.runtime_config, dep.env_from_secrets)
    spec = RUNTIMES.get(dep.runtime)
    if dep.env_from_secrets and (spec is None or not spec.env_from_secrets):
        giving = " and ".join(runtime_names(lambda other: other.env_from_secrets))
        secrets.append(f"env_from_secrets: only {giving} gives a server an environment, not {dep.runtime}")
    if secrets:
        return secrets  # never a secret's value: names and the reference syntax only
    spec = RUNTIMES[dep.runtime]
    if spec.config is not None:
        try:
            spec.config(Deployment(**dep.model_dump()))
        except ModelForgeError as error:
            return [error.message]
    if dep.command and not spec.runs_command:
        running = " and ".join(runtime_names(lambda other: other.runs_command))
        return [f"command: only {running} run a command, not {dep.runtime}"]
    return []


def _nesting_problem(data: object, limit: int = MAX_NESTING) -> str | None:
    """Where `data` nests lists and tables deeper than `limit`, or None; iterative."""
    stack: list[tuple[object, str, int]] = [(data, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, dict):
            children: list[tuple[object, str]] = [(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()]
        elif isinstance(item, list | tuple):
            children = [(v, f"{where}[{i}]") for i, v in enumerate(item)]
        else:
            continue
        if depth >= limit:
            return f"{where[:200]}: nested deeper than {limit} levels"
        stack.extend((child, path, depth + 1) for child, path in children)
    return None


def parse_catalog(data: dict[str, Any], base_dir: Path | None = None) -> tuple[Catalog, list[ExternalSpec]]:
    """Validate a catalog. Linear in its size (a catalog of 20,000 tenants validates in well
    under a second): duplicates and references are found through sets and counters."""
    nesting = _nesting_problem(data)
    if nesting is not None:
        raise CatalogError(f"invalid catalog: {nesting}")
    try:
        spec = CatalogFile.model_validate(data)
    except ValidationError as error:
        raise CatalogError(f"invalid catalog: {_describe(error)}") from None
    problems: list[str] = []
    ids = [a.id for a in spec.accelerators]
    id_counts = Counter(ids)
    known_ids = set(ids)
    for index, acc in enumerate(spec.accelerators):
        if id_counts[acc.id] > 1:
            problems.append(f"accelerators[{index}].id: duplicate {acc.id!r}")
        if acc.kind == "cpu" and acc.production_eligible:
            problems.append(f"accelerators[{index}].production_eligible: a cpu device is never production eligible")
        if acc.reserve_bytes >= acc.total_bytes:
            problems.append(f"accelerators[{index}].reserve_bytes: {acc.reserve_bytes} is not below total_bytes")
    cap_counts = Counter(d.capability for d in spec.deployments)
    # OpenAI model name -> the capabilities it names (its own capability, or in openai_models).
    model_owners: dict[str, list[str]] = {}
    for dep in spec.deployments:
        for model in dict.fromkeys([dep.capability, *dep.openai_models]):
            model_owners.setdefault(model, []).append(dep.capability)
    for index, dep in enumerate(spec.deployments):
        if cap_counts[dep.capability] > 1:
            problems.append(f"deployments[{index}].capability: duplicate {dep.capability!r}")
        if dep.residency in (Residency.EXCLUSIVE, Residency.LAB_ONLY):
            problems.append(
                f"deployments[{index}].residency: {dep.residency.value!r} is reserved for later and not served yet"
            )
        if dep.idle_bytes is not None and dep.idle_bytes > dep.envelope_bytes:
            problems.append(f"deployments[{index}].idle_bytes: {dep.idle_bytes} exceeds envelope_bytes")
        problems.extend(f"deployments[{index}].{problem}" for problem in _sleep_problems(dep))
        problems.extend(f"deployments[{index}].{problem}" for problem in _runtime_problems(dep))
        problems.extend(f"deployments[{index}].{problem}" for problem in _shape_problems(dep))
        for acc_id in dep.accelerators:
            if acc_id not in known_ids:
                problems.append(f"deployments[{index}].accelerators: unknown accelerator {acc_id!r}")
        for model in dep.openai_models:
            owners = model_owners.get(model, [])
            if len(owners) > 1:
                problems.append(f"deployments[{index}].openai_models: {model!r} names {' and '.join(owners)}")
    queues = _queues(spec.queues, problems)
    classes = build_classes(queues or DEFAULT_QUEUES)
    tenants = [_tenant(index, t, queues or DEFAULT_QUEUES, classes, problems) for index, t in enumerate(spec.tenants)]
    name_counts = Counter(t.name for t in spec.tenants)
    for index, tenant_spec in enumerate(spec.tenants):
        if name_counts[tenant_spec.name] > 1:
            problems.append(f"tenants[{index}].name: duplicate {tenant_spec.name!r}")
    for index, ext in enumerate(spec.external):
        if ext.accelerator not in known_ids:
            problems.append(f"external[{index}].accelerator: unknown accelerator {ext.accelerator!r}")
    external = _expand_recordings(list(spec.external), base_dir or Path.cwd(), problems)
    if problems:
        raise CatalogError("invalid catalog: " + "; ".join(problems))
    catalog = Catalog(
        accelerators=[
            Accelerator(
                id=a.id,
                node=a.node,
                total_bytes=a.total_bytes,
                production_eligible=a.production_eligible,
                kind=a.kind,
                model=a.model,
                uuid=a.uuid,
                pool=a.pool,
                nvlink_group=a.nvlink_group or a.nvlink_group_id,
                rack=a.rack or a.rack_id,
                network_bandwidth_gbps=a.network_bandwidth_gbps,
                reserve_bytes=a.reserve_bytes,
                simulated=a.simulated,
            )
            for a in spec.accelerators
        ],
        deployments=[_deployment(d) for d in spec.deployments],
        tenants=tenants,
        queues=queues,
    )
    return catalog, external


def _queues(specs: list[QueueSpec], problems: list[str]) -> list[Queue]:
    """The configured queues ([[queues]]). A level preempts only strictly lower priorities, so
    preemption can never cycle (A stops B to run, B stops A to run)."""
    queues = [
        Queue(
            name=q.name,
            weight=q.weight,
            levels=[
                PriorityLevel(
                    name=lv.name,
                    priority=lv.priority,
                    preempts=list(lv.preempts),
                    production=lv.production,
                    run_late=lv.on_deadline == "run_late",
                    starvation_bound_s=lv.starvation_bound_s,
                )
                for lv in q.levels
            ],
        )
        for q in specs
    ]
    names = [q.name for q in specs]
    classes = build_classes(queues)
    # Production admission rules (eligible accelerators, measured envelopes) follow the level, and
    # the queue orders by priority: a production level shares its priority with no other kind.
    kinds: dict[int, set[bool]] = {}
    for klass in classes.values():
        kinds.setdefault(klass.priority, set()).add(klass.production)
    for priority, flags in sorted(kinds.items()):
        if len(flags) > 1:
            shared = ", ".join(k.id for k in classes.values() if k.priority == priority)
            problems.append(f"queues: priority {priority} is shared by production and other levels ({shared})")
    for index, queue in enumerate(specs):
        if names.count(queue.name) > 1:
            problems.append(f"queues[{index}].name: duplicate {queue.name!r}")
        levels = [level.name for level in queue.levels]
        for position, level in enumerate(queue.levels):
            where = f"queues[{index}].levels[{position}]"
            if levels.count(level.name) > 1:
                problems.append(f"{where}.name: duplicate level {level.name!r} in queue {queue.name!r}")
            for target in level.preempts:
                victim = classes.get(level_ref(queue.name, target))
                if victim is None:
                    problems.append(f"{where}.preempts: no level {target!r} (known: {', '.join(classes)})")
                elif victim.priority >= level.priority:
                    problems.append(
                        f"{where}.preempts: {level.name!r} (priority {level.priority}) may only preempt lower "
                        f"priorities, not {target!r} ({victim.priority})"
                    )
    return queues


def _tenant(
    index: int, spec: TenantSpec, queues: list[Queue], typed: dict[str, PriorityClass], problems: list[str]
) -> Tenant:
    if queues is DEFAULT_QUEUES:
        fallback = Priority.INTERACTIVE.value
    else:
        fallback = class_id(queues[0].name, queues[0].levels[-1].name)
    default = spec.default_priority or fallback
    ceiling = spec.max_priority or default
    where = f"tenants[{index}]"
    for field_name, value in (("default_priority", default), ("max_priority", ceiling)):
        if value not in typed:
            problems.append(f"{where}.{field_name}: no class {value!r} (known: {', '.join(typed)})")
    for queue in spec.queues:
        if all(q.name != queue for q in queues):
            problems.append(f"{where}.queues: no queue {queue!r}")
    if default in typed and ceiling in typed:
        if typed[default].priority > typed[ceiling].priority:
            problems.append(f"{where}.default_priority: {default!r} is above max_priority {ceiling!r}")
        if spec.queues and typed[default].queue not in spec.queues:
            problems.append(f"{where}.default_priority: {default!r} is not in the tenant's queues")
    return Tenant(
        name=spec.name, weight=spec.weight, default_priority=default, max_priority=ceiling, queues=list(spec.queues)
    )


def load_catalog_file(path: Path) -> tuple[Catalog, list[ExternalSpec]]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogError(f"catalog file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise CatalogError(f"catalog file {path} is not valid TOML: {error}") from None
    except RecursionError:
        raise CatalogError(f"catalog file {path} nests too deeply to read") from None
    return parse_catalog(data, path.parent)


def example_catalog_path() -> Path:
    return Path(__file__).parent / "examples" / "catalog.toml"
