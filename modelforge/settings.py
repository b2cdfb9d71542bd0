"""Settings from the environment (the README's Configuration table), on pydantic-settings: field
`name` is the variable MODELFORGE_<NAME>, and an empty variable counts as unset. Secrets (the
Temporal API key, the database URL) come from their variable or from the file their `*_FILE`
variant names (the file first) and are never logged: `repr(settings)` and `model_dump()` leave
them out. Byte sizes take pydantic's `ByteSize` forms (`2048`, `2 KiB`, `64MiB`, `1.5GB`; KiB is
1024 bytes, KB 1000) and are plain ints on the object. `Settings.from_env()` refuses a bad value
with REQUEST_INVALID naming its variable."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ByteSize, Field, TypeAdapter, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from modelforge.failures import FailureClass, ModelForgeError

# Task queues and the default pool live with the other Temporal names (re-exported here).
from modelforge.names import CONTROL_TASK_QUEUE as CONTROL_TASK_QUEUE
from modelforge.names import DEFAULT_POOL as DEFAULT_POOL
from modelforge.names import NODE_TASK_QUEUE_PREFIX as NODE_TASK_QUEUE_PREFIX
from modelforge.names import SCHEDULER_TASK_QUEUE as SCHEDULER_TASK_QUEUE
from modelforge.names import node_task_queue as node_task_queue

DEFAULT_PAYLOAD_THRESHOLD_BYTES = 2 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024

ENV_PREFIX = "MODELFORGE_"
# The Temporal SDK's worker metrics (modelforge/temporal.py `worker_runtime`): loopback, one port
# per role so a control and a node worker on one host do not collide.
TEMPORAL_METRICS_ADDRESS = "MODELFORGE_TEMPORAL_METRICS_ADDRESS"
TEMPORAL_METRICS_DEFAULTS: dict[str, str] = {"control": "127.0.0.1:9465", "node": "127.0.0.1:9466"}
_OFF = ("off", "none", "0")


def env_var(field: str) -> str:
    """The variable of a setting: `max_payload_bytes` is MODELFORGE_MAX_PAYLOAD_BYTES."""
    return f"{ENV_PREFIX}{field.upper()}"


_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)


def _byte_size(value: Any) -> int:
    """A positive number of bytes from an int or a `ByteSize` string ("64MiB", "2 KiB")."""
    if isinstance(value, bool):
        raise ValueError("not a number of bytes")
    size = int(_BYTE_SIZE.validate_python(value))
    if size <= 0:
        raise ValueError("not a positive number of bytes")
    return size


# A byte size: a positive int on the object, given as one or in `ByteSize` form.
Bytes = Annotated[int, BeforeValidator(_byte_size)]
Days = Annotated[float, Field(gt=0, allow_inf_nan=False)]

# What each setting must be, for the REQUEST_INVALID that names its variable.
_MUST_BE: dict[str, str] = {
    "temporal_tls": "true or false (1, yes, on; 0, no, off)",
    "gpu_backend": "auto, nvml or simulated",
    "metrics_port": "a port (0 to 65535)",
    "metrics_host": "an interface address or host name",
    "temporal_metrics_address": "host:port (127.0.0.1:9465) or off",
    "temporal_http_address": "host:port (127.0.0.1:7243) or off",
    "snapshot_retention_days": "a positive number of days",
    "payload_retention_days": "a positive number of days",
    "payload_threshold_bytes": "a positive number of bytes (2048, 2 KiB, 64MiB)",
    "max_payload_bytes": "a positive number of bytes (2048, 2 KiB, 64MiB)",
    "replay_check_s": "0 (off) or 5 to 86400 seconds",
    "delegation_sync_s": "0 (off) or 0.1 to 10 seconds",
    "worker_deployment": "a name of letters, digits, '-' and '_' (no '.')",
    "worker_build_id": "a build id of letters, digits, '.', '+', '-' and '_'",
    "worker_versioning": "true or false (1, yes, on; 0, no, off)",
}
# Read from the variable or the file MODELFORGE_<NAME>_FILE names; never shown.
_SECRETS = ("temporal_api_key", "database_url")

# The environment `from_env` reads: os.environ unless given another mapping.
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("modelforge_settings_environ", default=None)


class _MappingEnv(EnvSettingsSource):
    """The environment source over a given mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {
            (key if self.case_sensitive else key.lower()): value
            for key, value in self._environ.items()
            if not (self.env_ignore_empty and value == "")
        }


class _SecretFiles(PydanticBaseSettingsSource):
    """A secret from the file its `*_FILE` variable names (MODELFORGE_DATABASE_URL_FILE), ahead
    of the variable itself; an unreadable file is REQUEST_INVALID naming the variable and the
    path, never any contents."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self._environ = {key.upper(): value for key, value in environ.items()}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every secret itself

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name in _SECRETS:
            file_var = f"{env_var(name)}_FILE"
            path = self._environ.get(file_var)
            if not path:
                continue
            try:
                values[name] = Path(path).read_text(encoding="utf-8").strip()
            except OSError as error:
                raise ModelForgeError(
                    FailureClass.REQUEST_INVALID, f"{file_var}: cannot read {path}: {error.strerror}"
                ) from None
        return values


def _invalid(error: ValidationError) -> ModelForgeError:
    """The first error of a validation as REQUEST_INVALID naming the variable; a secret's value
    is never shown, others' at most 80 characters of it."""
    first = error.errors(include_url=False)[0]
    name = str(first["loc"][0]) if first["loc"] else ""
    if name not in Settings.model_fields:
        return ModelForgeError(FailureClass.REQUEST_INVALID, f"settings: {first['msg']}")
    must_be = _MUST_BE.get(name, first["msg"].lower())
    if name in _SECRETS:
        return ModelForgeError(FailureClass.REQUEST_INVALID, f"{env_var(name)} must be {must_be}")
    value = first.get("input")
    shown = value[:80] if isinstance(value, str) else value
    return ModelForgeError(FailureClass.REQUEST_INVALID, f"{env_var(name)} must be {must_be}, not {shown!r}")


class Settings(BaseSettings):
    """Every field is the variable MODELFORGE_<FIELD>. `Settings.from_env()` reads the process's
    environment (typed errors); `Settings(home=...)` takes keywords over it (tests);
    `settings.replace(**changes)` is a validated copy."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, frozen=True, extra="forbid")

    temporal_address: str = "localhost:7233"
    temporal_namespace: str = "default"
    temporal_tls: bool = False
    # TLS / mTLS file paths.
    temporal_tls_cert: str | None = None
    temporal_tls_key: str | None = None
    temporal_tls_ca: str | None = None
    # Secrets (also from MODELFORGE_TEMPORAL_API_KEY_FILE, MODELFORGE_DATABASE_URL_FILE).
    temporal_api_key: str | None = Field(default=None, repr=False, exclude=True)
    # host:port of the Temporal frontend's HTTP API (MODELFORGE_TEMPORAL_HTTP_ADDRESS), or "off";
    # None: the dev server's, the gRPC port + 10 on its host (7243). `modelforge dev` serves it
    # there, and `status --json` and `request` read it without the SDK (modelforge/_fastcli.py).
    temporal_http_address: str | None = None
    database_url: str | None = Field(default=None, repr=False, exclude=True)
    home: Path = Field(default_factory=lambda: Path.home() / ".modelforge")
    gpu_backend: Literal["auto", "nvml", "simulated"] = "auto"
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    # The interface the control worker's /metrics listens on (MODELFORGE_METRICS_HOST): loopback
    # unless configured; the compose stack sets 0.0.0.0 inside its network for Prometheus.
    metrics_host: str = "127.0.0.1"
    # host:port of the Temporal SDK's worker metrics, or "off"; None: the role's default
    # (TEMPORAL_METRICS_DEFAULTS). `temporal_metrics_bind(role)` resolves it.
    temporal_metrics_address: str | None = None
    # Capacity snapshots older than this are dropped (MODELFORGE_SNAPSHOT_RETENTION_DAYS).
    snapshot_retention_days: Days = 30.0
    # Where model artifacts may be read from (MODELFORGE_ARTIFACT_ROOTS, os.pathsep-separated);
    # empty: $MODELFORGE_HOME/artifacts.
    artifact_roots: Annotated[tuple[Path, ...], NoDecode] = ()
    # The checkpoint store of preempted work (MODELFORGE_CHECKPOINT_DIR); empty:
    # $MODELFORGE_HOME/checkpoints. A shared filesystem when jobs may resume on another node.
    checkpoint_dir: Path | None = None
    # The artifact store of jobs' outputs (MODELFORGE_ARTIFACT_STORE); empty:
    # $MODELFORGE_HOME/artifacts/store. A shared filesystem when a job may take another node's
    # output; put it inside MODELFORGE_ARTIFACT_ROOTS for deployments to serve its artifacts.
    artifact_store: Path | None = None
    # The store of payloads too large for the event history (MODELFORGE_PAYLOAD_DIR); empty:
    # $MODELFORGE_HOME/payloads. Every client and worker must see the same directory: a shared
    # filesystem on a cluster (modelforge/payloads.py, docs/RUNTIMES.md "Large payloads").
    payload_dir: Path | None = None
    # A request workflow's payloads of this many bytes or more leave its history
    # (MODELFORGE_PAYLOAD_THRESHOLD_BYTES); other workflows' from 256 KiB.
    payload_threshold_bytes: Bytes = DEFAULT_PAYLOAD_THRESHOLD_BYTES
    # The largest request input a client sends (MODELFORGE_MAX_PAYLOAD_BYTES): past it the
    # request is REQUEST_INVALID before any workflow starts.
    max_payload_bytes: Bytes = DEFAULT_MAX_PAYLOAD_BYTES
    # How long stored payloads are kept (MODELFORGE_PAYLOAD_RETENTION_DAYS); None: the
    # namespace's workflow retention plus the longest request plus a day; never less than the
    # longest request plus a day (payloads.retention_floor_s).
    payload_retention_days: Days | None = None
    # How often the control worker replays each pool scheduler's history to catch one no worker
    # could replay before it wedges the pool (MODELFORGE_REPLAY_CHECK_S; 0: off;
    # workers/replay_guard.py). Checks also follow every Temporal outage.
    replay_check_s: float = 60.0
    # How often a node worker syncs the slots its scheduler lent it for warm requests, while it
    # holds any (MODELFORGE_DELEGATION_SYNC_S; 0: no delegation, every request is admitted by
    # the scheduler; activities/_delegation.py). A request waiting at the scheduler is overtaken
    # on a node for at most about this long.
    delegation_sync_s: float = 1.0
    # The Worker Deployment Version the workers declare (modelforge/versioning.py): the
    # deployment's name (MODELFORGE_WORKER_DEPLOYMENT) and this build's id
    # (MODELFORGE_WORKER_BUILD_ID; unset: the package's version). With MODELFORGE_WORKER_VERSIONING
    # (the default) the control worker's workflows are pinned to the build that started them.
    worker_deployment: str = "modelforge"
    worker_build_id: str | None = None
    worker_versioning: bool = True

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keywords first, then a secret's file, then the environment; no .env files.
        environ = _ENVIRON.get()
        if environ is None:
            return init_settings, _SecretFiles(settings_cls, os.environ), env_settings
        return init_settings, _SecretFiles(settings_cls, environ), _MappingEnv(settings_cls, environ)

    @field_validator("artifact_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(Path(root) for root in value.split(os.pathsep) if root)
        return value

    @field_validator("metrics_host")
    @classmethod
    def _host(cls, value: str) -> str:
        value = value.strip()
        if not value or any(c.isspace() or not c.isprintable() for c in value):
            raise ValueError("not a host")
        return value

    @field_validator("temporal_metrics_address")
    @classmethod
    def _bind_address(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        text = value.strip()
        if text.lower() in _OFF:
            return "off"
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in text):
            raise ValueError("not host:port")
        return text

    @field_validator("temporal_http_address")
    @classmethod
    def _http_address(cls, value: str | None) -> str | None:
        return cls._bind_address(value)

    @field_validator("replay_check_s")
    @classmethod
    def _replay_check(cls, value: float) -> float:
        if not (value == 0 or 5 <= value <= 86400) or math.isnan(value):
            raise ValueError("out of range")
        return value

    @field_validator("delegation_sync_s")
    @classmethod
    def _delegation_sync(cls, value: float) -> float:
        if not (value == 0 or 0.1 <= value <= 10) or math.isnan(value):
            raise ValueError("out of range")
        return value

    @field_validator("worker_deployment")
    @classmethod
    def _deployment_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,100}", value.strip()):
            raise ValueError("not a deployment name")
        return value.strip()

    @field_validator("worker_build_id")
    @classmethod
    def _build_id(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if not re.fullmatch(r"[A-Za-z0-9_.+-]{1,200}", value.strip()):
            raise ValueError("not a build id")
        return value.strip()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of this process's environment (or of `environ`); a bad value is
        REQUEST_INVALID naming its variable, never a validation traceback."""
        token = _ENVIRON.set(environ)
        try:
            return cls()
        except ValidationError as error:
            raise _invalid(error) from None
        finally:
            _ENVIRON.reset(token)

    @classmethod
    def variables(cls) -> list[str]:
        """Every variable these settings read: MODELFORGE_<FIELD>, and MODELFORGE_<SECRET>_FILE."""
        return [env_var(name) for name in cls.model_fields] + [f"{env_var(name)}_FILE" for name in _SECRETS]

    def replace(self, **changes: Any) -> Settings:
        """A copy with `changes`, validated as the environment's values are (REQUEST_INVALID
        naming the setting); the environment is not read again."""
        try:
            return type(self).model_validate({**self.__dict__, **changes})
        except ValidationError as error:
            raise _invalid(error) from None

    def temporal_metrics_bind(self, role: str) -> str | None:
        """Where a worker of this role serves the Temporal SDK's metrics; None when off."""
        address = self.temporal_metrics_address or TEMPORAL_METRICS_DEFAULTS[role]
        return None if address == "off" else address

    def resolved_temporal_http_address(self) -> str | None:
        """The Temporal HTTP API's host:port: the configured one, or the gRPC port + 10 on the
        gRPC address's host (the Temporal server's convention, 7233 -> 7243); None when off."""
        if self.temporal_http_address is not None:
            return None if self.temporal_http_address == "off" else self.temporal_http_address
        host, _, port = self.temporal_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) + 10 < 65536:
            return None
        return f"{host}:{int(port) + 10}"

    def resolved_payload_dir(self) -> Path:
        return self.payload_dir or self.home / "payloads"

    def resolved_checkpoint_dir(self) -> Path:
        return self.checkpoint_dir or self.home / "checkpoints"

    def resolved_artifact_store(self) -> Path:
        return self.artifact_store or self.home / "artifacts" / "store"

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
