"""Model runtimes behind one Protocol: simulated, a model server as a subprocess over HTTP, a
batch job as a subprocess, and the built-in sentence-transformers embedding runtime. `RUNTIMES`
(modelforge/runtimes/_registry.py) lists them: a new runtime is its module plus one entry there."""

from modelforge.runtimes._artifacts import (
    CheckedArtifact,
    artifact_digest,
    check_artifact,
    resolve_artifact,
    verify_artifact,
)
from modelforge.runtimes._process import process_tree, rss_bytes
from modelforge.runtimes._protocol import Heartbeat, LoadedModel, Runtime
from modelforge.runtimes._registry import (
    RUNTIMES,
    NodeContext,
    RuntimeSpec,
    Speaks,
    build_runtimes,
    fills_in_the_middle,
    runtime_names,
    speaks,
    unknown_runtime,
)
from modelforge.runtimes._sentence_transformers import (
    BUILTIN_MODEL,
    SentenceTransformersConfig,
    SentenceTransformersRuntime,
)
from modelforge.runtimes._simulated import SimulatedRuntime
from modelforge.runtimes._subprocess_http import SubprocessHttpConfig, SubprocessHttpRuntime
from modelforge.runtimes._subprocess_job import (
    CHECKPOINTED_EXIT,
    SubprocessJobConfig,
    SubprocessJobRuntime,
    job_log_dirs,
)

__all__ = [
    "BUILTIN_MODEL",
    "CHECKPOINTED_EXIT",
    "RUNTIMES",
    "CheckedArtifact",
    "Heartbeat",
    "LoadedModel",
    "NodeContext",
    "Runtime",
    "RuntimeSpec",
    "SentenceTransformersConfig",
    "SentenceTransformersRuntime",
    "SimulatedRuntime",
    "Speaks",
    "SubprocessHttpConfig",
    "SubprocessHttpRuntime",
    "SubprocessJobConfig",
    "SubprocessJobRuntime",
    "artifact_digest",
    "build_runtimes",
    "check_artifact",
    "fills_in_the_middle",
    "job_log_dirs",
    "process_tree",
    "resolve_artifact",
    "rss_bytes",
    "runtime_names",
    "speaks",
    "unknown_runtime",
    "verify_artifact",
]
