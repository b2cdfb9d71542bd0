"""The CLI's fast path: `modelforge status --json` and `modelforge request CAP ... --json` answered
from Temporal's HTTP API (its frontend's grpc-gateway JSON) with the standard library only, so a
short command does not pay for importing temporalio, typer, rich and pydantic (about 0.9 s; the
Temporal CLI's own `workflow describe` takes about 70 ms).

It prints exactly what the SDK path prints (tests/e2e/test_fast_cli.py compares them on one
stack), and it is taken only when that is certain: no TLS or API key, no setting it does not
read, the HTTP address configured (MODELFORGE_TEMPORAL_HTTP_ADDRESS) or recorded by `modelforge
dev` for this gRPC address, every payload `json/plain` (a payload the payload store or a codec
wrote is anything else), the options it knows. Anything else, any HTTP error, anything
unexpected: the normal path runs, as if this module did not exist. A request this path started
and then could not finish (its answer is in the payload store, a connection dropped, a close it
does not read) is handed over under its request id to a client that only attaches to that
workflow (`attaching_client`): never a second run.

Payloads are decoded as the SDK's JSON converter does (`value_to_type` for the dataclass the SDK
path names) by `_SCHEMAS`, a copy of those dataclasses' fields that tests/unit/test_fastcli.py
keeps equal to the real ones.
"""

from __future__ import annotations

# Only what a warm call needs, each measured (`python -X importtime`): `_socket` rather than
# `socket` (its enums and selectors), binascii rather than base64 (struct), no typing, pathlib
# or urllib.parse. Each is a millisecond or two of a command the target holds to ~160 ms (re is
# loaded anyway: the console script and modelforge.identifiers import it).
import _socket
import binascii
import json
import math
import os
import sys
import time

from modelforge.names import (
    CONTROL_TASK_QUEUE,
    DEFAULT_POOL,
    NODE_TASK_QUEUE_PREFIX,
    REQUEST_WORKFLOW_TYPE,
    RUNNING_SCHEDULERS,
    node_task_queue,
    pool_of_scheduler,
    request_workflow_id,
    scheduler_id,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy reads the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

HTTP_ADDRESS_FILE = "temporal_http_address"  # modelforge/dev.py writes it
# The routes this path learned (below, "The route cache"), in $MODELFORGE_HOME/run.
ROUTE_CACHE_FILE = "cli_routes.json"
# How long a learned route is used without asking: PoolRouter's pools are cached as long.
ROUTE_TTL_S = 30.0
_ROUTE_CACHE_ENTRIES = 64  # at most, the newest kept
# A writer killed between writing its temporary and renaming it leaves the temporary behind; the
# next writer deletes those older than this (a younger one may be another writer's, mid-write).
_ROUTE_TEMPORARY_STALE_S = 60.0
_PLAIN = "json/plain"
_OUTPUT_REF = "modelforge_output_ref"  # modelforge/payloads.py OUTPUT_REF
_LARGE_PAYLOAD_BYTES = 256 * 1024  # modelforge/payloads.py LARGE_PAYLOAD_BYTES
_MAX_ANSWER_BYTES = 64 * 1024 * 1024  # an HTTP answer this path reads whole
_RESERVED_INPUT_PREFIX = "modelforge_"  # modelforge/messages.py
# Settings this path reads; a setting that changes how the CLI connects and this path does not
# implement (TLS, an API key, a secret's *_FILE) sends the command the SDK way.
_READ = {
    "MODELFORGE_TEMPORAL_ADDRESS",
    "MODELFORGE_TEMPORAL_NAMESPACE",
    "MODELFORGE_TEMPORAL_HTTP_ADDRESS",
    "MODELFORGE_HOME",
    "MODELFORGE_POOLS",
    "MODELFORGE_GPU_BACKEND",
    "MODELFORGE_DATABASE_URL",
    "MODELFORGE_PAYLOAD_DIR",
    "MODELFORGE_PAYLOAD_THRESHOLD_BYTES",
    "MODELFORGE_MAX_PAYLOAD_BYTES",
}
# Settings only workers read (modelforge/settings.py): ignored here, as the SDK way ignores them,
# once they pass the check Settings would make of them (a value Settings refuses goes the SDK
# way, which names the variable). An operator exports these for the workers in the same shell.
_WORKER_ONLY: dict[str, Callable[[str], bool]] = {
    "MODELFORGE_METRICS_PORT": lambda v: v.strip().isascii() and v.strip().isdigit() and int(v) <= 65535,
    "MODELFORGE_METRICS_HOST": lambda v: True,
    "MODELFORGE_TEMPORAL_METRICS_ADDRESS": lambda v: True,
    "MODELFORGE_SNAPSHOT_RETENTION_DAYS": lambda v: _positive(v),
    "MODELFORGE_PAYLOAD_RETENTION_DAYS": lambda v: _positive(v),
    "MODELFORGE_ARTIFACT_ROOTS": lambda v: True,
    "MODELFORGE_CHECKPOINT_DIR": lambda v: True,
    "MODELFORGE_ARTIFACT_STORE": lambda v: True,
    "MODELFORGE_REPLAY_CHECK_S": lambda v: _number(v) is not None,
    "MODELFORGE_DELEGATION_SYNC_S": lambda v: _number(v) is not None,
}
# Variables outside Settings that the CLI never reads (the gateway's, a node's, a job's, the
# log level: `modelforge` commands log nothing at info): ignored by both ways.
_NOT_SETTINGS = (
    "MODELFORGE_GATEWAY_",
    "MODELFORGE_STREAM_KEY",
    "MODELFORGE_LOG_LEVEL",
    "MODELFORGE_NODE_ADDRESS",
    "MODELFORGE_RACK_ID",
    "MODELFORGE_NETWORK_BANDWIDTH_GBPS",
    "MODELFORGE_SIMULATED_INVOKE_LOG",
    "MODELFORGE_SECRET_",
    "MODELFORGE_SECRETS_DIR",
)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _positive(text: str) -> bool:
    value = _number(text)
    return value is not None and value > 0


def _ignored(name: str, value: str) -> bool:
    """Whether a MODELFORGE_* variable this path does not read may be left aside: a worker-only
    setting that Settings would take, or a variable the CLI never reads."""
    check = _WORKER_ONLY.get(name)
    if check is not None:
        return check(value)
    return name.startswith(_NOT_SETTINGS) and not name.endswith("_FILE")


_SAFE_ID = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:@-")

# The dataclasses the SDK path decodes into, field by field: "str", "int", "float", "bool",
# "any", ("opt", T), ("list", T), ("dict", T) (str keys), or another schema's name.
_SCHEMAS: dict[str, dict[str, Any]] = {
    "AcceleratorStatus": {
        "id": "str",
        "node": "str",
        "kind": "str",
        "model": "str",
        "production_eligible": "bool",
        "simulated": "bool",
        "total_bytes": "int",
        "observed_used_bytes": ("opt", "int"),
        "external_bytes": "int",
        "resident_bytes": "int",
        "leased_bytes": "int",
        "reserve_bytes": "int",
        "schedulable_bytes": "int",
        "pressure": "bool",
        "healthy": "bool",
        "fresh": "bool",
        "observation_age_s": ("opt", "float"),
        "observed_at": ("opt", "float"),
    },
    "ResidentStatus": {
        "deployment": "str",
        "capability": "str",
        "accelerator": "str",
        "bytes": "int",
        "state": "str",
        "residency": "str",
        "active_leases": "int",
        "last_used": "float",
        "ttl_s": "float",
        "expires_at": ("opt", "float"),
        "workflow_id": "str",
        "lent_slots": "int",
        "tenant_leases": ("dict", "int"),
    },
    "CapabilityStatus": {
        "capability": "str",
        "degraded": "bool",
        "consecutive_failures": "int",
        "last_failure": "str",
        "last_message": "str",
        "last_failure_at": "float",
    },
    "PoolStatus": {
        "pool": "str",
        "now": "float",
        "accelerators": ("list", "AcceleratorStatus"),
        "residents": ("list", "ResidentStatus"),
        "queue_depth": ("dict", "int"),
        "active_leases": "int",
        "capabilities": ("list", "CapabilityStatus"),
        "classes": ("list", "str"),
        "lent_slots": "int",
        "tenant_leases": ("dict", "int"),
        "tenant_queue_depth": ("dict", ("dict", "int")),
        "catalog_loading": "bool",
    },
    "Lease": {
        "lease_id": "str",
        "request_id": "str",
        "workflow_id": "str",
        "capability": "str",
        "deployment": "str",
        "accelerator": "str",
        "node": "str",
        "resident_key": "str",
        "bytes": "int",
        "granted_at": "float",
        "priority": "str",
        "tenant": "str",
        "heartbeat_s": "float",
        "gang": ("list", "str"),
        "nodes": ("list", "str"),
        "ends_by": ("opt", "float"),
        "incarnation": "int",
        "end_user": "str",
    },
    "RequestResult": {
        "request_id": "str",
        "capability": "str",
        "output": ("dict", "any"),
        "lease": ("opt", "Lease"),
        "timings": ("dict", "float"),
        "route": "str",
    },
}
# RequestInput's fields with what the CLI leaves at their defaults (tests check them).
REQUEST_INPUT_DEFAULTS: dict[str, Any] = {"max_duration_s": 600.0, "operation": "", "stream": None, "end_user": ""}


class Fallback(Exception):
    """This command goes the SDK way."""


def convert(hint: Any, value: Any) -> Any:
    """`value` (loaded JSON) as the SDK's `value_to_type(hint)` makes it and as
    `dataclasses.asdict` then shows it; Fallback where the SDK would fail or this cannot tell."""
    if hint == "any":
        return value
    if hint in ("int", "float"):
        if not isinstance(value, int | float):
            raise Fallback(f"not a number: {value!r}")
        return int(value) if hint == "int" else float(value)
    if hint == "bool":
        if not isinstance(value, bool):
            raise Fallback(f"not a bool: {value!r}")
        return value
    if hint == "str":
        if not isinstance(value, str):
            raise Fallback(f"not a str: {value!r}")
        return value
    if isinstance(hint, tuple):
        kind, inner = hint
        if kind == "opt":
            return None if value is None else convert(inner, value)
        if kind == "list" and isinstance(value, list):
            return [convert(inner, item) for item in value]
        if kind == "dict" and isinstance(value, dict):
            return {key: convert(inner, item) for key, item in value.items()}
        raise Fallback(f"not a {kind}: {type(value).__name__}")
    fields = _SCHEMAS[hint]
    if not isinstance(value, dict) or any(name not in value for name in fields):
        raise Fallback(f"not a whole {hint}")
    return {name: convert(field_hint, value[name]) for name, field_hint in fields.items()}


def _b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def _unb64(text: Any) -> bytes:
    """base64.b64decode(text, validate=True): binascii.Error (a ValueError) for anything else."""
    if not isinstance(text, str):
        raise Fallback("not base64 text")
    return binascii.a2b_base64(text.encode("ascii"), strict_mode=True)


_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


def _quote(text: str) -> str:
    """urllib.parse.quote(text, safe=""): every byte but the unreserved ones percent-encoded."""
    return "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in text.encode())


def plain(value: Any, **metadata: str) -> dict[str, Any]:
    """A `json/plain` payload in the HTTP API's JSON, as the SDK's converter encodes `value`."""
    data = json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    fields = {"encoding": _b64(_PLAIN.encode())} | {key: _b64(text.encode()) for key, text in metadata.items()}
    return {"metadata": fields, "data": _b64(data)}


def decoded(payloads: Any) -> Any:
    """The one `json/plain` payload of a `Payloads` message, loaded; Fallback for anything else
    (a reference to the payload store, a codec's encoding, binary/null, several)."""
    items = payloads.get("payloads") if isinstance(payloads, dict) else None
    if not isinstance(items, list) or len(items) != 1 or not isinstance(items[0], dict):
        raise Fallback("not one payload")
    metadata = items[0].get("metadata")
    if not isinstance(metadata, dict) or set(metadata) != {"encoding"}:
        raise Fallback("payload metadata other than encoding")
    if _unb64(metadata["encoding"]) != _PLAIN.encode():
        raise Fallback("payload encoding other than json/plain")
    return json.loads(_unb64(items[0].get("data", "")))


class Environment:
    """What the fast path needs from the environment; Fallback where it cannot be sure."""

    def __init__(self, environ: dict[str, str] | os._Environ[str]) -> None:
        def get(name: str) -> str | None:
            return environ.get(name) or None  # empty counts as unset, as in Settings

        unread = sorted(
            k for k, v in environ.items() if k.startswith("MODELFORGE_") and v and k not in _READ and not _ignored(k, v)
        )
        if unread:
            raise Fallback(f"settings this path does not read: {unread}")
        if get("MODELFORGE_GPU_BACKEND") not in (None, "auto", "nvml", "simulated"):
            raise Fallback("MODELFORGE_GPU_BACKEND")
        self.temporal_address = get("MODELFORGE_TEMPORAL_ADDRESS") or "localhost:7233"
        self.namespace = get("MODELFORGE_TEMPORAL_NAMESPACE") or "default"
        self.home = get("MODELFORGE_HOME") or os.path.join(os.path.expanduser("~"), ".modelforge")
        self.threshold = self._bytes(get("MODELFORGE_PAYLOAD_THRESHOLD_BYTES"), 2 * 1024)
        self._bytes(get("MODELFORGE_MAX_PAYLOAD_BYTES"), 64 * 1024 * 1024)
        pools = get("MODELFORGE_POOLS")
        self.pools = sorted({p.strip() for p in pools.split(",") if p.strip()}) if pools else []
        self.run_dir = os.path.join(self.home, "run")
        self.http_address = self._http_address(get("MODELFORGE_TEMPORAL_HTTP_ADDRESS"))

    @staticmethod
    def _bytes(text: str | None, default: int) -> int:
        if text is None:
            return default
        if not text.isascii() or not text.isdigit() or int(text) <= 0:
            raise Fallback("a byte size this path does not read")
        return int(text)

    def _http_address(self, configured: str | None) -> tuple[str, int]:
        if configured is None:
            try:
                with open(os.path.join(self.run_dir, HTTP_ADDRESS_FILE), encoding="utf-8") as file:
                    recorded = file.read().split()
            except OSError:
                raise Fallback("no HTTP address configured or recorded") from None
            if len(recorded) != 2 or recorded[0] != self.temporal_address:
                raise Fallback("the recorded HTTP address is another Temporal's")
            configured = recorded[1]
        host, sep, port = configured.strip().rpartition(":")
        if configured.strip().lower() in ("off", "none", "0") or not sep or not host or not port.isdigit():
            raise Fallback("no usable HTTP address")
        if not 0 < int(port) < 65536:
            raise Fallback("no usable HTTP address")
        return host.strip("[]"), int(port)


class Http:
    """One keep-alive HTTP/1.1 connection to Temporal's HTTP API; every answer but a 200 is
    Fallback. Written on a socket rather than `http.client`, whose import (the email parser and
    ssl) costs about 23 ms of a 150 ms command; Temporal's HTTP API answers plain HTTP/1.1 with a
    Content-Length or chunked body, which is all this reads (anything else is Fallback)."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.sock: _socket.socket | None = None
        self._buffer = b""

    def call(self, method: str, path: str, body: Any = None, timeout: float = 10.0, **query: str) -> Any:
        fields = {"noPayloadShorthand": "true", **query}
        url = f"/api/v1/namespaces/{_quote(self.env.namespace)}{path}?" + "&".join(
            f"{_quote(name)}={_quote(value)}" for name, value in fields.items()
        )
        data = b"" if body is None else json.dumps(body).encode()
        host, port = self.env.http_address
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        head = f"{method} {url} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: {len(data)}\r\n"
        if body is not None:
            head += "Content-Type: application/json\r\n"
        try:
            if self.sock is None:
                self.sock = _connect(host, port, timeout)
                self._buffer = b""
            self.sock.settimeout(timeout)
            self.sock.sendall(head.encode("ascii") + b"\r\n" + data)
            status, headers = self._head()
            text = self._body(headers)
            if headers.get("connection", "").lower() == "close":
                self.close()
        except (OSError, ValueError, UnicodeError) as error:
            self.close()
            raise Fallback(f"HTTP API: {error}") from None
        if status != 200:
            raise Fallback(f"HTTP API answered {status}: {text[:200]!r}")
        try:
            return json.loads(text)
        except ValueError:
            raise Fallback("HTTP API answered something other than JSON") from None

    def _until(self, marker: bytes) -> bytes:
        """The bytes up to `marker` (consumed with it)."""
        while marker not in self._buffer:
            self._more()
        line, _, self._buffer = self._buffer.partition(marker)
        return line

    def _exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            self._more()
        data, self._buffer = self._buffer[:count], self._buffer[count:]
        return data

    def _more(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ValueError("the connection closed mid-answer")
        self._buffer += chunk
        if len(self._buffer) > _MAX_ANSWER_BYTES:
            raise ValueError("an answer larger than this path reads")

    def _head(self) -> tuple[int, dict[str, str]]:
        lines = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"a malformed header: {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        return int(rest.partition(" ")[0]), headers

    def _body(self, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := _length(self._until(b"\r\n").partition(b";")[0].strip().decode("latin-1"), 16):
                parts.append(self._exactly(size))
                self._until(b"\r\n")
            while self._until(b"\r\n"):  # trailers, up to the empty line
                pass
            return b"".join(parts)
        if "content-length" in headers:
            return self._exactly(_length(headers["content-length"], 10))
        raise ValueError("an answer without a length")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _connect(host: str, port: int, timeout: float) -> _socket.socket:
    """socket.create_connection((host, port), timeout) on `_socket`: each address in turn."""
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in _socket.getaddrinfo(host, port, 0, _socket.SOCK_STREAM):
        sock = _socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            return sock
        except OSError as failed:
            sock.close()
            error = failed
    raise error


def _length(text: str, base: int) -> int:
    """A length as HTTP writes it (digits only: no sign, prefix or underscore), else ValueError."""
    digits = "0123456789abcdefABCDEF" if base == 16 else "0123456789"
    if not text or len(text) > 16 or any(c not in digits for c in text):
        raise ValueError(f"a malformed length: {text[:20]!r}")
    return int(text, base)


def _pools(api: Http, pool: str | None) -> list[str]:
    """As PoolRouter.pools: the bound pool, MODELFORGE_POOLS, or the running schedulers."""
    if pool is not None:
        return [pool]
    if api.env.pools:
        return api.env.pools
    listed = api.call("GET", "/workflows", query=RUNNING_SCHEDULERS)
    if listed.get("nextPageToken"):
        raise Fallback("more schedulers than one page")
    found = {pool_of_scheduler(e["execution"]["workflowId"]) for e in listed.get("executions") or []}
    return sorted({name.strip() for name in found if name and name.strip()}) or [DEFAULT_POOL]


def _pool_status(api: Http, pool: str) -> dict[str, Any]:
    workflow_id = scheduler_id(pool)
    if not set(workflow_id) <= _SAFE_ID:
        raise Fallback("a workflow id this path does not put in a URL")
    answer = api.call("POST", f"/workflows/{workflow_id}/query/status", {"query": {"queryType": "status"}})
    if answer.get("queryRejected"):
        raise Fallback("query rejected")
    status: dict[str, Any] = convert("PoolStatus", decoded(answer.get("queryResult")))
    return status


def _merged(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """policy.merge_statuses, as dataclasses.asdict shows it."""
    if len(statuses) == 1:
        return dict(statuses[0])
    depth: dict[str, int] = {}
    classes: list[str] = []
    for status in statuses:
        for name, count in status["queue_depth"].items():
            depth[name] = depth.get(name, 0) + count
        classes += [c for c in status["classes"] if c not in classes]
    return {
        "pool": ",".join(s["pool"] for s in statuses),
        "now": max((s["now"] for s in statuses), default=0.0),
        "accelerators": [a for s in statuses for a in s["accelerators"]],
        "residents": [r for s in statuses for r in s["residents"]],
        "queue_depth": depth,
        "active_leases": sum(s["active_leases"] for s in statuses),
        "capabilities": [c for s in statuses for c in s["capabilities"]],
        "classes": classes,
        "lent_slots": sum(s["lent_slots"] for s in statuses),
        "tenant_leases": _summed([s["tenant_leases"] for s in statuses]),
        "tenant_queue_depth": {
            tenant: _summed([s["tenant_queue_depth"].get(tenant, {}) for s in statuses])
            for tenant in dict.fromkeys(t for s in statuses for t in s["tenant_queue_depth"])
        },
        "catalog_loading": any(s["catalog_loading"] for s in statuses),
    }


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counts:
        for name, count in one.items():
            total[name] = total.get(name, 0) + count
    return total


def status_json(api: Http, pool: str | None) -> dict[str, Any]:
    """What `modelforge status --json` prints, when every pool's scheduler answers."""
    answered = [_pool_status(api, name) for name in _pools(api, pool)]
    merged = _merged(answered)
    merged["accelerators"] = [{**acc, "pool": s["pool"]} for s in answered for acc in s["accelerators"]]
    merged["residents"] = [{**r, "pool": s["pool"]} for s in answered for r in s["residents"]]
    merged["pools"] = [
        {
            "pool": s["pool"],
            "up": True,
            "catalog_loading": s["catalog_loading"],
            "queue_depth": s["queue_depth"],
            "active_leases": s["active_leases"],
        }
        for s in answered
    ]
    return merged


def _depth_and_items(value: Any, limit: int = 10_000) -> bool:
    """Whether `value` nests under 64 levels in fewer than `limit` items (client.input_shape_problem
    then finds nothing)."""
    stack = [(value, 0)]
    items = 0
    while stack:
        item, depth = stack.pop()
        items += 1
        if items > limit:
            return False
        children: Any = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth >= 63:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


class RequestArgs:
    """`request CAP [--input J] [--tenant T] [--priority P] [--deadline S] [--lease-timeout S] --json`:
    anything else (no --json, --queue, --request-id, --help, a repeated option) is Fallback."""

    _OPTIONS = {"--input": "input", "--tenant": "tenant", "--priority": "priority", "--deadline": "deadline"}
    _OPTIONS |= {"--lease-timeout": "lease_timeout"}

    def __init__(self, args: list[str]) -> None:
        values: dict[str, str] = {}
        positional: list[str] = []
        as_json = False
        rest = list(args)
        while rest:
            arg = rest.pop(0)
            name, eq, inline = arg.partition("=")
            if arg == "--json" and not as_json:
                as_json = True
            elif name in self._OPTIONS and self._OPTIONS[name] not in values and (eq or rest):
                values[self._OPTIONS[name]] = inline if eq else rest.pop(0)
            elif not arg.startswith("-") and not positional:
                positional.append(arg)
            else:
                raise Fallback(f"an argument this path does not take: {arg!r}")
        if not as_json or len(positional) != 1:
            raise Fallback("not `request CAP --json`")
        self.capability = positional[0]
        self.tenant = values.get("tenant", "default")
        self.priority = values.get("priority")
        self.deadline_s = self._seconds(values.get("deadline"))
        self.lease_timeout_s = self._seconds(values.get("lease_timeout"))
        try:
            self.input = json.loads(values.get("input", "{}"))
        except (ValueError, RecursionError):
            raise Fallback("--input is not JSON") from None
        from modelforge.identifiers import identifier_problem

        for kind, value in (("capability", self.capability), ("tenant", self.tenant)):
            if identifier_problem(kind, value) is not None:
                raise Fallback(f"a bad {kind}")
        if self.priority is not None and not _is_class(self.priority):
            raise Fallback("a priority the client refuses")
        if not isinstance(self.input, dict) or not _depth_and_items(self.input):
            raise Fallback("an input the client refuses")
        if any(key.startswith(_RESERVED_INPUT_PREFIX) for key in self.input):
            raise Fallback("reserved input keys")
        try:
            self.size = len(json.dumps(self.input, allow_nan=False).encode())
        except ValueError:
            raise Fallback("input is not JSON") from None

    @staticmethod
    def _seconds(text: str | None) -> float | None:
        if text is None:
            return None
        head, _, tail = text.partition(".")
        if not head.isascii() or not head.isdigit() or (tail and not (tail.isascii() and tail.isdigit())):
            raise Fallback("seconds this path does not read")
        value = float(text)
        from modelforge.identifiers import MAX_WAIT_S

        if not 0 < value <= MAX_WAIT_S:
            raise Fallback("seconds out of range")
        return value


def _is_class(text: str) -> bool:
    from modelforge.identifiers import PRIORITY_CLASS

    return PRIORITY_CLASS.fullmatch(text) is not None


class HandOver(Exception):
    """The request was sent: the SDK path attaches to it by `request_id` (never a second run)."""

    def __init__(self, request_id: str, began: float, why: str) -> None:
        super().__init__(why)
        self.request_id = request_id
        self.began = began


def _warm_queue(api: Http, pool: str, capability: str) -> str:
    """The task queue of a node where the capability is ready on a fresh card, else the control
    queue: started there, the request is admitted on that node from a slot its scheduler lent it
    (warm-path delegation), as a long-lived client's routed requests are. Only a hint: the
    workflow runs wherever it starts and admission decides (a node gone silent has its queue
    served by the control worker)."""
    try:
        status = _pool_status(api, pool)
    except Fallback:
        return CONTROL_TASK_QUEUE
    fresh = {a["id"]: a["node"] for a in status.get("accelerators", []) if a.get("fresh") and a.get("healthy")}
    for resident in status.get("residents", []):
        if resident.get("capability") == capability and resident.get("state") == "ready":
            node = fresh.get(resident.get("accelerator"))
            if node:
                return node_task_queue(node)
    return CONTROL_TASK_QUEUE


# --- the route cache -----------------------------------------------------------------------------
#
# A long-lived ModelForgeClient remembers, per pool and capability, the node queue its last
# result named (`_routes`) and its PoolRouter the pools for 30 s; a CLI process lives for one
# request, so this path keeps the same in a small file: for a key (this Temporal, namespace,
# MODELFORGE_POOLS, capability, tenant, priority), the pool and the node queue the last
# successful request's result named, for ROUTE_TTL_S. A fresh entry spares the two queries that
# find them (the visibility list of schedulers and the pool's status). Only a hint, as the
# client's: the request runs wherever it starts, and admission decides. Anything unreadable in
# the file (another version's, a torn or foreign file, a wrong type) is no entry; a failure of a
# request started from an entry forgets it.


def _route_key(env: Environment, args: RequestArgs) -> str:
    parts = [env.temporal_address, env.namespace, ",".join(env.pools), args.capability, args.tenant]
    return json.dumps([*parts, args.priority or ""])


def _read_routes(env: Environment) -> dict[str, Any]:
    """The cache's entries, as written; {} for anything else."""
    try:
        with open(os.path.join(env.run_dir, ROUTE_CACHE_FILE), encoding="utf-8") as file:
            data = json.loads(file.read(1024 * 1024))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("routes"), dict):
        return {}
    routes: dict[str, Any] = data["routes"]
    return routes


def _usable(entry: Any, now: float) -> tuple[str, str, float] | None:
    """(pool, node queue, when the pools were asked) of a well-formed entry whose pools were
    asked in the last ROUTE_TTL_S, else None."""
    if not isinstance(entry, dict):
        return None
    pool, queue, at = entry.get("pool"), entry.get("queue"), entry.get("at")
    if not isinstance(pool, str) or not pool.strip() or not set(scheduler_id(pool)) <= _SAFE_ID:
        return None
    if not isinstance(queue, str) or not queue.startswith(NODE_TASK_QUEUE_PREFIX) or not set(queue) <= _SAFE_ID:
        return None
    if isinstance(at, bool) or not isinstance(at, int | float) or not 0 <= now - at <= ROUTE_TTL_S:
        return None  # stale, or written "in the future" (a clock stepped back): ask
    return pool, queue, float(at)


def cached_route(env: Environment, args: RequestArgs, now: float | None = None) -> tuple[str, str, float] | None:
    """(pool, node queue, when the pools were asked) to start this request with, without asking,
    or None: ask."""
    return _usable(_read_routes(env).get(_route_key(env, args)), time.time() if now is None else now)


def remember_route(env: Environment, args: RequestArgs, route: tuple[str, str] | None, asked_at: float) -> None:
    """Keep (pool, node queue) for this key with the time its pools were asked (`asked_at`: a
    route learned from a cached one keeps that one's time, so the pools are asked again
    ROUTE_TTL_S after they were, however many requests succeed meanwhile), or forget the key
    (None). Never raises. The file is replaced whole (a temporary file renamed over it): a reader
    sees the old one or the new one."""
    try:
        now = time.time()
        key = _route_key(env, args)
        routes = _read_routes(env)
        if route is None and key not in routes:
            return
        kept = {k: v for k, v in routes.items() if k != key and _usable(v, now) is not None}
        if route is not None and _usable({"pool": route[0], "queue": route[1], "at": asked_at}, now):
            kept[key] = {"pool": route[0], "queue": route[1], "at": asked_at}
        newest = sorted(kept.items(), key=lambda item: item[1]["at"])[-_ROUTE_CACHE_ENTRIES:]
        os.makedirs(env.run_dir, exist_ok=True)
        path = os.path.join(env.run_dir, ROUTE_CACHE_FILE)
        _forget_stale_temporaries(env.run_dir, now)
        temporary = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                file.write(json.dumps({"version": 1, "routes": dict(newest)}))
            os.replace(temporary, path)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
    except Exception:  # a cache: not writing it only costs the next call two queries
        return


def _forget_stale_temporaries(run_dir: str, now: float) -> None:
    """Delete the route cache's temporaries (`cli_routes.json.<pid>.<hex>.tmp`) that no writer
    renamed within _ROUTE_TEMPORARY_STALE_S: left by one killed mid-write."""
    prefix = ROUTE_CACHE_FILE + "."
    with os.scandir(run_dir) as entries:
        for entry in entries:
            if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_mtime < now - _ROUTE_TEMPORARY_STALE_S:
                    os.unlink(entry.path)
            except OSError:  # gone already (another writer's sweep), or not ours to delete
                continue


def request_json(api: Http, args: RequestArgs, route: tuple[str, str] | None = None) -> dict[str, Any]:
    """What `modelforge request ... --json` prints, for a request this path can see through.
    `route`: the (pool, node queue) to start it with (from the cache); else both are asked for.
    The printed dict's "route" is the (pool, node queue) its result named, or None: it is
    removed before printing."""
    if route is not None:
        pools, task_queue = [route[0]], route[1]
    else:
        pools = _pools(api, None)
        if len(pools) != 1:
            raise Fallback("several pools: the route is the client's to choose")
        task_queue = _warm_queue(api, pools[0], args.capability)
    request_id = os.urandom(8).hex()  # as the client's: 16 hex digits (uuid, not imported: 4 ms)
    workflow_id = request_workflow_id(args.capability, request_id)
    if not set(workflow_id) <= _SAFE_ID:
        raise Fallback("a workflow id this path does not put in a URL")
    request = {
        "request_id": request_id,
        "capability": args.capability,
        "input": args.input,
        "priority": args.priority,
        "tenant": args.tenant,
        "deadline_s": args.deadline_s,
        "lease_timeout_s": args.lease_timeout_s,
        "pool": pools[0],
        # The input's size as the client measures it (`ModelForgeClient.request`): the record keeps it.
        "input_bytes": args.size,
        **REQUEST_INPUT_DEFAULTS,
    }
    payload = plain(request)
    # The payload store takes a request workflow's payloads from the threshold (a payload's size
    # counts its metadata too): those go the SDK way, which writes them there.
    if len(json.dumps(request, separators=(",", ":"), sort_keys=True).encode()) + 64 >= min(
        api.env.threshold, _LARGE_PAYLOAD_BYTES
    ):
        raise Fallback("a payload for the payload store")
    attributes = {"ModelForgeCapability": args.capability, "ModelForgeTenant": args.tenant}
    if args.priority:
        attributes["ModelForgePriority"] = args.priority
    start = {
        "workflowId": workflow_id,
        "workflowType": {"name": REQUEST_WORKFLOW_TYPE},
        "taskQueue": {"name": task_queue},
        "input": {"payloads": [payload]},
        "identity": f"{os.getpid()}@{_socket.gethostname()}",
        "requestId": os.urandom(16).hex(),
        "workflowIdReusePolicy": "WORKFLOW_ID_REUSE_POLICY_ALLOW_DUPLICATE_FAILED_ONLY",
        "workflowIdConflictPolicy": "WORKFLOW_ID_CONFLICT_POLICY_USE_EXISTING",
        "memo": {
            "fields": {
                "capability": plain(args.capability),
                "tenant": plain(args.tenant),
                "input_bytes": plain(args.size),
            }
        },
        "searchAttributes": {"indexedFields": {k: plain(v, type="Keyword") for k, v in attributes.items()}},
        "userMetadata": {"summary": plain(f"{args.capability} for {args.tenant}")},
    }
    began = time.time()
    try:
        started = api.call("POST", f"/workflows/{workflow_id}", start)
    except Fallback as error:  # it may have reached the server
        raise HandOver(request_id, began, str(error)) from None
    if not isinstance(started, dict):  # sent: whatever the answer, never sent again from here
        raise HandOver(request_id, began, "an answer to the start that is not an object")
    run_id = started.get("runId")
    if not started.get("started") or not isinstance(run_id, str) or not run_id:
        raise HandOver(request_id, began, "not a new run")
    try:
        result = _result(api, args, request_id, workflow_id, run_id)
    except Exception as error:  # the request was sent: whatever went wrong, the SDK path attaches to it
        raise HandOver(request_id, began, str(error)) from None
    named = result.pop("route", "")
    learned = (pools[0], named) if result["ok"] and named.startswith(NODE_TASK_QUEUE_PREFIX) else None
    return result | {"route": learned}


def _result(api: Http, args: RequestArgs, request_id: str, workflow_id: str, run_id: str) -> dict[str, Any]:
    token = ""
    while True:
        query = {
            "execution.runId": run_id,
            "waitNewEvent": "true",
            "historyEventFilterType": "HISTORY_EVENT_FILTER_TYPE_CLOSE_EVENT",
            "skipArchival": "true",
        }
        if token:
            query["nextPageToken"] = token
        page = api.call("GET", f"/workflows/{workflow_id}/history", timeout=90.0, **query)
        events = (page.get("history") or {}).get("events") or []
        if events:
            break
        token = page.get("nextPageToken") or ""
        if not token:
            raise Fallback("history ended without a close event")
    event = events[-1]
    kind = event.get("eventType")
    base: dict[str, Any] = {"request_id": request_id, "capability": args.capability, "workflow_id": workflow_id}
    base |= {"output": None, "failure_class": None, "message": "", "lease": None, "timings": {}}
    if kind == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED":
        attributes = event.get("workflowExecutionCompletedEventAttributes") or {}
        if attributes.get("newExecutionRunId"):
            raise Fallback("continued in another run")
        result = convert("RequestResult", decoded(attributes.get("result")))
        lease = result["lease"]
        if lease is not None and lease["tenant"] and lease["tenant"] != args.tenant:
            raise Fallback("another tenant's lease")
        if _OUTPUT_REF in result["output"]:
            raise Fallback("the answer is in the payload store")
        printed = {"ok": True, "output": result["output"], "lease": lease, "timings": result["timings"]}
        return base | printed | {"route": result["route"]}
    if kind == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED":
        attributes = event.get("workflowExecutionFailedEventAttributes") or {}
        failure = attributes.get("failure") or {}
        info = failure.get("applicationFailureInfo")
        if attributes.get("newExecutionRunId") or failure.get("encodedAttributes") or not isinstance(info, dict):
            raise Fallback("a failure this path does not read")
        failure_class, message = info.get("type"), failure.get("message", "")
        if not isinstance(failure_class, str) or not failure_class or not isinstance(message, str):
            raise Fallback("a failure without a class")
        return base | {"ok": False, "failure_class": failure_class, "message": message}
    raise Fallback(f"closed as {kind}")


# --- the entry -----------------------------------------------------------------------------------

_handed_over: HandOver | None = None


def attaching_client() -> Any:
    """The client class `modelforge request` uses: ModelForgeClient, or after a hand-over one
    whose start only attaches to the run this path started (REJECT_DUPLICATE with
    USE_EXISTING, as a retried start: a failed run is reported, never run again)."""
    from modelforge.client import ModelForgeClient

    handed = _handed_over
    if handed is None:
        return ModelForgeClient
    from datetime import UTC, datetime

    began = datetime.fromtimestamp(handed.began, UTC)

    class AttachingClient(ModelForgeClient):
        async def _start(self, *args: Any, **kwargs: Any) -> Any:
            kwargs.update(retrying=True, began=began)
            return await super()._start(*args, **kwargs)

    return AttachingClient


def _print(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _status_pool(args: list[str]) -> str | None:
    """The --pool of `status --json [--pool P]`; Fallback for any other arguments."""
    rest, pool, as_json = list(args), None, False
    while rest:
        arg = rest.pop(0)
        name, eq, inline = arg.partition("=")
        if arg == "--json" and not as_json:
            as_json = True
        elif name == "--pool" and pool is None and (eq or rest):
            pool = inline if eq else rest.pop(0)
        else:
            raise Fallback(f"an argument this path does not take: {arg!r}")
    if not as_json:
        raise Fallback("not --json")
    return pool


def run(argv: list[str], environ: dict[str, str] | os._Environ[str] | None = None) -> int | None:
    """The exit code of `argv` (the whole command line, sys.argv) answered here, or None: the
    normal path runs (after a hand-over, with the sent request's `--request-id` appended)."""
    global _handed_over
    command, rest = (argv[1], argv[2:]) if len(argv) > 1 else ("", [])
    if command not in ("status", "request"):
        return None
    try:
        env = Environment(os.environ if environ is None else environ)
        if command == "status":
            pool = _status_pool(rest)
            api = Http(env)
            try:
                value = status_json(api, pool)
            finally:
                api.close()
            _print(value)
            return 0
        args = RequestArgs(rest)
        cached = cached_route(env, args)
        asked_at = time.time() if cached is None else cached[2]
        api = Http(env)
        try:
            result = request_json(api, args, None if cached is None else cached[:2])
        except HandOver:  # sent, and not seen through: the next one asks afresh
            remember_route(env, args, None, asked_at)
            raise
        finally:
            api.close()
        # Answered: from here on nothing hands the command to the normal path, which would
        # submit the request again under a new id.
        return _answered(env, args, result, asked_at)
    except HandOver as handed:
        _handed_over = handed
        argv += ["--request-id", handed.request_id]
        return None
    except Exception:  # anything at all: the normal path answers
        return None


# The exit code when an answered request's output cannot be written (a closed pipe, a full
# disk): Python's own when its last flush fails.
OUTPUT_LOST = 120


def _answered(env: Environment, args: RequestArgs, result: dict[str, Any], asked_at: float) -> int:
    """Print a request's answer and remember its route; the exit code, whatever fails here."""
    learned = result.pop("route", None)
    code = 0 if result.get("ok") else 1
    try:
        _print(result)
        sys.stdout.flush()
    except Exception as error:  # the request ran; its answer is lost, never asked again
        code = OUTPUT_LOST
        try:
            sys.stderr.write(f"modelforge: the answer could not be written: {error}\n")
        except Exception:
            pass
    try:
        remember_route(env, args, learned, asked_at)  # a failure (learned None) forgets it
    except Exception:
        pass  # only the next call's speed
    return code


_tried = False


def _answer_here() -> None:
    """Once per process: the fast path answers sys.argv and the process exits, or it returns
    and the full CLI runs (with `--request-id` appended after a hand-over)."""
    global _tried
    if _tried:
        return
    _tried = True
    code = run(sys.argv)
    if code is not None:
        try:
            sys.stdout.flush()
        except Exception:
            code = code or OUTPUT_LOST
        os._exit(code)


def main() -> None:
    """The `modelforge` script (pyproject's entry point) and `python -m modelforge`: the fast
    path, else the full CLI. modelforge/cli.py is imported only then: without its bytecode
    (PYTHONDONTWRITEBYTECODE=1, a source tree that cannot be written) compiling its 1,200 lines
    takes longer than everything this path imports."""
    _answer_here()
    from modelforge.cli import main as full

    full()


def _from_console_script() -> None:
    """A `modelforge` script installed before the entry point moved here imports modelforge.cli
    to call its main(): when this module is imported by that, the fast path answers before the
    rest is imported."""
    script = sys.modules.get("__main__")
    path = getattr(script, "__file__", None) or ""
    if getattr(script, "__spec__", None) is None and os.path.basename(path) in ("modelforge", "modelforge-script.py"):
        _answer_here()


# Imported by modelforge/cli.py ahead of everything else: see _from_console_script.
_from_console_script()
