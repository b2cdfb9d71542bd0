"""A new user's first hour with the CLI: what they see, checked without a running stack (the
stack's clients and stores replaced by recorders)."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console
from temporalio.service import RPCError, RPCStatusCode
from typer.testing import CliRunner

import modelforge
from modelforge import cli
from modelforge.catalog import example_catalog_path
from modelforge.client import Result
from modelforge.names import telemetry_id
from modelforge.policy import AcceleratorStatus, PoolStatus, ResidentStatus

GiB = 1024**3
runner = CliRunner()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env["MODELFORGE_HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


def _accelerator(
    acc_id: str,
    node: str,
    *,
    observed_at: float | None = 1000.0,
    simulated: bool = True,
    production_eligible: bool = True,
    fresh: bool = True,
    pressure: bool = False,
    healthy: bool = True,
) -> AcceleratorStatus:
    return AcceleratorStatus(
        id=acc_id,
        node=node,
        kind="gpu",
        model="Simulated L4 24GB",
        production_eligible=production_eligible,
        simulated=simulated,
        total_bytes=24 * GiB,
        observed_used_bytes=None if observed_at is None else 7 * GiB + 1216348160,
        external_bytes=6 * GiB,
        resident_bytes=1216348160,
        leased_bytes=512 * 1024**2,
        reserve_bytes=GiB,
        schedulable_bytes=24 * GiB - 6 * GiB - 1216348160 - 512 * 1024**2 - GiB,
        pressure=pressure,
        healthy=healthy,
        fresh=fresh,
        observation_age_s=None if observed_at is None else 3.0,
        observed_at=observed_at,
    )


def _pool() -> PoolStatus:
    return PoolStatus(
        pool="default",
        now=1003.0,
        accelerators=[
            _accelerator("gpu-node/0", "gpu-node"),
            _accelerator("desktop/0", "desktop", production_eligible=False, fresh=False, pressure=True, healthy=False),
            _accelerator("emep-node/0", "emep-node", observed_at=None, fresh=False),
        ],
        residents=[
            ResidentStatus(
                deployment="rag.embedding@1",
                capability="rag.embedding@1",
                accelerator="gpu-node/0",
                bytes=1216348160,
                state="unloading",
                residency="load_on_demand",
                active_leases=12,
                last_used=1000.0,
                ttl_s=900.0,
                expires_at=None,
                workflow_id="resident:rag.embedding@1:gpu-node/0:1",
            )
        ],
        queue_depth={"production": 2, "background": 1},
        active_leases=1,
        classes=["production", "interactive", "background"],
    )


def _rendered(render: Any, *args: Any) -> list[str]:
    console = Console(width=100, file=io.StringIO(), record=True, color_system=None)
    render(*args, console)
    return console.export_text().splitlines()


# --- 1. --version and shell completion ---------------------------------------------------------


def test_version_prints_the_installed_package_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "modelforge", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"modelforge {version('modelforge')}"


def test_shell_completion_is_offered() -> None:
    done = runner.invoke(cli.app, ["--help"], env={"COLUMNS": "120"})
    assert done.exit_code == 0
    assert "--install-completion" in done.output and "--show-completion" in done.output


# --- 2. square brackets survive ------------------------------------------------------------------


def test_request_help_keeps_square_brackets() -> None:
    done = runner.invoke(cli.app, ["request", "--help"], env={"COLUMNS": "200"})
    assert done.exit_code == 0
    assert "(catalogs with [[queues]])" in done.output


@dataclass
class FakeClient:
    result: Result | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    async def status(self) -> PoolStatus:
        return _pool()

    async def statuses(self) -> dict[str, PoolStatus]:
        return {"default": _pool()}

    async def request(self, capability: str, payload: dict[str, Any], **kwargs: Any) -> Result:
        self.calls.append({"capability": capability, "input": payload, **kwargs})
        assert self.result is not None
        return self.result


def _fake_connect(monkeypatch: pytest.MonkeyPatch, client: FakeClient) -> None:
    from modelforge.client import ModelForgeClient

    async def connect(cls: Any, *args: Any, **kwargs: Any) -> FakeClient:
        return client

    monkeypatch.setattr(ModelForgeClient, "connect", classmethod(connect))


def test_a_failure_message_with_brackets_prints_whole(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hint = "sentence-transformers is not installed: pip install 'modelforge[embedding]'"
    client = FakeClient(Result(ok=False, request_id="r", capability="x@1", failure_class="LOAD_FAILED", message=hint))
    _fake_connect(monkeypatch, client)
    done = runner.invoke(cli.app, ["request", "x@1"], env={**_env(tmp_path), "COLUMNS": "200"})
    assert done.exit_code == 1
    assert hint in done.stderr


# --- 3. status and ps fit 100 columns --------------------------------------------------------------


def test_status_fits_100_columns_with_whole_headers_and_values() -> None:
    lines = _rendered(cli.render_status, _pool())
    assert max(len(line.rstrip()) for line in lines) <= 100
    header = next(line for line in lines if "accelerator" in line)
    for column in ("accelerator", "total", "used", "external", "resident", "leased", "reserve", "schedulable", "state"):
        assert f" {column} " in f" {header} ", header  # whole words, none cut or wrapped
    text = "\n".join(lines)
    for value in ("gpu-node/0", "desktop/0", "(simulated)", "(not production)", "24G", "6G", "1.13G", "512M"):
        assert value in text, value
    for flag in ("STALE 3s", "PRESSURE", "UNHEALTHY", "NEVER SEEN"):
        assert flag in text, flag
    assert "queue: production 2, background 1; active leases: 1" in text


def test_status_piped_keeps_whole_headers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Piped without COLUMNS rich assumes 80 columns; `status` renders at the 100 it fits."""
    _fake_connect(monkeypatch, FakeClient())
    env: dict[str, str | None] = {**_env(tmp_path), "COLUMNS": None}
    done = runner.invoke(cli.app, ["status"], env=env)
    assert done.exit_code == 0, done.output
    header = next(line for line in done.stdout.splitlines() if "accelerator" in line)
    assert "…" not in done.stdout and " schedulable " in header and " reserve " in header


def test_status_says_which_nodes_never_reported() -> None:
    text = " ".join(" ".join(_rendered(cli.render_status, _pool())).split())
    assert "never reported: node emep-node" in text
    assert "node gpu-node" not in text and "node desktop" not in text


def test_status_says_when_the_scheduler_is_still_loading_its_catalog() -> None:
    assert "catalog loading" not in " ".join(_rendered(cli.render_status, _pool()))
    lines = _rendered(cli.render_status, replace(_pool(), catalog_loading=True))
    assert max(len(line.rstrip()) for line in lines) <= 100
    text = " ".join(" ".join(lines).split())
    assert "catalog loading: the scheduler is loading its catalog" in text
    assert "SCHEDULER_STATE_STALE (retryable)" in text


def test_ps_fits_100_columns_with_whole_headers_and_values() -> None:
    rows = [
        {
            "deployment": "rag.embedding@1",
            "accelerator": "gpu-node/0",
            "bytes": 1216348160,
            "state": "unloading",
            "residency": "load_on_demand",
            "active_leases": 12,
            "ttl_left_s": 899.4,
        }
    ]
    lines = _rendered(cli.render_ps, rows)
    assert max(len(line.rstrip()) for line in lines) <= 100
    header = next(line for line in lines if "deployment" in line)
    for column in ("deployment", "accelerator", "bytes", "state", "residency", "leases", "ttl left"):
        assert column in header
    row = next(line for line in lines if "rag.embedding@1" in line)
    for value in ("gpu-node/0", "1.13G", "unloading", "load_on_demand", "12", "899s"):
        assert value in row


# --- 4. the demo prints what it sends; a chat answer reads as one -------------------------------------


def test_demo_commands_send_exactly_what_the_demo_sent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from modelforge.demo import DEMO_REQUESTS, command_line

    client = FakeClient(Result(ok=True, request_id="r", capability="x", output={"ok": 1}))
    _fake_connect(monkeypatch, client)
    for _title, capability, payload, tenant, priority in DEMO_REQUESTS:
        printed = command_line(capability, payload, tenant, priority)
        argv = shlex.split(printed)
        assert argv[:2] == ["modelforge", "request"]
        done = runner.invoke(cli.app, argv[1:], env=_env(tmp_path))
        assert done.exit_code == 0, done.output
        sent = client.calls.pop()
        assert (sent["capability"], sent["input"], sent["tenant"], sent["priority"]) == (
            capability,
            payload,
            tenant,
            priority,
        ), printed
    lab = next(r for r in DEMO_REQUESTS if r[1] == "lab.experiment@1")
    assert "--priority production" in command_line(lab[1], lab[2], lab[3], lab[4])


def test_a_chat_answer_prints_its_text_not_a_vector(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    output = {
        "simulated": True,
        "deployment": "chat.small@1",
        "embedding": [0.125, -0.5, 0.25, 0.75, -0.125, 0.5, 0.375, -0.25],
        "text": "[simulated chat.small@1] you said: hello",
        "finish_reason": "stop",
    }
    lease: Any = SimpleNamespace(accelerator="gpu-node/0")  # all the CLI reads of a lease
    client = FakeClient(Result(ok=True, request_id="r", capability="chat.small@1", output=output, lease=lease))
    _fake_connect(monkeypatch, client)
    done = runner.invoke(cli.app, ["request", "chat.small@1"], env={**_env(tmp_path), "COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    assert "[simulated chat.small@1] you said: hello" in done.stdout
    assert "embedding" not in done.stdout and "0.125" not in done.stdout
    assert '"finish_reason": "stop"' in done.stdout


def test_the_demo_describes_a_chat_answer_by_its_text() -> None:
    from modelforge.demo import DEMO_REQUESTS, describe

    chat = next(r for r in DEMO_REQUESTS if r[1] == "chat.small@1")
    assert "messages" in chat[2]  # what the simulated runtime answers with text
    result = Result(
        ok=True, request_id="r", capability="chat.small@1", output={"embedding": [0.5] * 8, "text": "hi back"}
    )
    assert "answer='hi back'" in describe(result) and "embedding" not in describe(result)


def _stub_stack(monkeypatch: pytest.MonkeyPatch, demo_line: str) -> None:
    from modelforge import demo, dev

    async def prepare(stack: Any, url: str) -> list[str]:
        return ["gpu-node"]

    async def ready(settings: Any, nodes: list[str], timeout_s: float = 0.0) -> None:
        return None

    async def run_demo(settings: Any) -> int:
        print(demo_line, file=sys.stderr)
        return 0

    monkeypatch.setattr(dev.DevStack, "start_temporal", lambda self: setattr(self, "started_temporal", True))
    monkeypatch.setattr(dev.DevStack, "start_postgres", lambda self: "postgresql://x@127.0.0.1:1/x")
    monkeypatch.setattr(dev.DevStack, "start_workers", lambda self, url, nodes: None)
    monkeypatch.setattr(dev.DevStack, "stop", lambda self: None)
    monkeypatch.setattr(dev, "_prepare", prepare)
    monkeypatch.setattr(dev, "_wait_ready", ready)
    monkeypatch.setattr(demo, "run_demo", run_demo)


def test_exit_after_demo_prints_no_ui_address_after_the_stack_stopped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from modelforge import dev
    from modelforge.settings import Settings

    _stub_stack(monkeypatch, "DEMO DONE")
    monkeypatch.setenv("MODELFORGE_HOME", str(tmp_path / "home"))
    assert dev.run_dev(Settings.from_env(), example_catalog_path(), 18233, True, True) == 0
    printed = capsys.readouterr().err
    assert "DEMO DONE" in printed
    assert "Temporal UI" not in printed.split("DEMO DONE", 1)[1]
    assert "Press Ctrl-C" not in printed


# --- 5. dev applies the catalog it was given, to a scheduler that already runs -------------------------


@dataclass
class FakeHandle:
    workflow_id: str
    log: list[tuple[str, str]]
    status: PoolStatus | None = None
    missing: bool = False

    async def signal(self, name: str) -> None:
        if self.missing:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        self.log.append((self.workflow_id, name))

    async def query(self, name: str, **kwargs: Any) -> PoolStatus:
        assert name == "status" and self.status is not None
        return self.status


@dataclass
class FakeTemporal:
    status: PoolStatus | None = None
    missing: bool = False
    log: list[tuple[str, str]] = field(default_factory=list)

    def get_workflow_handle(self, workflow_id: str) -> FakeHandle:
        return FakeHandle(workflow_id, self.log, self.status, self.missing)


class FakeStore:
    applied: list[Any] = []

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> FakeStore:
        return cls()

    async def migrate(self) -> list[str]:
        return []

    async def apply_catalog(self, catalog: Any) -> dict[str, int]:
        FakeStore.applied.append(catalog)
        return {"accelerators": len(catalog.accelerators)}

    async def load_catalog(self) -> Any:
        return None

    async def close(self) -> None:
        return None


@pytest.mark.parametrize("running", [True, False])
def test_dev_tells_a_running_scheduler_to_reload_the_catalog(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, running: bool
) -> None:
    import asyncio

    from modelforge import dev
    from modelforge.settings import Settings

    temporal = FakeTemporal(missing=not running)

    async def connect(settings: Any) -> FakeTemporal:
        return temporal

    async def register(client: Any) -> None:
        return None

    monkeypatch.setattr(dev, "Store", FakeStore)
    monkeypatch.setattr(dev, "connect", connect)
    monkeypatch.setattr(dev, "register_search_attributes", register)
    asked: list[tuple[str, list[str]]] = []

    async def adopt_stranded(client: Any, version: Any, workflow_ids: list[str]) -> list[str]:
        asked.append((version.build_id, sorted(workflow_ids)))
        return []

    monkeypatch.setattr(dev, "adopt_stranded", adopt_stranded)
    monkeypatch.setenv("MODELFORGE_HOME", str(tmp_path / "home"))
    FakeStore.applied.clear()
    stack = dev.DevStack(Settings.from_env(), example_catalog_path(), 18233)
    nodes = asyncio.run(dev._prepare(stack, "postgresql://x@127.0.0.1:1/x"))
    assert sorted(nodes) == ["desktop", "gpu-node"] and len(FakeStore.applied) == 1
    assert temporal.log == ([("scheduler:default", "catalog_changed")] if running else [])
    # The host's long-lived runs, stranded on another release's build, follow this one's.
    long_lived = sorted(["scheduler:default", telemetry_id("desktop"), telemetry_id("gpu-node")])
    assert asked == [(modelforge.__version__, long_lived)]


# --- 6. catalog apply warns of nodes that never reported ---------------------------------------------


def test_catalog_apply_warns_of_nodes_that_never_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import modelforge.store
    import modelforge.temporal

    seen = PoolStatus(pool="default", now=0.0, accelerators=[_accelerator("gpu-node/0", "gpu-node")])
    temporal = FakeTemporal(status=seen)

    async def connect(settings: Any) -> FakeTemporal:
        return temporal

    monkeypatch.setattr(modelforge.store, "Store", FakeStore)
    monkeypatch.setattr(modelforge.temporal, "connect", connect)
    env = {**_env(tmp_path, MODELFORGE_DATABASE_URL="postgresql://x@127.0.0.1:1/x"), "COLUMNS": "300"}
    done = runner.invoke(cli.app, ["catalog", "apply", str(example_catalog_path())], env=env)
    assert done.exit_code == 0, done.output
    assert temporal.log == [("scheduler:default", "catalog_changed")]
    assert "warning: node desktop has never reported" in done.stderr
    assert "SCHEDULER_STATE_STALE" in done.stderr
    assert "node gpu-node" not in done.stderr


# --- 7. profile says what the envelope changes --------------------------------------------------------


def test_profile_on_a_model_without_production_cards_says_production_still_cannot_use_it() -> None:
    line = cli.profile_outcome("Simulated desktop 8GB", [])
    assert "may now use" not in line and "production requests still cannot" in line
    line = cli.profile_outcome("Simulated L4 24GB", ["gpu-node/0"])
    assert "production requests may now use Simulated L4 24GB cards (gpu-node/0)" in line


# --- 10. the gateway command serves with the gateway's own server settings ---------------------------


def test_gateway_command_serves_through_gateway_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import modelforge.gateway._server
    import modelforge.store

    built: list[tuple[Any, str, int]] = []

    class Server:
        async def serve(self) -> None:
            return None

    def gateway_server(app: Any, host: str, port: int, **kwargs: Any) -> Server:
        built.append((app, host, port))
        return Server()

    _fake_connect(monkeypatch, FakeClient())
    monkeypatch.setattr(modelforge.store, "Store", FakeStore)
    monkeypatch.setattr(modelforge.gateway._server, "gateway_server", gateway_server)
    env = _env(tmp_path, MODELFORGE_DATABASE_URL="postgresql://x@127.0.0.1:1/x")
    done = runner.invoke(cli.app, ["gateway", "--port", "18080"], env=env)
    assert done.exit_code == 0, done.output
    assert len(built) == 1 and built[0][1:] == ("127.0.0.1", 18080)


# --- 11. the simulated runtime answers a chat or completion model with text ----------------------


@pytest.mark.parametrize(
    ("capability", "payload", "said"),
    [
        ("chat.small@1", {"prompt": "hello"}, "hello"),
        ("chat.small@1", {"messages": [{"role": "user", "content": "is the card busy?"}]}, "is the card busy?"),
        ("text.completion@1", {"prompt": ["first", "second"]}, "second"),
        ("inference.chat@1", {}, ""),
        # Fill in the middle (Ollama's suffix): it says what it was to lead up to.
        ("code.completion@1", {"prompt": "def f(", "suffix": "return x"}, "def f( (to fill in before: return x)"),
    ],
)
async def test_the_simulated_runtime_answers_chat_and_completion_with_text(
    capability: str, payload: dict[str, Any], said: str
) -> None:
    from modelforge.domain import Deployment
    from modelforge.gpu import NodeDevices, SimulatedDevice, SimulatedGpuBackend
    from modelforge.runtimes import SimulatedRuntime

    devices = NodeDevices(SimulatedGpuBackend([SimulatedDevice(0, "GPU-0", "Simulated L4", 24 * GiB)]), None)
    runtime = SimulatedRuntime(devices)
    model = await runtime.load("k", Deployment(capability=capability, envelope_bytes=GiB), 0, "GPU-0", lambda _: None)
    output = await runtime.invoke(model, payload, lambda _: None)
    assert output["text"] == f"[simulated {capability}] you said: {said}"
    assert output["finish_reason"] == "stop"
    assert "embedding" not in output  # text, not a vector
    await runtime.health_check(model)


async def test_the_simulated_runtime_still_embeds_for_an_embedding_model() -> None:
    from modelforge.domain import Deployment
    from modelforge.gpu import NodeDevices, SimulatedDevice, SimulatedGpuBackend
    from modelforge.runtimes import SimulatedRuntime
    from modelforge.runtimes._simulated import generates_text

    devices = NodeDevices(SimulatedGpuBackend([SimulatedDevice(0, "GPU-0", "Simulated L4", 24 * GiB)]), None)
    runtime = SimulatedRuntime(devices)
    embedder = Deployment(capability="rag.embedding@1", envelope_bytes=GiB, openai_models=["all-MiniLM-L6-v2"])
    model = await runtime.load("k", embedder, 0, "GPU-0", lambda _: None)
    for payload in ({"text": "hello"}, {"prompt": "hello"}):
        output = await runtime.invoke(model, payload, lambda _: None)
        assert len(output["embedding"]) == 8 and "text" not in output
    batch = await runtime.invoke(model, {"texts": ["a", "b"]}, lambda _: None)
    assert len(batch["embeddings"]) == 2
    # The name decides unless the catalog says so.
    assert generates_text(Deployment(capability="lab.experiment@1", envelope_bytes=1, openai_models=["small-chat"]))
    assert not generates_text(
        Deployment(capability="chat.encoder@1", envelope_bytes=1, runtime_config={"simulate_output": "embedding"})
    )
    assert generates_text(Deployment(capability="x.y@1", envelope_bytes=1, runtime_config={"simulate_output": "text"}))


# --- 12. help renders whole sentences -------------------------------------------------------------


def _commands() -> list[tuple[list[str], Any]]:
    """Every command and group under `modelforge`, as its path and its click command, resolved
    the way `modelforge PATH --help` resolves it."""
    import typer

    root = typer.main.get_command(cli.app)
    found: list[tuple[list[str], Any]] = []

    def walk(command: Any, path: list[str], ctx: Any) -> None:
        found.append((path, command))
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                walk(sub, [*path, name], type(ctx)(sub, parent=ctx, info_name=name))

    walk(root, [], type(root.make_context("modelforge", [], resilient_parsing=True))(root, info_name="modelforge"))
    return found


_TERMINAL = (".", "?", "!")


def test_every_help_text_is_whole_sentences() -> None:
    commands = _commands()
    assert {"request", "status", "profile", "gateway", "catalog apply", "db migrate", "trace azure"} <= {
        " ".join(path) for path, _ in commands
    }
    for path, command in commands:
        name = " ".join(["modelforge", *path])
        assert command.help, f"{name}: no help"
        assert "\b" not in command.help and "\\b" not in command.help, name
        for paragraph in command.help.partition("\f")[0].split("\n\n"):
            # One line per paragraph: the terminal wraps it, no docstring line break splits it.
            assert "\n" not in paragraph.strip(), f"{name}: {paragraph!r}"
            assert paragraph.strip().endswith(_TERMINAL), f"{name}: {paragraph!r}"
        if path:
            # The summary in the commands panel and in shell completion is the whole first
            # paragraph: not cut at 45 characters or at the first period.
            first = command.help.split("\n\n")[0]
            assert command.get_short_help_str() == first, name
        for param in command.params:
            if param.name in ("help", "install_completion", "show_completion"):
                continue
            text = getattr(param, "help", None)
            assert text, f"{name} {param.name}: no help"
            assert "\n" not in text and "\b" not in text, f"{name} {param.name}: {text!r}"
            assert text.endswith(_TERMINAL), f"{name} {param.name}: {text!r}"


def _premature_breaks(lines: list[str], start: int, end: int) -> list[str]:
    """Lines of a wrapped text (the columns start:end of `lines`) that broke although the next
    word would have fit on them: a line break the help text itself carried."""
    broken = []
    width = end - start
    for line, following in itertools.pairwise(lines):
        text, after = line[start:end].rstrip(), following[start:end].strip()
        if text.strip() and after and len(text) + 1 + len(after.split()[0]) < width - 1:
            broken.append(f"{text.strip()!r} then {after.split()[0]!r}")
    return broken


@pytest.mark.parametrize("columns", [100, 120])
def test_every_help_page_renders_whole_sentences(columns: int) -> None:
    for path, command in _commands():
        name = " ".join(["modelforge", *path])
        done = runner.invoke(cli.app, [*path, "--help"], env={"COLUMNS": str(columns), "TERM": "dumb"})
        assert done.exit_code == 0, (name, done.output)
        lines = done.output.splitlines()
        assert not any(len(line) > columns for line in lines), name
        assert "…" not in done.output and "\b" not in done.output, f"{name}:\n{done.output}"
        # Square brackets in a help text survive rich markup ("modelforge[plot]" would print as
        # "modelforge"): write such help through rich.markup.escape.
        for text in [command.help or "", *(getattr(param, "help", None) or "" for param in command.params)]:
            for bracketed in re.findall(r"\[[^\]\s]*\]+", text.replace("\\[", "[")):
                assert bracketed in done.output, f"{name}: {bracketed} of {text!r} is lost (rich markup: escape it)"
        # The description, between the usage line and the first panel.
        usage = next(i for i, line in enumerate(lines) if "Usage:" in line)
        first_panel = next((i for i, line in enumerate(lines) if line.startswith("╭")), len(lines))
        description = lines[usage + 1 : first_panel]
        for block in "\n".join(description).split("\n" + " " * columns + "\n"):
            assert not _premature_breaks(block.splitlines(), 0, columns), f"{name}:\n{done.output}"
        # The commands panel: each summary wraps only where the next word does not fit.
        if "─ Commands ─" in done.output:
            top = next(i for i, line in enumerate(lines) if "─ Commands ─" in line)
            rows = list(itertools.takewhile(lambda line: line.startswith("│"), lines[top + 1 :]))
            offset = len(rows[0]) - len(rows[0][2:].lstrip().split(" ", 1)[1].lstrip()) - 0
            entry: list[str] = []
            for row in [*rows, "│ end"]:
                if row[2:3].strip() and entry:  # a command's first row: the previous entry ends
                    assert not _premature_breaks(entry, offset, len(row) - 2), f"{name}:\n{done.output}"
                    entry = []
                entry.append(row)


# --- 13. the CLI imports what a command needs, when it needs it -------------------------------------

_HEAVY = ("temporalio", "torch", "fastapi", "starlette", "uvicorn", "sentence_transformers", "psycopg", "numpy")


def _imported_after(code: str) -> set[str]:
    # The probe ends as `modelforge.cli.main` does, without interpreter finalization: a process
    # that made a Temporal client can abort while Python tears down (temporalio/sdk-python#300).
    probe = (
        "import json, os, sys\n"
        f"{code}\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(_HEAVY)!r}))))\n"
        "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env["MODELFORGE_TEMPORAL_ADDRESS"] = "127.0.0.1:1"  # nothing listens: status fails at once
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_imports_no_heavy_module() -> None:
    assert _imported_after("import modelforge.cli") == set()


def test_help_version_and_status_import_only_what_they_need() -> None:
    run = "from typer.testing import CliRunner\nfrom modelforge import cli\nr = CliRunner()\n"
    assert _imported_after(run + "r.invoke(cli.app, ['--help'])\nr.invoke(cli.app, ['--version'])") == set()
    assert (
        _imported_after(run + "r.invoke(cli.app, ['request', '--help'])\nr.invoke(cli.app, ['status', '--help'])")
        == set()
    )
    # status --json needs the Temporal client, and nothing else heavy.
    assert _imported_after(run + "print(r.invoke(cli.app, ['status', '--json']).output, file=sys.stderr)") == {
        "temporalio"
    }
