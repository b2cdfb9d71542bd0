"""The runtimes a deployment may name, one entry each. Adding a runtime is its module and one
entry here: the catalog validates `runtime` and `runtime_config` through this table, and a node
worker builds the runtimes it serves from it (workers/node.py `node_runtimes`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from modelforge.domain import Deployment
from modelforge.gpu import NodeDevices
from modelforge.logging import get_logger
from modelforge.runtimes._protocol import Runtime
from modelforge.runtimes._sentence_transformers import SentenceTransformersConfig, SentenceTransformersRuntime
from modelforge.runtimes._simulated import SIMULATED_PARAMETERS, SimulatedRuntime, generates_text
from modelforge.runtimes._subprocess_http import SubprocessHttpConfig, SubprocessHttpRuntime
from modelforge.runtimes._subprocess_job import SubprocessJobConfig, SubprocessJobRuntime

log = get_logger("modelforge.worker.node")  # reaping happens as a node worker starts


@dataclass(frozen=True)
class NodeContext:
    """What a runtime is built from on a node worker."""

    devices: NodeDevices
    home: Path  # MODELFORGE_HOME: logs, pid files, job directories
    node: str


@dataclass(frozen=True)
class Speaks:
    """What a deployment on a runtime speaks to the gateway: what the gateway decides by, so
    that it never compares runtime names."""

    # The wire API of the model server behind it: "openai_chat" / "openai_embeddings"
    # (OpenAI-compatible: a request's parameters pass through whole) or "tei_embed" (takes
    # none); None: the runtime answers ModelForge's own inputs and takes no parameters.
    api: str | None
    # What it answers: "text" (completions, chat) and/or "vectors" (embeddings), or "scores" (a
    # reranker: a query's relevance to each document, POST /v1/rerank).
    answers: frozenset[str]
    job: bool = False  # a batch job run to its end (POST /v1/jobs), not a model server
    # Where `api` is None: the chat and completion parameters the runtime takes itself (the
    # simulated one takes a real server's sampling parameters); any other is refused, named.
    parameters: frozenset[str] = frozenset()
    # Takes a prompt as it is, with no chat template (Ollama's `raw`; OpenAI's completions), and
    # a `suffix` to fill in the middle of where the catalog's `features` say "insert".
    raw_prompt: bool = False


# What the gateway assumes of a runtime no entry names (a catalog refuses one; a hand-built
# Deployment may still carry one): ModelForge's own inputs, both answers.
_UNKNOWN = Speaks(None, frozenset({"text", "vectors"}))


@dataclass(frozen=True)
class RuntimeSpec:
    name: str
    # Builds the runtime on a node worker (and stops what an earlier, killed run of it left behind).
    build: Callable[[NodeContext], Runtime]
    # The deployment's runtime configuration, or ModelForgeError(REQUEST_INVALID) naming the
    # field; called when the catalog is applied, not at first load. None: nothing to configure.
    config: Callable[[Deployment], object] | None = None
    runs_command: bool = False  # the deployment's `command` is what it runs
    job: bool = False  # a batch job run to its end, not a model server answering requests
    env_from_secrets: bool = False  # gives what it starts an environment (`env_from_secrets`)
    # runtime_config keys a deployment needs set before its model may sleep (`sleep_bytes`).
    sleep_needs: tuple[str, ...] = ()
    # Built only beside simulated cards: on a real one it would count bytes no process holds.
    simulated_only: bool = False
    # What a deployment on it speaks (it may depend on the deployment's runtime_config).
    speaks: Callable[[Deployment], Speaks] = field(kw_only=True)


def _subprocess_http(ctx: NodeContext) -> Runtime:
    runtime = SubprocessHttpRuntime(ctx.devices, ctx.home / "runtime-logs" / ctx.node)
    reaped = runtime.reap_orphans()
    if reaped:
        log.warning("orphaned_model_servers_stopped", node=ctx.node, pids=reaped)
    return runtime


def _subprocess_job(ctx: NodeContext) -> Runtime:
    from modelforge.settings import Settings

    # The artifact store (MODELFORGE_ARTIFACT_STORE), else the one under ctx.home.
    runtime = SubprocessJobRuntime(ctx.devices, ctx.home, ctx.node, Settings.from_env().artifact_store)
    reaped = runtime.reap_orphans()
    if reaped:
        log.warning("orphaned_jobs_stopped", node=ctx.node, pids=reaped)
    return runtime


def _http_speaks(deployment: Deployment) -> Speaks:
    api = deployment.runtime_config.get("api", "openai_embeddings")  # SubprocessHttpConfig's default
    answers = {"openai_chat": "text", "rerank": "scores"}.get(api, "vectors")
    return Speaks(api, frozenset({answers}), raw_prompt=api == "openai_chat")


def _simulated_speaks(deployment: Deployment) -> Speaks:
    # Answers both; a text model takes sampling parameters as a real server does (and says which
    # it got), an embedding model none (as a real embeddings server refuses `temperature`).
    taken = SIMULATED_PARAMETERS if generates_text(deployment) else frozenset()
    return Speaks(None, frozenset({"text", "vectors"}), parameters=taken, raw_prompt=generates_text(deployment))


_SPECS = (
    RuntimeSpec(
        "simulated",
        lambda ctx: SimulatedRuntime(ctx.devices),
        simulated_only=True,
        speaks=_simulated_speaks,
    ),
    RuntimeSpec(
        "subprocess_http",
        _subprocess_http,
        SubprocessHttpConfig.of,
        runs_command=True,
        env_from_secrets=True,
        sleep_needs=("sleep_path", "wake_path"),
        speaks=_http_speaks,
    ),
    RuntimeSpec(
        "subprocess_job",
        _subprocess_job,
        SubprocessJobConfig.of,
        runs_command=True,
        job=True,
        # As the gateway always listed it to Ollama clients (it serves no requests).
        speaks=lambda deployment: Speaks(None, frozenset({"text", "vectors"}), job=True),
    ),
    RuntimeSpec(
        "sentence_transformers",
        lambda ctx: SentenceTransformersRuntime(ctx.devices),
        SentenceTransformersConfig.of,
        # A cross-encoder (runtime_config task = "rerank") scores; the default embeds.
        speaks=lambda deployment: Speaks(
            None, frozenset({"scores" if deployment.runtime_config.get("task") == "rerank" else "vectors"})
        ),
    ),
)

RUNTIMES: Mapping[str, RuntimeSpec] = MappingProxyType({spec.name: spec for spec in _SPECS})


def runtime_names(where: Callable[[RuntimeSpec], bool] = lambda spec: True) -> list[str]:
    """The registered runtimes' names (those `where` holds for), in registry order."""
    return [name for name, spec in RUNTIMES.items() if where(spec)]


def speaks(deployment: Deployment) -> Speaks:
    """What `deployment` speaks, from its runtime's entry: the one place the gateway asks."""
    spec = RUNTIMES.get(deployment.runtime)
    return _UNKNOWN if spec is None else spec.speaks(deployment)


def fills_in_the_middle(deployment: Deployment) -> bool:
    """Whether a `suffix` may be sent to `deployment` (fill-in-the-middle): its runtime takes raw
    prompts and the catalog says the model does it (`features` "insert"). The one rule the
    Ollama and OpenAI routes and `/api/show` ask."""
    return speaks(deployment).raw_prompt and "insert" in deployment.features


def unknown_runtime(name: str) -> str | None:
    """None for a registered runtime, else what the catalog says about `name`."""
    if name in RUNTIMES:
        return None
    return f"unknown runtime {name[:80]!r} (known: {', '.join(RUNTIMES)})"


def build_runtimes(devices: NodeDevices, home: Path, node: str) -> dict[str, Runtime]:
    """Every registered runtime this node serves, by name."""
    ctx = NodeContext(devices, home, node)
    return {
        name: spec.build(ctx) for name, spec in RUNTIMES.items() if devices.simulated_gpus or not spec.simulated_only
    }
