"""The CLI fast path's route cache (modelforge/_fastcli.py, "the route cache"), against a fake
Temporal HTTP API: a fresh entry starts the request on the remembered node queue without asking
for the pools or the pool's status; a stale, corrupt or other key's entry is not used (the pools
are asked); a failed request forgets its entry; the file is replaced whole. And the `modelforge`
script pyproject names answers a fast command without compiling modelforge/cli.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from modelforge import _fastcli as fast
from tests.unit.scripted_server import scripted_server

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["modelforge", "request", "x@1", "--tenant", "rag", "--input", '{"text": "hi"}', "--json"]
NODE_QUEUE = "modelforge-node-gpu-a"


def _answer(body: Any, status: str = "200 OK") -> bytes:
    data = json.dumps(body).encode()
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data


UNAVAILABLE = _answer({"message": "no"}, "503 Service Unavailable")
STARTED = _answer({"runId": "run-1", "started": True})


def _closed(route: str = "modelforge-node-gpu-b") -> bytes:
    result = {"request_id": "r", "capability": "x@1", "output": {"v": 1}, "lease": None, "timings": {}}
    result["route"] = route
    attributes = {"result": {"payloads": [fast.plain(result)]}}
    event = {"eventType": "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"}
    event["workflowExecutionCompletedEventAttributes"] = attributes
    return _answer({"history": {"events": [event]}})


def _failed() -> bytes:
    failure = {"message": "no room", "applicationFailureInfo": {"type": "CAPACITY_UNAVAILABLE"}}
    event = {"eventType": "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"}
    event["workflowExecutionFailedEventAttributes"] = {"failure": failure}
    return _answer({"history": {"events": [event]}})


def _environ(home: Path, port: int, **extra: str) -> dict[str, str]:
    return {"MODELFORGE_HOME": str(home), "MODELFORGE_TEMPORAL_HTTP_ADDRESS": f"127.0.0.1:{port}"} | extra


def _env_args(home: Path, port: int = 1, argv: list[str] = ARGV) -> tuple[fast.Environment, fast.RequestArgs]:
    return fast.Environment(_environ(home, port)), fast.RequestArgs(argv[2:])


def _cache(home: Path) -> Path:
    return home / "run" / fast.ROUTE_CACHE_FILE


def _remember(home: Path, queue: str = NODE_QUEUE, age_s: float = 1.0, argv: list[str] = ARGV) -> None:
    env, args = _env_args(home, argv=argv)
    fast.remember_route(env, args, ("default", queue), fast.time.time() - age_s)


def _started_on(request: bytes) -> str:
    assert request.startswith(b"POST /api/v1/namespaces/default/workflows/request:x@1:"), request[:120]
    queue: str = json.loads(request.partition(b"\r\n\r\n")[2])["taskQueue"]["name"]
    return queue


@pytest.fixture(autouse=True)
def _no_hand_over_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast, "_handed_over", None)


def test_a_fresh_route_starts_the_request_there_without_asking(tmp_path: Path, capsys: Any) -> None:
    _remember(tmp_path)
    port, seen = scripted_server([STARTED, _closed()])
    assert fast.run(list(ARGV), _environ(tmp_path, port)) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] is True and printed["output"] == {"v": 1} and "route" not in printed
    assert len(seen) == 2, "no visibility list, no status query: the start, then its close"
    assert _started_on(seen[0]) == NODE_QUEUE
    assert b"/history?" in seen[1].split(b"\r\n")[0]
    # The route the result named is kept, with the time the pools were asked (not renewed).
    env, args = _env_args(tmp_path, port)
    pool, queue, asked_at = fast.cached_route(env, args) or ("", "", 0.0)
    assert (pool, queue) == ("default", "modelforge-node-gpu-b")
    assert fast.time.time() - asked_at >= 1.0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [fast.ROUTE_CACHE_FILE], "no temporary left"


def _asks_for_the_pools(home: Path) -> bool:
    """Whether a request asks Temporal for the pools first (the server refuses: nothing starts)."""
    port, seen = scripted_server([UNAVAILABLE])
    argv = list(ARGV)
    assert fast.run(argv, _environ(home, port)) is None and argv == ARGV
    first = seen[0].split(b"\r\n")[0]
    return first.startswith(b"GET /api/v1/namespaces/default/workflows?") and b"PoolSchedulerWorkflow" in first


def test_without_an_entry_the_pools_are_asked(tmp_path: Path) -> None:
    assert _asks_for_the_pools(tmp_path)


def test_a_stale_entry_is_not_used(tmp_path: Path) -> None:
    _remember(tmp_path, age_s=fast.ROUTE_TTL_S + 1)
    assert _asks_for_the_pools(tmp_path)
    _remember(tmp_path, age_s=-60)  # "written" in the future: a clock stepped back
    assert _asks_for_the_pools(tmp_path)


def test_another_keys_entry_is_not_used(tmp_path: Path) -> None:
    _remember(tmp_path, argv=[*ARGV[:4], "lab", *ARGV[5:]])  # another tenant
    _remember(tmp_path, argv=[*ARGV, "--priority", "batch"])  # another class
    _remember(tmp_path, argv=["modelforge", "request", "y@1", *ARGV[3:]])  # another capability
    assert _asks_for_the_pools(tmp_path)
    env, args = _env_args(tmp_path)
    other = fast.Environment(_environ(tmp_path, 1, MODELFORGE_TEMPORAL_ADDRESS="elsewhere:7233"))
    fast.remember_route(other, args, ("default", NODE_QUEUE), fast.time.time())
    assert fast.cached_route(other, args) is not None and fast.cached_route(env, args) is None
    assert _asks_for_the_pools(tmp_path)


def _entry(**changed: Any) -> str:
    env, args = _env_args(Path("/unused"))
    entry = {"pool": "default", "queue": NODE_QUEUE, "at": fast.time.time()} | changed
    return json.dumps({"version": 1, "routes": {fast._route_key(env, args): entry}})


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"\xff\xfe garbage",
        b"[" * 100_000,  # deeper than json can load
        b"[]",
        b'{"version": 1, "routes": []}',
        _entry().replace('"version": 1', '"version": 2').encode(),  # another version's
        _entry(pool=7).encode(),
        _entry(pool="a/b c").encode(),
        _entry(queue="modelforge-control").encode(),  # only a node queue is remembered
        _entry(queue="modelforge-node-a\r\nX: y").encode(),
        _entry(at="now").encode(),
        _entry(at=True).encode(),
        _entry(at=None).encode(),
    ],
)
def test_a_corrupt_or_foreign_file_is_no_entry_never_a_traceback(tmp_path: Path, content: bytes) -> None:
    _cache(tmp_path).parent.mkdir()
    _cache(tmp_path).write_bytes(content)
    assert _asks_for_the_pools(tmp_path)
    env, args = _env_args(tmp_path)
    fast.remember_route(env, args, ("default", NODE_QUEUE), fast.time.time())  # replaces it, raises nothing
    assert fast.cached_route(env, args) is not None


def test_a_file_that_cannot_be_read_or_written_is_no_entry(tmp_path: Path) -> None:
    _cache(tmp_path).mkdir(parents=True)  # a directory where the file would be
    assert _asks_for_the_pools(tmp_path)
    env, args = _env_args(tmp_path)
    fast.remember_route(env, args, ("default", NODE_QUEUE), fast.time.time())  # cannot replace it: nothing raised
    assert fast.cached_route(env, args) is None
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [fast.ROUTE_CACHE_FILE]


def test_a_failed_request_forgets_its_route(tmp_path: Path, capsys: Any) -> None:
    _remember(tmp_path)
    port, seen = scripted_server([STARTED, _failed()])
    assert fast.run(list(ARGV), _environ(tmp_path, port)) == 1
    assert json.loads(capsys.readouterr().out)["failure_class"] == "CAPACITY_UNAVAILABLE"
    assert _started_on(seen[0]) == NODE_QUEUE
    env, args = _env_args(tmp_path, port)
    assert fast.cached_route(env, args) is None
    assert _asks_for_the_pools(tmp_path)


def test_a_request_handed_over_forgets_its_route(tmp_path: Path) -> None:
    _remember(tmp_path)
    port, seen = scripted_server([STARTED, UNAVAILABLE])  # started, then its history cannot be read
    argv = list(ARGV)
    assert fast.run(argv, _environ(tmp_path, port)) is None
    assert fast._handed_over is not None
    assert argv == [*ARGV, "--request-id", fast._handed_over.request_id], "the SDK path attaches to it"
    assert _started_on(seen[0]) == NODE_QUEUE
    env, args = _env_args(tmp_path, port)
    assert fast.cached_route(env, args) is None


class _LostOutput:
    """A stdout whose reader is gone (`modelforge request ... --json | true`)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_an_answer_that_cannot_be_written_is_not_asked_for_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    # The request ran: its lost output ends the command (Python's exit code for a failed last
    # flush), and nothing hands it to the normal path, which would submit it again.
    _remember(tmp_path)
    port, seen = scripted_server([STARTED, _closed()])
    argv = list(ARGV)
    monkeypatch.setattr(fast.sys, "stdout", _LostOutput())
    assert fast.run(argv, _environ(tmp_path, port)) == fast.OUTPUT_LOST
    assert argv == ARGV and fast._handed_over is None
    assert len(seen) == 2, "one start, one wait for its close"
    assert "could not be written" in capsys.readouterr().err


def test_a_start_answered_with_something_else_than_an_object_is_handed_over(tmp_path: Path) -> None:
    # Sent, so never sent again from here: the SDK path attaches to it by its request id.
    _remember(tmp_path)
    port, seen = scripted_server([_answer(["not", "an", "object"])])
    argv = list(ARGV)
    assert fast.run(argv, _environ(tmp_path, port)) is None
    assert fast._handed_over is not None
    assert argv == [*ARGV, "--request-id", fast._handed_over.request_id]
    assert len(seen) == 1 and _started_on(seen[0]) == NODE_QUEUE


def test_a_route_is_learned_from_a_result_after_asking(tmp_path: Path, capsys: Any) -> None:
    """No entry: the pools and the status are asked, and the result's route is kept."""
    status: dict[str, Any] = {"pool": "default", "now": 1.0, "accelerators": [], "residents": []}
    status |= {"queue_depth": {}, "active_leases": 0, "capabilities": [], "classes": []}
    listed = _answer({"executions": [{"execution": {"workflowId": "scheduler:default"}}]})
    queried = _answer({"queryResult": {"payloads": [fast.plain(status)]}})
    port, seen = scripted_server([listed, queried, STARTED, _closed()])
    assert fast.run(list(ARGV), _environ(tmp_path, port)) == 0
    capsys.readouterr()
    assert _started_on(seen[2]) == fast.CONTROL_TASK_QUEUE  # nothing ready: the control queue
    env, args = _env_args(tmp_path, port)
    assert (fast.cached_route(env, args) or ())[:2] == ("default", "modelforge-node-gpu-b")


def test_the_entry_point_tries_the_fast_path_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import modelforge.cli

    calls: list[Any] = []
    monkeypatch.setattr(fast, "_tried", False)
    monkeypatch.setattr(fast, "run", lambda argv, environ=None: calls.append("fast"))
    monkeypatch.setattr(modelforge.cli, "main", lambda: calls.append("full"))
    fast._answer_here()  # as on import by a script that names modelforge.cli:main
    fast.main()
    assert calls == ["fast", "full"]


def test_the_console_script_answers_without_compiling_the_cli(tmp_path: Path) -> None:
    """The script pip writes for pyproject's entry point: a fast answer never imports (and so
    never compiles) modelforge/cli.py, 1,200 lines."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["modelforge"].partition(":")
    script = tmp_path / "bin" / "modelforge"
    script.parent.mkdir()
    script.write_text(f"import re\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n")
    # Every import the process starts, on stderr (the fast path leaves by os._exit mid-import).
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.addaudithook(lambda event, args: event == 'import' and sys.stderr.write(f'import {args[0]}\\n'))\n"
    )
    _remember(tmp_path)
    port, _ = scripted_server([STARTED, _closed()])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")} | _environ(tmp_path, port)
    env["PYTHONPATH"] = str(hooks)
    done = subprocess.run([sys.executable, str(script), *ARGV[1:]], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["ok"] is True
    imported = {line.removeprefix("import ") for line in done.stderr.splitlines()}
    assert "modelforge._fastcli" in imported and "modelforge.identifiers" in imported, "the hook saw imports"
    assert "modelforge.cli" not in imported


def test_a_request_imports_only_what_it_needs() -> None:
    """Each of these costs a millisecond or more of a ~160 ms command (python -X importtime)."""
    slow = {"typing", "socket", "selectors", "base64", "struct", "uuid", "http", "email", "ssl", "pathlib"}
    code = (
        "import sys, json; before = set(sys.modules); import modelforge._fastcli as f; "
        "f.RequestArgs(['x@1', '--tenant', 'rag', '--priority', 'batch', '--json']); "
        "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert set(json.loads(done.stdout)) & slow == set()


def test_a_temporary_left_by_a_killed_writer_is_deleted_by_the_next(tmp_path: Path) -> None:
    """A CLI killed between writing the route cache's temporary and renaming it leaves the
    temporary; the next write deletes it once it is stale, never a younger one (another writer's)."""
    run = tmp_path / "run"
    run.mkdir()
    stale = run / f"{fast.ROUTE_CACHE_FILE}.4242.deadbeef.tmp"
    young = run / f"{fast.ROUTE_CACHE_FILE}.4343.cafef00d.tmp"
    unrelated = run / "other.tmp"
    for leftover in (stale, young, unrelated):
        leftover.write_text("{")
    old = fast.time.time() - 2 * fast._ROUTE_TEMPORARY_STALE_S
    os.utime(stale, (old, old))
    os.utime(unrelated, (old, old))
    env, args = _env_args(tmp_path)
    fast.remember_route(env, args, ("default", NODE_QUEUE), fast.time.time())
    assert sorted(p.name for p in run.iterdir()) == sorted([fast.ROUTE_CACHE_FILE, young.name, unrelated.name])
    assert fast.cached_route(env, args) is not None
