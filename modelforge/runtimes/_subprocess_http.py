"""A model server run as a child process and spoken to over HTTP on loopback.

Configuration alone fronts vLLM, llama.cpp's server or text-embeddings-inference: `command` is an
argument list (never a shell string) with `{port}`, `{host}`, `{artifact}` and `{served_model}`
filled in, `runtime_config.api` names the dialect. The child gets `CUDA_VISIBLE_DEVICES` set to
the leased card's UUID (empty on the CPU device, so it sees no GPU), a session of its own so a
stop reaches every process it forked, and its output in a log file whose tail every failure
quotes. Its bytes are what NVML attributes to its process tree.

Request parameters (`temperature`, `tools`, `n`, `dimensions`, a server's own such as vLLM's
`top_k`) travel in the input's `parameters` object and reach the server as given; its answer
comes back whole (every choice, tool calls, logprobs) with its `usage` token counts, and what it
refuses (4xx) is REQUEST_INVALID with its reason (`_http_api.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu import CPU_DEVICE_INDEX, NodeDevices
from modelforge.runtimes._http_api import (
    API_NAMES,
    HEALTH_MESSAGES,
    HEALTH_RERANK,
    HEALTH_TEXTS,
    build_call,
    check_embeddings,
    check_rerank,
    parse_response,
    stream_record,
    usage_of,
)
from modelforge.runtimes._process import alive, free_port, process_tree, rss_bytes
from modelforge.runtimes._protocol import Heartbeat, LoadedModel, unsupported
from modelforge.runtimes._secrets import NodeSecrets, secret_problems

_PLACEHOLDERS = ("{port}", "{host}", "{artifact}", "{served_model}")


def _number(config: dict[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = config.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"runtime_config.{name}: {raw!r} is not a number") from None
    if not low <= value <= high:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"runtime_config.{name}: {value} is not in {low}..{high}")
    return value


@dataclass(frozen=True)
class SubprocessHttpConfig:
    command: list[str]
    api: str
    served_model: str
    host: str
    port: int  # 0: a free port chosen at each load
    ready_path: str
    ready_timeout_s: float
    request_timeout_s: float
    stop_grace_s: float
    dimensions: int | None
    env: dict[str, str]
    # vLLM with VLLM_SERVER_DEV_MODE=1: sleep_path = "/sleep?level=1", wake_path = "/wake_up".
    sleep_path: str = ""
    wake_path: str = ""
    checkpoint_path: str = ""  # POST; answers {"location": ...}
    # On a simulated card: the bytes a sleeping server is recorded as holding.
    simulate_sleep_bytes: int = 0
    # Environment variable -> the node's secret of that name (names only; values at load).
    secret_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, deployment: Deployment) -> SubprocessHttpConfig:
        """The deployment's configuration, or REQUEST_INVALID naming the field."""
        config = deployment.runtime_config
        known = {
            "api", "served_model", "host", "port", "ready_path", "ready_timeout_s", "request_timeout_s",
            "stop_grace_s", "dimensions", "sleep_path", "wake_path", "checkpoint_path", "simulate_sleep_bytes",
        }  # fmt: skip
        for key in sorted(config):
            if key not in known and not key.startswith("env."):
                raise ModelForgeError(
                    FailureClass.REQUEST_INVALID, f"runtime_config.{key}: unknown for subprocess_http"
                )
        if not deployment.command or not all(deployment.command):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, "subprocess_http needs `command`, a non-empty argument list"
            )
        api = config.get("api", "openai_embeddings")
        if api not in API_NAMES:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"runtime_config.api: {api!r} is not one of {', '.join(API_NAMES)}"
            )
        port = config.get("port", "auto")
        host = config.get("host", "127.0.0.1")
        if host not in ("127.0.0.1", "::1", "localhost"):
            # The server speaks unauthenticated HTTP: it stays on loopback.
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"runtime_config.host: {host!r} is not loopback")
        for name in ("ready_path", "sleep_path", "wake_path", "checkpoint_path"):
            if not config.get(name, "/").startswith("/"):
                raise ModelForgeError(FailureClass.REQUEST_INVALID, f"runtime_config.{name} must start with '/'")
        secrets = secret_problems(config, deployment.env_from_secrets)
        if secrets:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, secrets[0])
        if bool(config.get("sleep_path")) != bool(config.get("wake_path")):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, "runtime_config: sleep_path and wake_path come together"
            )
        ready_path = config.get("ready_path", "/health")
        dimensions = config.get("dimensions")
        return cls(
            command=list(deployment.command),
            api=api,
            served_model=config.get("served_model", deployment.deployment_id),
            host=host,
            port=0 if port == "auto" else int(_number(config, "port", 0, 1, 65535)),
            ready_path=ready_path,
            ready_timeout_s=_number(config, "ready_timeout_s", 120.0, 0.1, 3600),
            request_timeout_s=_number(config, "request_timeout_s", 60.0, 0.1, 3600),
            stop_grace_s=_number(config, "stop_grace_s", 10.0, 0, 600),
            dimensions=int(_number(config, "dimensions", 0, 1, 65536)) if dimensions is not None else None,
            sleep_path=config.get("sleep_path", ""),
            wake_path=config.get("wake_path", ""),
            checkpoint_path=config.get("checkpoint_path", ""),
            simulate_sleep_bytes=int(_number(config, "simulate_sleep_bytes", 0, 0, 2**50)),
            env={key.removeprefix("env."): value for key, value in config.items() if key.startswith("env.")},
            secret_env=dict(deployment.env_from_secrets),
        )


@dataclass
class _Server:
    key: str
    process: asyncio.subprocess.Process
    config: SubprocessHttpConfig
    base_url: str
    log_path: Path
    client: httpx.AsyncClient


class SubprocessHttpRuntime:
    name = "subprocess_http"

    def __init__(
        self,
        devices: NodeDevices,
        log_dir: Path,
        artifact_root: Path | None = None,
        secrets: NodeSecrets | None = None,
    ) -> None:
        """`secrets`: what `env_from_secrets` references resolve to; by default read now (the
        node worker's start) from MODELFORGE_SECRET_* and MODELFORGE_SECRETS_DIR."""
        self._devices = devices
        self._log_dir = log_dir
        self._artifact_root = artifact_root
        self._secrets = NodeSecrets.from_env() if secrets is None else secrets
        self._servers: dict[str, _Server] = {}

    def version(self) -> str:
        # The server's own version is its business; the command that ran is in the envelope.
        return "subprocess_http"

    def _log_tail(self, path: Path, limit: int = 600) -> str:
        try:
            text = path.read_bytes()[-limit:].decode("utf-8", errors="replace").strip()
        except OSError:
            return ""
        return f"; server log ({path}) ends: {text}" if text else f"; server log: {path}"

    async def load(
        self, key: str, deployment: Deployment, device_index: int, device_uuid: str, heartbeat: Heartbeat
    ) -> LoadedModel:
        config = SubprocessHttpConfig.of(deployment)
        started = time.monotonic()
        port = config.port or free_port(config.host)
        values = {
            "{port}": str(port),
            "{host}": config.host,
            "{artifact}": deployment.artifact,
            "{served_model}": config.served_model,
        }
        argv = []
        for argument in config.command:
            for placeholder in _PLACEHOLDERS:
                argument = argument.replace(placeholder, values[placeholder])
            argv.append(argument)
        # Nothing of ModelForge's own configuration (database URL, API keys, the node's secrets)
        # reaches a model server: only the deployment's env and the secrets it references.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        environment = {**inherited, **config.env, **self._secrets.resolve(config.secret_env)}
        # The card the lease names, by UUID so a renumbering cannot move it; none on the CPU device.
        environment["CUDA_VISIBLE_DEVICES"] = "" if device_index == CPU_DEVICE_INDEX else device_uuid
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"{key.replace('/', '_').replace('@', '_at_')}.log"
        with log_path.open("wb") as log_file:
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    env=environment,
                    start_new_session=True,
                )
            except OSError as error:
                raise ModelForgeError(
                    FailureClass.MODEL_LOAD_FAILED, f"cannot start {argv[0]!r}: {error.strerror or error}"
                ) from None
        # A node worker killed outright leaves its servers running (they have sessions of their
        # own): the next start of the worker finds them by this file and stops them.
        self._pid_file(key).write_text(json.dumps({"pid": process.pid, "argv": argv}), encoding="utf-8")
        base_url = f"http://{'[' + config.host + ']' if ':' in config.host else config.host}:{port}"
        server = _Server(
            key, process, config, base_url, log_path, httpx.AsyncClient(base_url=base_url, trust_env=False)
        )
        try:
            await self._wait_ready(server, heartbeat)
        except BaseException:
            await self._stop(server)
            raise
        pids = process_tree(process.pid)
        if device_index == CPU_DEVICE_INDEX or self._devices.simulated_gpus:
            # No card attributes these bytes: on the CPU device the tree's resident memory, on a
            # simulated card the catalog's envelope, recorded so samples show them.
            measured = rss_bytes(pids) if device_index == CPU_DEVICE_INDEX else deployment.resident_bytes
            self._devices.allocate(device_index, process.pid, measured, f"modelforge:{key}")
        else:
            measured = await asyncio.to_thread(self._devices.process_bytes, device_index, pids)
        self._servers[key] = server
        return LoadedModel(
            key, deployment.deployment_id, device_index, process.pid, measured, time.monotonic() - started, True
        )

    def _pid_file(self, key: str) -> Path:
        return self._log_dir / f"{key.replace('/', '_').replace('@', '_at_')}.pid"

    def reap_orphans(self) -> list[int]:
        """Stop model servers a previous run of this node worker started and never stopped (it
        was killed): each is found by the pid file it left, checked against the command it ran
        (a reused pid is never touched). Returns the pids stopped."""
        reaped: list[int] = []
        if not self._log_dir.is_dir():
            return reaped
        for pid_file in sorted(self._log_dir.glob("*.pid")):
            try:
                record = json.loads(pid_file.read_text(encoding="utf-8"))
                pid, argv = int(record["pid"]), [str(a) for a in record["argv"]]
                running = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[:-1]
            except (OSError, ValueError, KeyError, TypeError):
                running, pid, argv = [], 0, []
            if pid and [a.decode(errors="replace") for a in running] == argv and alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                reaped.append(pid)
            pid_file.unlink(missing_ok=True)
        return reaped

    async def _wait_ready(self, server: _Server, heartbeat: Heartbeat) -> None:
        deadline = time.monotonic() + server.config.ready_timeout_s
        waited = 0
        while True:
            if server.process.returncode is not None:
                raise ModelForgeError(
                    FailureClass.MODEL_LOAD_FAILED,
                    f"server exited with code {server.process.returncode} before it was ready"
                    + self._log_tail(server.log_path),
                )
            try:
                answer = await server.client.get(server.config.ready_path, timeout=2.0)
                if answer.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise ModelForgeError(
                    FailureClass.MODEL_LOAD_FAILED,
                    f"server not ready on {server.base_url}{server.config.ready_path} within "
                    f"{server.config.ready_timeout_s:.0f} s" + self._log_tail(server.log_path),
                )
            waited += 1
            if waited % 4 == 0:
                heartbeat(f"waiting for {server.base_url}{server.config.ready_path}")
            await asyncio.sleep(0.25)

    def _server(self, model: LoadedModel) -> _Server:
        server = self._servers.get(model.resident_key)
        if server is None:
            raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"{model.resident_key} has no running server")
        return server

    async def _call(self, server: _Server, payload: dict[str, Any], heartbeat: Heartbeat) -> dict[str, Any]:
        call = build_call(server.config.api, server.config.served_model, payload)
        request = asyncio.ensure_future(
            server.client.post(call.path, json=call.body, timeout=server.config.request_timeout_s)
        )
        try:
            while True:
                done, _ = await asyncio.wait({request}, timeout=2.0)
                if done:
                    break
                if server.process.returncode is not None:
                    break
                heartbeat(f"waiting for {server.base_url}{call.path}")
            answer = await request
        except httpx.TimeoutException:
            raise ModelForgeError(
                FailureClass.TIMEOUT,
                f"no answer from {server.base_url}{call.path} in {server.config.request_timeout_s:.0f} s",
            ) from None
        except httpx.HTTPError as error:
            await asyncio.sleep(0.2)  # a dying server's exit code lands a moment after its socket closes
            if server.process.returncode is not None or not alive(server.process.pid):
                raise ModelForgeError(
                    FailureClass.RUNTIME_CRASH,
                    f"server exited (code {server.process.returncode}) during the request"
                    + self._log_tail(server.log_path),
                ) from None
            raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"{call.path}: {type(error).__name__}: {error}") from None
        finally:
            request.cancel()
        if 400 <= answer.status_code < 500:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"server refused the request ({answer.status_code}): {answer.text[:300]}"
            )
        if answer.status_code >= 500:
            raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"server error {answer.status_code}: {answer.text[:300]}")
        try:
            body = answer.json()
        except ValueError:
            raise ModelForgeError(
                FailureClass.INVALID_OUTPUT, f"server answered non-JSON: {answer.text[:120]!r}"
            ) from None
        return parse_response(server.config.api, body, call.expected, completion=call.completion)

    async def invoke(self, model: LoadedModel, payload: dict[str, Any], heartbeat: Heartbeat) -> dict[str, Any]:
        server = self._server(model)
        if server.process.returncode is not None:
            raise ModelForgeError(
                FailureClass.RUNTIME_CRASH,
                f"server exited with code {server.process.returncode}" + self._log_tail(server.log_path),
            )
        return await self._call(server, payload, heartbeat)

    async def invoke_stream(
        self, model: LoadedModel, payload: dict[str, Any], heartbeat: Heartbeat
    ) -> AsyncIterator[dict[str, Any]]:
        """A chat answer as the server generates it (OpenAI's `stream: true`): `{"delta": text}`
        records for plain text, the server's choices whole for anything more (reasoning, tool
        calls, logprobs, `n` choices: `stream_record`), then `{"finish_reason", "usage"}`.
        Closing this iterator closes the server's stream, which is how vLLM and llama.cpp's
        server learn to stop generating."""
        server = self._server(model)
        api = server.config.api
        if api != "openai_chat":
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{model.deployment} (api {api}) does not stream text")
        call = build_call(api, server.config.served_model, payload)
        body = dict(call.body)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        finishes: dict[int, str] = {}
        usage: dict[str, int] | None = None
        try:
            async with server.client.stream(
                "POST", call.path, json=body, timeout=server.config.request_timeout_s
            ) as answer:
                if answer.status_code >= 400:
                    text = (await answer.aread()).decode(errors="replace")[:300]
                    failure = FailureClass.REQUEST_INVALID if answer.status_code < 500 else FailureClass.RUNTIME_CRASH
                    raise ModelForgeError(failure, f"server refused the stream ({answer.status_code}): {text}")
                async for line in answer.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise ModelForgeError(
                            FailureClass.INVALID_OUTPUT, f"server streamed non-JSON: {data[:120]!r}"
                        ) from None
                    usage = usage_of(chunk, chat=True) or usage
                    record = stream_record(chunk, finishes)
                    if record is not None:
                        heartbeat("streaming")
                        yield record
        except httpx.TimeoutException:
            raise ModelForgeError(
                FailureClass.TIMEOUT,
                f"the stream from {server.base_url}{call.path} stalled past {server.config.request_timeout_s:.0f} s",
            ) from None
        except httpx.HTTPError as error:
            await asyncio.sleep(0.2)
            if server.process.returncode is not None or not alive(server.process.pid):
                raise ModelForgeError(
                    FailureClass.RUNTIME_CRASH,
                    f"server exited (code {server.process.returncode}) while streaming"
                    + self._log_tail(server.log_path),
                ) from None
            raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"{call.path}: {type(error).__name__}: {error}") from None
        yield {"finish_reason": finishes.get(0) or "stop", "usage": usage}

    async def health_check(self, model: LoadedModel) -> None:
        server = self._server(model)
        try:
            if server.config.api == "openai_chat":
                output = await self._call(server, {"messages": HEALTH_MESSAGES, "max_tokens": 8}, lambda _: None)
                if not output["text"].strip():
                    raise ModelForgeError(FailureClass.HEALTHCHECK_FAILED, "the server answered an empty reply")
            elif server.config.api == "rerank":
                output = await self._call(server, dict(HEALTH_RERANK), lambda _: None)
                check_rerank(output["results"])
            else:
                output = await self._call(server, {"texts": HEALTH_TEXTS}, lambda _: None)
                check_embeddings(output["embeddings"], server.config.dimensions)
        except ModelForgeError as error:
            if error.failure == FailureClass.HEALTHCHECK_FAILED:
                raise
            raise ModelForgeError(FailureClass.HEALTHCHECK_FAILED, f"{error.failure.value}: {error.message}") from None

    async def _stop(self, server: _Server) -> None:
        """SIGTERM to the server's session, then SIGKILL after the grace time."""
        process = server.process
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=server.config.stop_grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        # Workers it forked into the same session may outlive it by a moment.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await server.client.aclose()
        self._pid_file(server.key).unlink(missing_ok=True)

    def supports(self, deployment: Deployment) -> list[str]:
        config = SubprocessHttpConfig.of(deployment)
        return [op for op, path in (("sleep", config.sleep_path), ("checkpoint", config.checkpoint_path)) if path]

    async def _post(
        self, server: _Server, path: str, operation: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        if not path:
            raise unsupported(self.name, operation, f"runtime_config.{operation}_path is not set")
        try:
            answer = await server.client.post(path, json=body, timeout=server.config.request_timeout_s)
        except httpx.HTTPError as error:
            raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"{operation} {path}: {type(error).__name__}") from None
        if answer.status_code != 200:
            raise ModelForgeError(
                FailureClass.RUNTIME_CRASH, f"{operation} {path}: {answer.status_code} {answer.text[:200]}"
            )
        return answer

    def _bytes_now(self, model: LoadedModel, simulated: int) -> int:
        if model.device_index == CPU_DEVICE_INDEX:
            return rss_bytes(process_tree(model.pid))
        if self._devices.simulated_gpus:
            tag = f"modelforge:{model.resident_key}"
            self._devices.free(model.device_index, model.pid, tag)
            self._devices.allocate(model.device_index, model.pid, simulated, tag)
            return simulated
        return self._devices.process_bytes(model.device_index, process_tree(model.pid))

    async def sleep(self, model: LoadedModel) -> int:
        server = self._server(model)
        await self._post(server, server.config.sleep_path, "sleep")
        return await asyncio.to_thread(self._bytes_now, model, server.config.simulate_sleep_bytes)

    async def wake(self, model: LoadedModel, heartbeat: Heartbeat) -> int:
        server = self._server(model)
        await self._post(server, server.config.wake_path, "wake")
        return await asyncio.to_thread(self._bytes_now, model, model.measured_bytes)

    async def run_job(
        self, deployment: Deployment, device_indices: list[int], payload: dict[str, Any], heartbeat: Heartbeat
    ) -> dict[str, Any]:
        raise unsupported(self.name, "run a multi-GPU job", "it serves a model; gang jobs run as batch jobs")

    async def checkpoint_job(self, lease_id: str, rank: int, destination: str) -> str:
        raise unsupported(self.name, "checkpoint a multi-GPU job", "it serves a model; gang jobs run as batch jobs")

    async def checkpoint(self, model: LoadedModel, payload: dict[str, Any]) -> str:
        server = self._server(model)
        # The server writes its state where the node's checkpoint store says and names it.
        answer = await self._post(server, server.config.checkpoint_path, "checkpoint", payload)
        try:
            location = answer.json()["location"]
        except (ValueError, KeyError, TypeError):
            raise ModelForgeError(FailureClass.INVALID_OUTPUT, "checkpoint answer has no 'location'") from None
        if not isinstance(location, str) or not location:
            raise ModelForgeError(FailureClass.INVALID_OUTPUT, "checkpoint 'location' is not a non-empty string")
        return location

    async def unload(self, model: LoadedModel) -> None:
        server = self._servers.pop(model.resident_key, None)
        if server is None:
            return
        await self._stop(server)
        self._devices.free(model.device_index, model.pid, f"modelforge:{model.resident_key}")

    async def close(self) -> None:
        """Stop every server (the node worker is shutting down)."""
        for key in list(self._servers):
            server = self._servers.pop(key)
            await self._stop(server)
