"""The CLI's fast path (modelforge/_fastcli.py) without a stack: its copy of the dataclasses the SDK
path decodes is the real one, it decodes and encodes payloads as the SDK's JSON converter does,
it imports none of the heavy libraries, and every case it cannot be sure of goes the SDK way.
tests/e2e/test_fast_cli.py compares both paths' output on a running stack."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from temporalio.converter import value_to_type

from modelforge import _fastcli as fast
from modelforge.messages import RequestInput, RequestResult
from modelforge.payloads import PayloadConverter
from modelforge.policy import PoolStatus
from tests.unit.scripted_server import scripted_server
from tests.worker_process import free_port

_ATOMS = {str: "str", int: "int", float: "float", bool: "bool", Any: "any"}


def _hint(hint: Any) -> Any:
    """A real type hint in the fast path's schema notation."""
    if hint in _ATOMS:
        return _ATOMS[hint]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint.__name__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return ("opt", _hint(next(a for a in args if a is not type(None))))
    if origin is list:
        return ("list", _hint(args[0]))
    if origin is dict and args[0] is str:
        return ("dict", _hint(args[1]))
    raise AssertionError(f"a hint the fast path does not read: {hint!r}")


def _schemas(cls: type, found: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    hints = typing.get_type_hints(cls)
    found[cls.__name__] = {f.name: _hint(hints[f.name]) for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        assert f.init, f"{cls.__name__}.{f.name}: init=False fields are not read by the fast path"
        for inner in [hints[f.name], *typing.get_args(hints[f.name])]:
            for nested in [inner, *typing.get_args(inner)]:
                if isinstance(nested, type) and dataclasses.is_dataclass(nested) and nested.__name__ not in found:
                    _schemas(nested, found)
    return found


def test_the_schemas_are_the_real_dataclasses() -> None:
    """A field added to PoolStatus, Lease or RequestResult must be added to _fastcli._SCHEMAS."""
    real = _schemas(PoolStatus, {}) | _schemas(RequestResult, {})
    assert real == fast._SCHEMAS


def test_the_request_input_is_the_sdk_paths_bytes() -> None:
    """The workflow input the fast path sends is byte for byte what the SDK path sends."""
    fields = {f.name for f in dataclasses.fields(RequestInput)}
    sent = {
        "request_id",
        "capability",
        "input",
        "priority",
        "tenant",
        "deadline_s",
        "lease_timeout_s",
        "pool",
        "input_bytes",
    }
    assert fields == sent | set(fast.REQUEST_INPUT_DEFAULTS)
    defaults = {f.name: f.default for f in dataclasses.fields(RequestInput) if f.name in fast.REQUEST_INPUT_DEFAULTS}
    assert defaults == fast.REQUEST_INPUT_DEFAULTS
    cases: list[dict[str, Any]] = [
        {"input": {"text": "hé \u2028", "n": [1, 2.5, None, True]}, "priority": None, "deadline_s": None},
        {"input": {}, "priority": "merge.critical", "deadline_s": 30.0, "lease_timeout_s": 5.5},
    ]
    for values in cases:
        request: dict[str, Any] = {
            "request_id": "ab12",
            "capability": "rag.embedding@1",
            "tenant": "rag",
            "pool": "default",
        }
        request |= {"lease_timeout_s": None} | values
        request["input_bytes"] = len(json.dumps(request["input"]).encode())
        sdk = PayloadConverter().to_payloads([RequestInput(**request)])[0]
        ours = fast.plain(request | fast.REQUEST_INPUT_DEFAULTS)
        assert base64.b64decode(ours["data"]) == sdk.data
        assert {k: base64.b64decode(v) for k, v in ours["metadata"].items()} == dict(sdk.metadata)


def _sdk_asdict(cls: type, value: Any) -> Any:
    return dataclasses.asdict(value_to_type(cls, value))


def test_decoding_is_the_sdk_converters() -> None:
    """Ints in float fields become floats, floats in int fields ints, None stays None, unknown
    keys are dropped: as value_to_type and dataclasses.asdict leave them."""
    accelerator = {
        "id": "gpu-node/0",
        "node": "gpu-node",
        "kind": "gpu",
        "model": "m",
        "production_eligible": True,
        "simulated": False,
        "total_bytes": 25769803776.0,
        "observed_used_bytes": None,
        "external_bytes": 0,
        "resident_bytes": 1,
        "leased_bytes": 2,
        "reserve_bytes": 3,
        "schedulable_bytes": 4,
        "pressure": False,
        "healthy": True,
        "fresh": True,
        "observation_age_s": 1,
        "observed_at": None,
        "unknown_new_key": 7,
    }
    status = {
        "pool": "default",
        "now": 5,
        "accelerators": [accelerator],
        "residents": [],
        "queue_depth": {"production": 1.0},
        "active_leases": 0,
        "capabilities": [],
        "classes": ["production"],
        "lent_slots": 2,
        "tenant_leases": {"rag": 1.0},
        "tenant_queue_depth": {"rag": {"production": 1.0}},
        "catalog_loading": True,
    }
    assert fast.convert("PoolStatus", status) == _sdk_asdict(PoolStatus, status)
    # A scheduler of a build before a field was added answers without it: the SDK path reads it
    # (with the field's default), the fast path does not guess.
    with pytest.raises(fast.Fallback, match="not a whole PoolStatus"):
        fast.convert("PoolStatus", {k: v for k, v in status.items() if k != "catalog_loading"})
    lease = {
        "lease_id": "a.1",
        "request_id": "a",
        "workflow_id": "request:x@1:a",
        "capability": "x@1",
        "deployment": "x@1",
        "accelerator": "gpu-node/0",
        "node": "gpu-node",
        "resident_key": "k",
        "bytes": 0,
        "granted_at": 1,
        "priority": "production",
        "tenant": "rag",
        "heartbeat_s": 20,
        "gang": [],
        "nodes": ["gpu-node"],
        "ends_by": None,
        "incarnation": 2,
        "end_user": "",
    }
    result = {"request_id": "a", "capability": "x@1", "output": {"v": [1, 2]}, "lease": lease, "timings": {"t": 1}}
    result |= {"route": ""}
    assert fast.convert("RequestResult", result) == _sdk_asdict(RequestResult, result)
    assert fast.convert("RequestResult", result | {"lease": None}) == _sdk_asdict(
        RequestResult, result | {"lease": None}
    )
    for bad in ({**status, "now": "5"}, {**status, "accelerators": [{**accelerator, "fresh": 1}]}):
        with pytest.raises(fast.Fallback):
            fast.convert("PoolStatus", bad)
    with pytest.raises(fast.Fallback):  # a field missing: the SDK path decides
        fast.convert("PoolStatus", {k: v for k, v in status.items() if k != "classes"})


def test_only_plain_json_payloads_are_read() -> None:
    def payloads(**metadata: bytes) -> dict[str, Any]:
        meta = {k: base64.b64encode(v).decode() for k, v in metadata.items()}
        return {"payloads": [{"metadata": meta, "data": base64.b64encode(b'{"a": 1}').decode()}]}

    assert fast.decoded(payloads(encoding=b"json/plain")) == {"a": 1}
    others: list[Any] = [
        payloads(encoding=b"json/external-storage-reference"),
        payloads(encoding=b"binary/encrypted"),
        payloads(encoding=b"json/plain", encrypted=b"true"),
        {"payloads": []},
        None,
    ]
    for other in others:
        with pytest.raises(fast.Fallback):
            fast.decoded(other)


def _environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"MODELFORGE_HOME": str(tmp_path), "MODELFORGE_TEMPORAL_HTTP_ADDRESS": f"127.0.0.1:{free_port()}"} | extra


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--json"],
        ["status", "--pool", "default", "--json"],
        ["request", "rag.embedding@1", "--input", '{"text": "hi"}', "--json"],
    ],
)
def test_an_unreachable_http_api_falls_back(tmp_path: Path, argv: list[str]) -> None:
    whole = ["modelforge", *argv]
    assert fast.run(whole, _environ(tmp_path)) is None
    assert whole == ["modelforge", *argv]  # nothing was sent: the SDK path runs the command as given


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["status"], {}),  # the table: rich's
        (["status", "--json", "--json"], {}),
        (["status", "--json", "--help"], {}),
        (["ps", "--json"], {}),
        (["request", "rag.embedding@1"], {}),  # not --json
        (["request", "rag.embedding@1", "--json", "--request-id", "r1"], {}),
        (["request", "rag.embedding@1", "--json", "--queue", "merge", "--priority", "critical"], {}),
        (["request", "rag.embedding@1", "--json", "--input", "{bad"], {}),
        (["request", "rag.embedding@1", "--json", "--input", '{"modelforge_resume": 1}'], {}),
        (["request", "rag.embedding@1", "--json", "--deadline", "1e3"], {}),
        (["request", "bad capability", "--json"], {}),
        (["status", "--json"], {"MODELFORGE_TEMPORAL_TLS": "1"}),
        (["status", "--json"], {"MODELFORGE_TEMPORAL_API_KEY": "k"}),
        (["status", "--json"], {"MODELFORGE_TEMPORAL_API_KEY_FILE": "/k"}),
        (["status", "--json"], {"MODELFORGE_METRICS_PORT": "x"}),  # Settings refuses it: the SDK way names it
        (["status", "--json"], {"MODELFORGE_DELEGATION_SYNC_S": "often"}),
        (["status", "--json"], {"MODELFORGE_SECRET_HF_TOKEN_FILE": "/k"}),
        (["status", "--json"], {"MODELFORGE_SOMETHING_NEW": "1"}),
        (["status", "--json"], {"MODELFORGE_TEMPORAL_HTTP_ADDRESS": "off"}),
    ],
)
def test_what_it_cannot_be_sure_of_goes_the_sdk_way(tmp_path: Path, argv: list[str], extra: dict[str, str]) -> None:
    # A reachable address would make no difference: each is refused before anything is sent.
    assert fast.run(["modelforge", *argv], _environ(tmp_path, **extra)) is None


def test_request_args() -> None:
    args = fast.RequestArgs(
        ["x@1", '--input={"a": 1}', "--tenant", "rag", "--priority", "interactive", "--deadline", "30", "--json"]
    )
    assert (args.capability, args.input, args.tenant, args.priority, args.deadline_s) == (
        "x@1",
        {"a": 1},
        "rag",
        "interactive",
        30.0,
    )
    assert args.size == len(json.dumps({"a": 1}).encode())


def test_the_http_address_is_configured_or_recorded_for_this_temporal(tmp_path: Path) -> None:
    with pytest.raises(fast.Fallback):
        fast.Environment({"MODELFORGE_HOME": str(tmp_path)})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / fast.HTTP_ADDRESS_FILE).write_text("127.0.0.1:17233 127.0.0.1:17243\n")
    with pytest.raises(fast.Fallback):  # recorded for another Temporal
        fast.Environment({"MODELFORGE_HOME": str(tmp_path)})
    env = fast.Environment({"MODELFORGE_HOME": str(tmp_path), "MODELFORGE_TEMPORAL_ADDRESS": "127.0.0.1:17233"})
    assert env.http_address == ("127.0.0.1", 17243)
    env = fast.Environment({"MODELFORGE_HOME": str(tmp_path), "MODELFORGE_TEMPORAL_HTTP_ADDRESS": "h:1"})
    assert env.http_address == ("h", 1)


def test_it_imports_nothing_heavy() -> None:
    heavy = {"temporalio", "typer", "rich", "pydantic", "pydantic_settings", "structlog", "click"}
    code = (
        "import sys, json; import modelforge._fastcli as f; "
        "f.RequestArgs(['x@1', '--json']); "
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(heavy)!r}))))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(done.stdout) == []


def _http(port: int) -> fast.Http:
    env = types.SimpleNamespace(namespace="default", http_address=("127.0.0.1", port))
    return fast.Http(env)  # type: ignore[arg-type]


def test_the_http_client_reads_length_and_chunked_answers_on_one_connection() -> None:
    port, seen = scripted_server(
        [
            b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n{"a": 1}',
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'4\r\n{"b"\r\n3;x=y\r\n: 2\r\n1\r\n}\r\n0\r\nTrailer: t\r\n\r\n',
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        ]
    )
    api = _http(port)
    assert api.call("POST", "/workflows/w", {"x": "é"}) == {"a": 1}
    assert api.call("GET", "/workflows", query="q") == {"b": 2}
    with pytest.raises(fast.Fallback, match="404"):
        api.call("GET", "/missing")
    assert api.sock is None, "closed as the server said"
    first = seen[0].decode()
    assert first.startswith("POST /api/v1/namespaces/default/workflows/w?noPayloadShorthand=true HTTP/1.1\r\n")
    assert json.loads(first.partition("\r\n\r\n")[2]) == {"x": "é"}
    assert "Content-Type: application/json" in first and "Content-Type" not in seen[1].decode()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",  # closed before the body ends
        b"HTTP/1.1 200 OK\r\n\r\n{}",  # no length
        b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",  # not JSON
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n{}",  # a length int() would take
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n",
    ],
)
def test_an_answer_the_http_client_cannot_read_is_fallback_never_a_traceback(answer: bytes) -> None:
    port, _ = scripted_server([answer])
    api = _http(port)
    try:
        with pytest.raises(fast.Fallback):
            api.call("GET", "/x", timeout=5)
    finally:
        api.close()


def test_worker_settings_exported_in_the_shell_keep_the_fast_path(tmp_path: Path) -> None:
    """An operator exports the workers' settings in the shell it runs `modelforge` from: valid
    worker-only values and the gateway's variables are left aside (the SDK way ignores them
    too), so `modelforge status --json` stays on this path (1.6-2.0 s the SDK way, not 0.17 s)."""
    exported = {
        "MODELFORGE_METRICS_PORT": "9464",
        "MODELFORGE_METRICS_HOST": "0.0.0.0",
        "MODELFORGE_DELEGATION_SYNC_S": "2",
        "MODELFORGE_SNAPSHOT_RETENTION_DAYS": "14",
        "MODELFORGE_CHECKPOINT_DIR": "/var/lib/modelforge/checkpoints",
        "MODELFORGE_LOG_LEVEL": "debug",
        "MODELFORGE_GATEWAY_OPERATORS": "ops",
        "MODELFORGE_STREAM_KEY": "k" * 32,
    }
    env = fast.Environment(_environ(tmp_path, **exported))
    assert env.temporal_address == "localhost:7233"
    for name, refused in (("MODELFORGE_METRICS_PORT", "70000"), ("MODELFORGE_SNAPSHOT_RETENTION_DAYS", "-1")):
        with pytest.raises(fast.Fallback):
            fast.Environment(_environ(tmp_path, **{**exported, name: refused}))
