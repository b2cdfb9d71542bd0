"""Settings from the environment (the README's Configuration table). Secrets come from the environment or
files and are never logged: `Settings.__repr__` hides them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from modelforge.failures import FailureClass, ModelForgeError

CONTROL_TASK_QUEUE = "modelforge-control"
# The pool schedulers' own task queue (served by the control worker process): a backlog of
# request workflows on the control queue never delays an admission.
SCHEDULER_TASK_QUEUE = "modelforge-scheduler"
DEFAULT_POOL = "default"
DEFAULT_PAYLOAD_THRESHOLD_BYTES = 2 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


NODE_TASK_QUEUE_PREFIX = "modelforge-node-"


def node_task_queue(node: str) -> str:
    return f"{NODE_TASK_QUEUE_PREFIX}{node}"


def _read_secret(value_var: str, file_var: str) -> str | None:
    value = os.environ.get(value_var)
    path = os.environ.get(file_var)
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"{file_var}: cannot read {path}: {error.strerror}"
            ) from None
    return value


def _positive_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) <= 0:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{name} must be a positive number of bytes, not {text!r}")
    return int(text)


@dataclass(frozen=True)
class Settings:
    temporal_address: str = "localhost:7233"
    temporal_namespace: str = "default"
    temporal_tls: bool = False
    temporal_tls_cert: str | None = None
    temporal_tls_key: str | None = None
    temporal_tls_ca: str | None = None
    temporal_api_key: str | None = field(default=None, repr=False)
    database_url: str | None = field(default=None, repr=False)
    home: Path = Path.home() / ".modelforge"
    gpu_backend: str = "auto"
    metrics_port: int = 9464
    # The interface the control worker's /metrics listens on (MODELFORGE_METRICS_HOST): loopback
    # unless configured; the compose stack sets 0.0.0.0 inside its network for Prometheus.
    metrics_host: str = "127.0.0.1"
    # Capacity snapshots older than this are dropped (MODELFORGE_SNAPSHOT_RETENTION_DAYS).
    snapshot_retention_days: float = 30.0
    # Where model artifacts may be read from (MODELFORGE_ARTIFACT_ROOTS, os.pathsep-separated);
    # empty: $MODELFORGE_HOME/artifacts.
    artifact_roots: tuple[Path, ...] = ()
    # The checkpoint store of preempted work (MODELFORGE_CHECKPOINT_DIR); empty:
    # $MODELFORGE_HOME/checkpoints. A shared filesystem when jobs may resume on another node.
    checkpoint_dir: Path | None = None
    # The store of payloads too large for the event history (MODELFORGE_PAYLOAD_DIR); empty:
    # $MODELFORGE_HOME/payloads. Every client and worker must see the same directory: a shared
    # filesystem on a cluster (modelforge/payloads.py, docs/RUNTIMES.md "Large payloads").
    payload_dir: Path | None = None
    # A request workflow's payloads of this many bytes or more leave its history
    # (MODELFORGE_PAYLOAD_THRESHOLD_BYTES); other workflows' from 256 KiB.
    payload_threshold_bytes: int = DEFAULT_PAYLOAD_THRESHOLD_BYTES
    # The largest request input a client sends (MODELFORGE_MAX_PAYLOAD_BYTES): past it the
    # request is REQUEST_INVALID before any workflow starts.
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    # How long stored payloads are kept (MODELFORGE_PAYLOAD_RETENTION_DAYS); None: the
    # namespace's workflow retention plus a day.
    payload_retention_days: float | None = None
    # How often the control worker replays each pool scheduler's history to catch one no worker
    # could replay before it wedges the pool (MODELFORGE_REPLAY_CHECK_S; 0: off;
    # workers/replay_guard.py). Checks also follow every Temporal outage.
    replay_check_s: float = 60.0

    def resolved_payload_dir(self) -> Path:
        return self.payload_dir or self.home / "payloads"

    def resolved_checkpoint_dir(self) -> Path:
        return self.checkpoint_dir or self.home / "checkpoints"

    def resolved_artifact_roots(self) -> list[Path]:
        return list(self.artifact_roots) or [self.home / "artifacts"]

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    def resolved_database_url(self) -> str | None:
        """The configured URL, or the one `modelforge dev` wrote for its embedded Postgres."""
        if self.database_url:
            return self.database_url
        written = self.run_dir / "database_url"
        if written.exists():
            return written.read_text(encoding="utf-8").strip() or None
        return None

    @classmethod
    def from_env(cls) -> Settings:
        backend = os.environ.get("MODELFORGE_GPU_BACKEND", "auto")
        if backend not in ("auto", "nvml", "simulated"):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"MODELFORGE_GPU_BACKEND must be auto, nvml or simulated, not {backend!r}"
            )
        port = os.environ.get("MODELFORGE_METRICS_PORT", "9464")
        if not port.isdigit():
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"MODELFORGE_METRICS_PORT must be a port, not {port!r}")
        metrics_host = os.environ.get("MODELFORGE_METRICS_HOST", "127.0.0.1").strip()
        if not metrics_host or any(c.isspace() or not c.isprintable() for c in metrics_host):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"MODELFORGE_METRICS_HOST must be an interface address or host name, not {metrics_host!r}",
            )
        retention = os.environ.get("MODELFORGE_SNAPSHOT_RETENTION_DAYS", "30")
        try:
            retention_days = float(retention)
        except ValueError:
            retention_days = -1.0
        if not retention_days > 0:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"MODELFORGE_SNAPSHOT_RETENTION_DAYS must be a positive number of days, not {retention!r}",
            )
        payload_threshold = _positive_int("MODELFORGE_PAYLOAD_THRESHOLD_BYTES", DEFAULT_PAYLOAD_THRESHOLD_BYTES)
        max_payload = _positive_int("MODELFORGE_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES)
        payload_retention: float | None = None
        if os.environ.get("MODELFORGE_PAYLOAD_RETENTION_DAYS"):
            text = os.environ["MODELFORGE_PAYLOAD_RETENTION_DAYS"]
            try:
                payload_retention = float(text)
            except ValueError:
                payload_retention = -1.0
            if not payload_retention > 0:
                raise ModelForgeError(
                    FailureClass.REQUEST_INVALID,
                    f"MODELFORGE_PAYLOAD_RETENTION_DAYS must be a positive number of days, not {text!r}",
                )
        replay_text = os.environ.get("MODELFORGE_REPLAY_CHECK_S", "60").strip()
        try:
            replay_check_s = float(replay_text)
        except ValueError:
            replay_check_s = -1.0
        if not (replay_check_s == 0 or 5 <= replay_check_s <= 86400):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"MODELFORGE_REPLAY_CHECK_S must be 0 (off) or 5 to 86400 seconds, not {replay_text!r}",
            )
        return cls(
            temporal_address=os.environ.get("MODELFORGE_TEMPORAL_ADDRESS", "localhost:7233"),
            temporal_namespace=os.environ.get("MODELFORGE_TEMPORAL_NAMESPACE", "default"),
            temporal_tls=os.environ.get("MODELFORGE_TEMPORAL_TLS", "").lower() in ("1", "true", "yes"),
            temporal_tls_cert=os.environ.get("MODELFORGE_TEMPORAL_TLS_CERT"),
            temporal_tls_key=os.environ.get("MODELFORGE_TEMPORAL_TLS_KEY"),
            temporal_tls_ca=os.environ.get("MODELFORGE_TEMPORAL_TLS_CA"),
            temporal_api_key=_read_secret("MODELFORGE_TEMPORAL_API_KEY", "MODELFORGE_TEMPORAL_API_KEY_FILE"),
            database_url=_read_secret("MODELFORGE_DATABASE_URL", "MODELFORGE_DATABASE_URL_FILE"),
            home=Path(os.environ.get("MODELFORGE_HOME", str(Path.home() / ".modelforge"))),
            gpu_backend=backend,
            metrics_port=int(port),
            metrics_host=metrics_host,
            snapshot_retention_days=retention_days,
            artifact_roots=tuple(
                Path(root) for root in os.environ.get("MODELFORGE_ARTIFACT_ROOTS", "").split(os.pathsep) if root
            ),
            checkpoint_dir=Path(os.environ["MODELFORGE_CHECKPOINT_DIR"])
            if os.environ.get("MODELFORGE_CHECKPOINT_DIR")
            else None,
            payload_dir=Path(os.environ["MODELFORGE_PAYLOAD_DIR"])
            if os.environ.get("MODELFORGE_PAYLOAD_DIR")
            else None,
            payload_threshold_bytes=payload_threshold,
            max_payload_bytes=max_payload,
            payload_retention_days=payload_retention,
            replay_check_s=replay_check_s,
        )
