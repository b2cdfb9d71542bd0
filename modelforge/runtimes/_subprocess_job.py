"""A batch job (a merge, an evaluation, a training run) as a real process under its lease.

The deployment's `command` is an argument list (never a shell string) with `{python}`,
`{artifact}`, `{job_id}`, `{checkpoint_dir}` and `{output_dir}` filled in; with
`runtime_config.input_args = "true"` the request's `args` (a list of strings) are appended. Each
invoke runs the command to its end in a session of its own, with the leased card by UUID in
`CUDA_VISIBLE_DEVICES` (empty on the CPU device) and the job's directories in `MODELFORGE_*`
variables (docs/RUNTIMES.md, subprocess_job). The job reports JSON lines on its stdout or in
`MODELFORGE_PROGRESS_FILE`: `{"progress": 0.4, "message": "..."}` become the invoke's heartbeat
details, `{"checkpoint": PATH}` names its latest complete checkpoint, `{"result": {...}}` a small
result for the request's answer. Its output goes to a log file per job
(`$MODELFORGE_HOME/jobs/<node>/<request>/<run>/job.log`, `modelforge logs REQUEST_ID`).

Preemption: `checkpoint` sends the job `preempt_signal` (SIGTERM) and waits `preempt_grace_s`;
a job that checkpoints and exits with CHECKPOINTED_EXIT (75) hands its checkpoint to the
requeued run (`MODELFORGE_RESUME_FROM`). One that ignores the signal is killed (its whole
session) and restarts from the last checkpoint it announced, or from scratch."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu import CPU_DEVICE_INDEX, NodeDevices
from modelforge.runtimes._artifacts import artifact_digest, check_artifact
from modelforge.runtimes._process import alive, free_port, process_tree
from modelforge.runtimes._protocol import Heartbeat, LoadedModel, unsupported

RUNTIME_NAME = "subprocess_job"
CHECKPOINTED_EXIT = 75  # EX_TEMPFAIL: "checkpointed on request, run me again"
USAGE_EXITS = (2, 64)  # argparse's usage error, EX_USAGE: the request's arguments are wrong
PLACEHOLDERS = ("{python}", "{artifact}", "{job_id}", "{checkpoint_dir}", "{output_dir}")
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP,
           "SIGUSR1": signal.SIGUSR1, "SIGUSR2": signal.SIGUSR2}  # fmt: skip
MAX_PREEMPT_GRACE_S = 50.0  # below the request workflow's checkpoint timeout (60 s)
MAX_ARGS = 200
MAX_OUTPUT_FILES = 1000
LOG_TAIL_BYTES = 4096  # the end of a successful job's log, in its answer (`log_tail`)
POLL_S = 0.2
# What a CUDA (or ROCm, or PyTorch) out-of-memory failure prints.
OOM_TEXT = re.compile(
    rb"CUDA out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"
    rb"|CUBLAS_STATUS_ALLOC_FAILED|HIP out of memory|hipErrorOutOfMemory"
)
_KNOWN_CONFIG = {"cwd", "input_args", "preempt_signal", "preempt_grace_s", "stop_grace_s"}
# Every job starts under this shim, a child subreaper that keeps the job's whole process tree
# (a grandchild that double-forks and calls setsid() included) and kills it when the job ends.
JOB_SHIM = Path(__file__).resolve().with_name("_job_shim.py")
# Each attempt's processes carry this variable with a random value: the node finds by it what
# escaped the shim's tree (the shim killed, a node worker restarted), and only what is its own.
JOB_TAG = "MODELFORGE_JOB_TAG"
_fake_pids = itertools.count(60_000)


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
class SubprocessJobConfig:
    command: list[str]
    env: dict[str, str]
    cwd: str = ""  # "": the job's own directory; relative: to the node worker's directory
    input_args: bool = False
    preempt_signal: int = int(signal.SIGTERM)
    preempt_grace_s: float = 30.0
    stop_grace_s: float = 5.0  # past max_duration: the signal, then SIGKILL after this

    @classmethod
    def of(cls, deployment: Deployment) -> SubprocessJobConfig:
        """The deployment's configuration, or REQUEST_INVALID naming the field."""
        config = deployment.runtime_config
        for key in sorted(config):
            if key not in _KNOWN_CONFIG and not key.startswith("env."):
                raise ModelForgeError(FailureClass.REQUEST_INVALID, f"runtime_config.{key}: unknown for {RUNTIME_NAME}")
        if not deployment.command or not all(deployment.command):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"{RUNTIME_NAME} needs `command`, a non-empty argument list"
            )
        for argument in deployment.command:
            for token in re.findall(r"\{[A-Za-z_]+\}", argument):
                if token not in PLACEHOLDERS:
                    raise ModelForgeError(
                        FailureClass.REQUEST_INVALID,
                        f"command: unknown placeholder {token} (known: {', '.join(PLACEHOLDERS)})",
                    )
        name = config.get("preempt_signal", "SIGTERM").upper()
        if name not in SIGNALS:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"runtime_config.preempt_signal: {name!r} is not one of {', '.join(SIGNALS)}",
            )
        flag = config.get("input_args", "false").lower()
        if flag not in ("true", "false"):
            raise ModelForgeError(FailureClass.REQUEST_INVALID, "runtime_config.input_args is 'true' or 'false'")
        for key in config:
            if key.startswith("env.") and (
                not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key[4:]) or key[4:].startswith("MODELFORGE_")
            ):
                raise ModelForgeError(
                    FailureClass.REQUEST_INVALID,
                    f"runtime_config.{key}: not an environment variable a job may be given",
                )
        return cls(
            command=list(deployment.command),
            env={key.removeprefix("env."): value for key, value in config.items() if key.startswith("env.")},
            cwd=config.get("cwd", ""),
            input_args=flag == "true",
            preempt_signal=int(SIGNALS[name]),
            preempt_grace_s=_number(config, "preempt_grace_s", 30.0, 0, MAX_PREEMPT_GRACE_S),
            stop_grace_s=_number(config, "stop_grace_s", 5.0, 0, MAX_PREEMPT_GRACE_S),
        )


def job_directory_name(request_id: str) -> str:
    """A request id as one path component: itself when it is safe, else a safe form with a hash
    (so two ids never share a directory)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", request_id)[:120] or "request"
    if safe == request_id and safe not in (".", ".."):
        return safe
    return f"{safe}-{hashlib.sha256(request_id.encode()).hexdigest()[:12]}"


def _oom_kills() -> int | None:
    """The kernel's OOM-kill count for this process's cgroup (cgroup v2), or None."""
    try:
        line = Path("/proc/self/cgroup").read_text(encoding="ascii").splitlines()[0]
        events = Path("/sys/fs/cgroup") / line.split(":", 2)[2].lstrip("/") / "memory.events"
        for entry in events.read_text(encoding="ascii").splitlines():
            name, _, value = entry.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner reads (0700), and so is each folder made for it: a
    job's input, log, checkpoints and outputs are a tenant's, as its stored payloads are (0600).
    One that exists already (made before, or by an earlier attempt) is closed too."""
    missing: list[Path] = []
    folder = path
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):
            made.mkdir(mode=0o700)
    path.chmod(0o700)
    return path


def _private_file(path: Path, flags: int) -> int:
    """A descriptor on `path`, created 0600 when new."""
    return os.open(path, flags | os.O_CLOEXEC, 0o600)


def _append(path: Path) -> BinaryIO:
    """`path` opened to append bytes, created 0600."""
    return os.fdopen(_private_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")


def _write_json(path: Path, data: object) -> None:
    aside = path.with_name(path.name + ".tmp")
    with os.fdopen(_private_file(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w", encoding="utf-8") as handle:
        handle.write(json.dumps(data, indent=1))
    os.chmod(aside, 0o600)  # one left by an earlier version may be wider
    aside.replace(path)


@dataclass
class _Tail:
    """New complete lines of a file another process appends to."""

    path: Path
    offset: int = 0
    partial: bytes = b""

    def lines(self) -> list[bytes]:
        try:
            with self.path.open("rb") as stream:
                stream.seek(self.offset)
                chunk = stream.read(1 << 20)
        except OSError:
            return []
        self.offset += len(chunk)
        data = self.partial + chunk
        *complete, self.partial = data.split(b"\n")
        if len(self.partial) > 65536:  # a line this long is no report: dropped
            self.partial = b""
        return complete


@dataclass
class _Job:
    key: str
    lease_id: str
    request_id: str
    directory: Path
    checkpoint_dir: Path
    output_dir: Path
    log_path: Path
    process: asyncio.subprocess.Process
    config: SubprocessJobConfig
    attempt: dict[str, Any]
    tails: list[_Tail]
    tag: str = ""  # its processes' JOB_TAG value
    progress: float | None = None
    message: str = ""
    checkpoint: str = ""  # the latest complete checkpoint the job announced (its real path)
    result: Any = None
    preempting: bool = False
    killed_after_grace: bool = False
    changed: bool = True
    notes: list[str] = field(default_factory=list)

    def pump(self) -> None:
        """Read what the job reported since the last call (synchronous: never interleaved)."""
        for tail in self.tails:
            for raw in tail.lines():
                line = raw.strip()
                if not line.startswith(b"{"):
                    continue
                try:
                    report = json.loads(line)
                except ValueError:
                    continue
                if isinstance(report, dict):
                    self._take(report)

    def _take(self, report: dict[str, Any]) -> None:
        progress = report.get("progress")
        if isinstance(progress, int | float) and not isinstance(progress, bool) and math.isfinite(progress):
            self.progress = min(1.0, max(0.0, float(progress)))
            self.changed = True
        message = report.get("message")
        if isinstance(message, str):
            self.message = message[:200]
            self.changed = True
        if "result" in report:
            self.result = report["result"]
        location = report.get("checkpoint")
        if isinstance(location, str) and location:
            real = Path(os.path.realpath(location.removeprefix("file://")))
            mine = Path(os.path.realpath(self.checkpoint_dir))
            if real.is_relative_to(mine) and real.exists():
                self.checkpoint = str(real)
            else:
                self.notes.append(f"ignored checkpoint {location[:200]!r}: not in {self.checkpoint_dir}")

    def detail(self) -> str:
        shown = f"{self.progress:.0%}" if self.progress is not None else "running"
        return f"job {shown}" + (f": {self.message}" if self.message else "")


class SubprocessJobRuntime:
    name = RUNTIME_NAME
    # The node gives this runtime's invokes their request id, run and checkpoint directory.
    job_runtime = True

    def __init__(self, devices: NodeDevices, home: Path, node: str = "node", store: Path | None = None) -> None:
        """`home`: MODELFORGE_HOME; jobs keep their logs and outputs under `home/jobs/<node>`.
        `store`: the artifact store (MODELFORGE_ARTIFACT_STORE, shared by the nodes when it is on
        shared storage); by default `home/artifacts/store`, inside the default artifact root, so a
        deployment can serve an output."""
        self._devices = devices
        self._root = home / "jobs" / job_directory_name(node)
        self._store = artifact_store(home, store)
        self._node = node
        self._configs: dict[str, SubprocessJobConfig] = {}
        self._deployments: dict[str, Deployment] = {}
        self._uuids: dict[str, str] = {}
        self._jobs: dict[str, _Job] = {}  # by lease id
        self._preemptions: dict[str, dict[str, Any]] = {}  # by lease id, until the node takes it
        self._simulated_pids: set[int] = set()

    def version(self) -> str:
        return RUNTIME_NAME

    @property
    def jobs_dir(self) -> Path:
        return self._root

    @property
    def store(self) -> Path:
        """The artifact store its jobs' outputs go to and their `artifact:sha256:` inputs come from."""
        return self._store

    def running_pids(self) -> set[int]:
        """Every process of the running jobs (ModelForge's: their GPU bytes are managed)."""
        pids: set[int] = set(self._simulated_pids)  # a gang part's bytes on simulated cards
        for job in self._jobs.values():
            if job.process.returncode is None:
                pids |= process_tree(job.process.pid)
        return pids

    async def load(
        self, key: str, deployment: Deployment, device_index: int, device_uuid: str, heartbeat: Heartbeat
    ) -> LoadedModel:
        """Nothing runs until an invoke: the job's program is checked and its bytes held."""
        started = time.monotonic()
        config = SubprocessJobConfig.of(deployment)
        program = self._fill(config.command[0], {"{python}": sys.executable, "{artifact}": deployment.artifact})
        if shutil.which(program) is None and not (config.cwd and Path(config.cwd, program).is_file()):
            raise ModelForgeError(FailureClass.MODEL_LOAD_FAILED, f"job program {program!r} is not found or executable")
        self._configs[key] = config
        self._deployments[key] = deployment
        self._uuids[key] = device_uuid
        pid = os.getpid()
        if device_index != CPU_DEVICE_INDEX and self._devices.simulated_gpus:
            pid = next(_fake_pids)  # the job's bytes on a simulated card, as the simulated runtime records them
            self._devices.allocate(device_index, pid, deployment.resident_bytes, f"modelforge:{key}")
        return LoadedModel(
            key, deployment.deployment_id, device_index, pid, deployment.resident_bytes, time.monotonic() - started
        )

    async def health_check(self, model: LoadedModel) -> None:
        if model.resident_key not in self._configs:
            raise ModelForgeError(FailureClass.HEALTHCHECK_FAILED, f"{model.resident_key} is not loaded")

    @staticmethod
    def _fill(argument: str, values: dict[str, str]) -> str:
        for placeholder, value in values.items():
            argument = argument.replace(placeholder, value)
        return argument

    def _arguments(self, config: SubprocessJobConfig, payload: dict[str, Any]) -> list[str]:
        args = payload.get("args")
        if args is None:
            return []
        if not config.input_args:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, "args: this job takes no arguments (runtime_config.input_args is not set)"
            )
        if (
            not isinstance(args, list)
            or len(args) > MAX_ARGS
            or not all(isinstance(a, str) and len(a) <= 4096 and "\x00" not in a for a in args)
        ):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"args: a list of at most {MAX_ARGS} strings (4,096 characters each)"
            )
        return list(args)

    async def invoke(self, model: LoadedModel, payload: dict[str, Any], heartbeat: Heartbeat) -> dict[str, Any]:
        config = self._configs.get(model.resident_key)
        deployment = self._deployments.get(model.resident_key)
        if config is None or deployment is None:
            raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"{model.resident_key} is not loaded")
        lease_id = str(payload.get("modelforge_lease_id", "")) or f"lease-{next(_fake_pids)}"
        cards = "" if model.device_index == CPU_DEVICE_INDEX else self._uuids.get(model.resident_key, "")
        return await self._run(model.resident_key, lease_id, "", config, deployment, cards, payload, heartbeat, {})

    async def _run(
        self,
        key: str,
        job_key: str,
        part: str,
        config: SubprocessJobConfig,
        deployment: Deployment,
        cards: str,
        payload: dict[str, Any],
        heartbeat: Heartbeat,
        extra_env: dict[str, str],
    ) -> dict[str, Any]:
        """Run one attempt of a job (`part`: "" or a gang rank's "-rank<r>") to its end."""
        request_id = str(payload.get("modelforge_request_id", "")) or job_key
        args = payload.get("args")
        inputs = sorted(
            {
                found.group(1)
                for argument in (args if isinstance(args, list) else [])
                if isinstance(argument, str) and (found := ARTIFACT_ARG.match(argument))
            }
        )
        if not inputs:
            return await self._run_attempt(key, job_key, part, config, deployment, cards, payload, heartbeat, extra_env)
        # The artifacts it takes are in use (`collect_garbage` keeps them) from before they are
        # checked until the request is done with them: kept while it may run again.
        pin = self._store / IN_USE / f"{job_directory_name(request_id)}{part}.json"
        record = {"request_id": request_id, "node": self._node, "artifacts": inputs, "state": "running"}
        await asyncio.to_thread(_write_pin, pin, record)
        final = False
        try:
            output = await self._run_attempt(
                key, job_key, part, config, deployment, cards, payload, heartbeat, extra_env
            )
            final = True
            return output
        except ModelForgeError as error:
            final = error.failure != FailureClass.RUNTIME_CRASH  # RUNTIME_CRASH is retried
            raise
        finally:  # preempted, cancelled or retried: it runs again, with the same inputs
            await asyncio.to_thread(_release_pin, pin, record, final)

    async def _run_attempt(
        self,
        key: str,
        job_key: str,
        part: str,
        config: SubprocessJobConfig,
        deployment: Deployment,
        cards: str,
        payload: dict[str, Any],
        heartbeat: Heartbeat,
        extra_env: dict[str, str],
    ) -> dict[str, Any]:
        """Run one attempt of a job (`part`: "" or a gang rank's "-rank<r>") to its end."""
        lease_id = job_key
        request_id = str(payload.get("modelforge_request_id", "")) or lease_id
        run = (str(payload.get("modelforge_run_id", "")) or "run") + part
        arguments = self._arguments(config, payload)
        extra = await asyncio.to_thread(resolve_artifact_args, self._store, arguments)
        # The store paths its artifact:sha256: arguments became, checked: what a job that
        # confines its path arguments (the examples) may read beside its own directories.
        artifact_inputs = [real for given, real in zip(arguments, extra, strict=True) if ARTIFACT_ARG.match(given)]
        wanted = payload.get("gpu_count")  # `modelforge job submit --gpu-count N`
        if wanted is not None and wanted != deployment.gpu_count:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"gpu_count: the job asks for {str(wanted)[:20]} cards; {deployment.deployment_id} runs on "
                f"{deployment.gpu_count}",
            )
        nvlink = payload.get("nvlink")  # `modelforge job submit --nvlink`
        if nvlink is not None and not isinstance(nvlink, bool):
            raise ModelForgeError(FailureClass.REQUEST_INVALID, "nvlink: true or false")
        if nvlink and not deployment.nvlink_required:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"nvlink: the job asks for cards joined by NVLink, but {deployment.deployment_id} does not require "
                "an NVLink group (its catalog entry has no nvlink_required = true), so its placement does not "
                "promise one; submit without --nvlink or use a deployment that requires NVLink",
            )
        directory = self._root / job_directory_name(request_id) / job_directory_name(run)
        output_dir = directory / "output"
        checkpoint_dir = Path(str(payload.get("modelforge_checkpoint_dir") or directory / "checkpoints"))
        resume = payload.get("modelforge_resume_from")
        resume = resume if isinstance(resume, str) and resume else ""
        time_left = payload.get("modelforge_time_left_s")
        user_input = {k: v for k, v in payload.items() if not k.startswith("modelforge_")}
        job = await asyncio.to_thread(
            self._start_files, directory, output_dir, checkpoint_dir, user_input, lease_id, resume
        )
        values = {
            "{python}": sys.executable,
            "{artifact}": deployment.artifact,
            "{job_id}": request_id,
            "{checkpoint_dir}": str(checkpoint_dir),
            "{output_dir}": str(output_dir),
        }
        argv = [self._fill(argument, values) for argument in config.command] + extra
        # Nothing of ModelForge's own configuration (database URL, API keys, secrets) reaches a job.
        environment = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        environment.update(config.env)
        environment.update(extra_env)
        environment.update(
            CUDA_VISIBLE_DEVICES=cards,
            MODELFORGE_JOB_ID=request_id,
            MODELFORGE_JOB_DIR=str(directory),
            MODELFORGE_ARTIFACT_INPUTS=json.dumps(artifact_inputs),
            MODELFORGE_CHECKPOINT_DIR=str(checkpoint_dir),
            MODELFORGE_OUTPUT_DIR=str(output_dir),
            MODELFORGE_PROGRESS_FILE=str(directory / "progress.jsonl"),
            MODELFORGE_JOB_INPUT=str(directory / "input.json"),
            MODELFORGE_ATTEMPT=str(job["attempt"]["attempt"]),
            PYTHONUNBUFFERED="1",  # progress lines reach the log as they are printed
        )
        if resume:
            environment["MODELFORGE_RESUME_FROM"] = resume
        tag = os.urandom(16).hex()
        environment[JOB_TAG] = tag
        cwd = Path(config.cwd).resolve() if config.cwd else directory
        log_path = directory / "job.log"
        oom_before = _oom_kills()
        started_fd, told_fd = os.pipe()  # the shim writes why the job's exec failed; EOF: it started
        shim = [sys.executable, "-I", "-S", str(JOB_SHIM), str(told_fd)]
        try:
            with _append(log_path) as log_file:
                try:
                    process = await asyncio.create_subprocess_exec(
                        *shim,
                        *argv,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=asyncio.subprocess.STDOUT,
                        env=environment,
                        cwd=cwd,
                        start_new_session=True,
                        pass_fds=(told_fd,),
                        umask=0o077,  # what the job writes (checkpoints, outputs) is its owner's only
                    )
                except OSError as error:
                    raise ModelForgeError(
                        FailureClass.MODEL_LOAD_FAILED, f"cannot start job {argv[0]!r}: {error.strerror or error}"
                    ) from None
        except BaseException:
            os.close(started_fd)
            raise
        finally:
            os.close(told_fd)
        running = _Job(
            key=key,
            lease_id=lease_id,
            request_id=request_id,
            directory=directory,
            checkpoint_dir=checkpoint_dir,
            output_dir=output_dir,
            log_path=log_path,
            process=process,
            config=config,
            attempt=job["attempt"],
            tails=[job["log_tail"], job["progress_tail"]],
            tag=tag,
        )
        running.attempt["pid"] = process.pid
        self._jobs[lease_id] = running
        pid_file = self._root / "running" / f"{job_directory_name(lease_id)}.pid"
        private_dir(pid_file.parent)
        _write_json(pid_file, {"pid": process.pid, "argv": shim + argv, "tag": tag})
        self._save_attempt(running, "running")
        started = time.monotonic()
        deadline = (
            started + max(0.0, float(time_left) - 1.0)
            if isinstance(time_left, int | float) and not isinstance(time_left, bool)
            else None
        )
        try:
            # Known (and stopped by _stop) before this await: a cancel now leaves nothing running.
            failed = await asyncio.to_thread(_read_to_end, started_fd)  # EOF once the job's exec is done
            if failed:
                why = f"cannot start job {argv[0]!r}: {failed.decode(errors='replace')}"
                await process.wait()
                self._save_attempt(running, f"failed: {FailureClass.MODEL_LOAD_FAILED.value}", detail=why)
                raise ModelForgeError(FailureClass.MODEL_LOAD_FAILED, why)
            return await self._watch(running, heartbeat, deadline, oom_before)
        finally:
            await self._stop(running)
            running.pump()
            self._jobs.pop(lease_id, None)
            pid_file.unlink(missing_ok=True)

    def _start_files(
        self,
        directory: Path,
        output_dir: Path,
        checkpoint_dir: Path,
        user_input: dict[str, Any],
        lease_id: str,
        resume: str,
    ) -> dict[str, Any]:
        private_dir(self._root)
        private_dir(directory)
        private_dir(output_dir)
        private_dir(checkpoint_dir)
        _write_json(directory / "input.json", user_input)
        status = self._status(directory)
        attempts = status.setdefault("attempts", [])
        if resume:
            restart = f"resumed from checkpoint {resume}"
        elif attempts:
            restart = "started over from scratch (no checkpoint)"
        else:
            restart = "first run"
        attempt = {
            "attempt": len(attempts) + 1,
            "lease_id": lease_id,
            "node": self._node,
            "started_at": time.time(),
            "resumed_from": resume or None,
            "restart": restart,
            "outcome": "running",
        }
        attempts.append(attempt)
        _write_json(directory / "status.json", status)
        log_path = directory / "job.log"
        with _append(log_path) as log_file:
            log_file.write(
                f"[modelforge] attempt {attempt['attempt']} on {self._node} (lease {lease_id}): {restart}\n".encode()
            )
        # Each attempt reads only what it reports: an earlier attempt's lines (its progress, the
        # checkpoints it named) are not this one's.
        progress = directory / "progress.jsonl"
        return {
            "attempt": attempt,
            "log_tail": _Tail(log_path, offset=log_path.stat().st_size),
            "progress_tail": _Tail(progress, offset=progress.stat().st_size if progress.exists() else 0),
        }

    @staticmethod
    def _status(directory: Path) -> dict[str, Any]:
        try:
            status = json.loads((directory / "status.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {"attempts": []}
        return status if isinstance(status, dict) and isinstance(status.get("attempts"), list) else {"attempts": []}

    def _save_attempt(self, job: _Job, outcome: str, **fields: Any) -> None:
        """Record how this attempt ended (or that it runs) in the job's status file and its log."""
        job.attempt.update(outcome=outcome, **fields)
        if outcome != "running":
            job.attempt["ended_at"] = time.time()
        status = self._status(job.directory)
        attempts = status.setdefault("attempts", [])
        for index, attempt in enumerate(attempts):
            if attempt.get("attempt") == job.attempt["attempt"] and attempt.get("lease_id") == job.lease_id:
                attempts[index] = dict(job.attempt)
                break
        else:
            attempts.append(dict(job.attempt))
        status["state"] = outcome
        status["request_id"] = job.request_id
        status["progress"] = job.progress
        status["message"] = job.message
        with contextlib.suppress(OSError):
            if outcome != "running":  # the log first: a reader that sees the state has every line
                with _append(job.log_path) as log_file:
                    for note in job.notes:  # what it reported that was not taken
                        log_file.write(f"[modelforge] {note}\n".encode())
                    job.notes.clear()
                    said = f"[modelforge] attempt {job.attempt['attempt']} ended: {outcome}"
                    if fields.get("detail"):
                        said += f" ({fields['detail']})"
                    log_file.write((said + "\n").encode())
            _write_json(job.directory / "status.json", status)

    async def _watch(
        self, job: _Job, heartbeat: Heartbeat, deadline: float | None, oom_before: int | None
    ) -> dict[str, Any]:
        process = job.process
        last_beat = 0.0
        while process.returncode is None:
            await _exited(process, POLL_S)
            job.pump()
            now = time.monotonic()
            if job.changed or now - last_beat >= 2.0:
                heartbeat(job.detail())
                job.changed, last_beat = False, now
            if deadline is not None and now >= deadline and process.returncode is None and not job.preempting:
                await self._terminate(job, job.config.stop_grace_s)
                self._save_attempt(job, "timeout", exit_code=process.returncode)
                raise ModelForgeError(
                    FailureClass.TIMEOUT, "the job ran past its max_duration and was stopped" + self._log_tail(job)
                )
        job.pump()
        code = process.returncode
        if code == CHECKPOINTED_EXIT and not job.preempting:
            # Checkpointed before it was asked: a gang's ranks agree to stop together, and this
            # rank may have stopped for a peer whose request came first. Its own request may
            # follow: it is awaited for the grace, while the job stays known (and checkpointable).
            waited = 0.0
            while waited < max(job.config.preempt_grace_s, 10.0) and not job.preempting:
                heartbeat("job checkpointed (exit 75): waiting for its preemption")
                await asyncio.sleep(0.2)
                waited += 0.2
        if job.preempting and code != 0:
            # checkpoint() stopped it for a preemption and records how; the request workflow
            # cancels this invoke next. Until then, keep heartbeating so the cancel arrives.
            waited = 0.0
            while waited < 60.0:
                heartbeat(f"job preempted: {job.attempt.get('outcome', 'stopping')}")
                await asyncio.sleep(0.5)
                waited += 0.5
            raise ModelForgeError(
                FailureClass.RUNTIME_CRASH, "the job was stopped for a preemption that never completed"
            )
        if code == 0:
            outputs = await asyncio.to_thread(_list_outputs, job.output_dir)
            directory = await asyncio.to_thread(
                register_outputs, self._store, job.output_dir, outputs, job.request_id, self._node
            )
            self._save_attempt(job, "succeeded", exit_code=0)
            answer: dict[str, Any] = {
                "job_id": job.request_id,
                "exit_code": 0,
                "output_dir": str(job.output_dir),
                "outputs": outputs,
                "log": str(job.log_path),
                "log_tail": self._log_lines(job),  # the log's end, for `modelforge logs` on any host
                "progress": job.progress,
                "message": job.message,
                "attempts": self._status(job.directory).get("attempts", []),
            }
            if directory is not None:  # the whole output directory as one artifact
                answer["output_artifact"] = f"artifact:sha256:{directory}"
            if job.attempt.get("resumed_from"):
                answer["resumed_from"] = job.attempt["resumed_from"]
            if job.result is not None:
                answer["result"] = job.result
            return answer
        failure, why = self._classify(job, code, oom_before)
        self._save_attempt(job, f"failed: {failure.value}", exit_code=code, detail=why)
        raise ModelForgeError(failure, why + self._log_tail(job))

    def _classify(self, job: _Job, code: int | None, oom_before: int | None) -> tuple[FailureClass, str]:
        """The failure class of a job that ended other than with 0 (docs/RUNTIMES.md's table)."""
        try:
            with job.log_path.open("rb") as stream:
                stream.seek(max(0, job.log_path.stat().st_size - (256 << 10)))
                tail = stream.read()
        except OSError:
            tail = b""
        if OOM_TEXT.search(tail):
            return FailureClass.GPU_OOM, f"the job ran out of GPU memory (exit code {code})"
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            oom_after = _oom_kills()
            if -code == signal.SIGKILL and oom_before is not None and oom_after is not None and oom_after > oom_before:
                return FailureClass.GPU_OOM, "the job was killed by the kernel's OOM killer"
            return FailureClass.RUNTIME_CRASH, f"the job was killed by {name}"
        if code in USAGE_EXITS:
            return FailureClass.REQUEST_INVALID, f"the job refused its arguments (exit code {code})"
        if code == CHECKPOINTED_EXIT:
            return FailureClass.RUNTIME_CRASH, f"the job exited {code} (checkpointed) but no preemption asked it to"
        return FailureClass.RUNTIME_CRASH, f"the job exited with code {code}"

    def _log_lines(self, job: _Job, limit: int = LOG_TAIL_BYTES) -> str:
        """The log's last whole lines within `limit` bytes, as text ("" when it cannot be read)."""
        try:
            with job.log_path.open("rb") as stream:
                size = stream.seek(0, os.SEEK_END)
                stream.seek(max(0, size - limit))
                data = stream.read()
        except OSError:
            return ""
        if size > limit and b"\n" in data:
            data = data[data.index(b"\n") + 1 :]  # from a line's start
        return data.decode("utf-8", errors="replace")

    def _log_tail(self, job: _Job, limit: int = 600) -> str:
        try:
            text = job.log_path.read_bytes()[-limit:].decode("utf-8", errors="replace").strip()
        except OSError:
            return ""
        return f"; job log ({job.log_path}) ends: {text}" if text else f"; job log: {job.log_path}"

    async def _terminate(self, job: _Job, grace_s: float, sig: int = signal.SIGTERM) -> bool:
        """`sig` to the job's session, SIGKILL after `grace_s`; True when it had to be killed."""
        process = job.process
        if process.returncode is not None:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        if await _exited(process, grace_s):
            return False
        await self._kill_processes(job)
        await process.wait()
        return True

    async def _kill_processes(self, job: _Job) -> None:
        """SIGKILL to every process of the job: the shim's tree (detached ones included: the
        shim is their subreaper), whatever carries the job's tag, then the shim's group."""
        leader = job.process.pid if job.process.returncode is None else None  # a pid, not reused
        with contextlib.suppress(asyncio.CancelledError):  # also when its invoke is cancelled
            await asyncio.shield(asyncio.to_thread(kill_job_processes, leader, job.tag))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(job.process.pid, signal.SIGKILL)

    async def _stop(self, job: _Job) -> None:
        """Nothing of a job outlives its invoke: its whole process tree is killed (also when
        cancelled), a grandchild in a session of its own included."""
        if job.process.returncode is None:
            await self._kill_processes(job)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(job.process.wait())
            if job.attempt.get("outcome") == "running":
                self._save_attempt(job, "stopped", detail="its invoke was cancelled")
        # The shim killed what the job left when it ended; anything that escaped it still has the tag.
        await self._kill_processes(job)
        if job.attempt.get("outcome") == "running":
            self._save_attempt(job, "stopped", exit_code=job.process.returncode)

    def supports(self, deployment: Deployment) -> list[str]:
        return ["checkpoint"]

    async def checkpoint(self, model: LoadedModel, payload: dict[str, Any]) -> str:
        """Preemption: the configured signal, `preempt_grace_s` to checkpoint and exit 75, else
        the session is killed. Returns the checkpoint the requeued run resumes from: the one it
        just wrote, or (killed) the last one it announced; CAPABILITY_UNAVAILABLE when there is
        none (the run then starts over from scratch)."""
        lease_id = str(payload.get("lease_id", ""))
        job = self._jobs.get(lease_id)
        if job is None or job.process.returncode not in (None, CHECKPOINTED_EXIT):
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"no job of lease {lease_id!r} is running")
        return await self._preempt(job)

    async def _preempt(self, job: _Job) -> str:
        """The signal (unless it already exited 75 on its own), the grace, and what it saved."""
        job.preempting = True
        config = job.config
        killed = await self._terminate(job, config.preempt_grace_s, config.preempt_signal)
        job.pump()
        code = job.process.returncode
        signal_name = signal.Signals(config.preempt_signal).name
        if code == 0:
            job.preempting = False  # it finished meanwhile: the invoke reports its success
            raise unsupported(self.name, "checkpoint this job", "it finished before it could be checkpointed")
        if code == CHECKPOINTED_EXIT and not killed:
            location = job.checkpoint
            if not location and any(job.checkpoint_dir.iterdir()):
                location = str(Path(os.path.realpath(job.checkpoint_dir)))
            if location:
                self._preempted_as(
                    job,
                    "checkpointed",
                    checkpoint=location,
                    exit_code=code,
                    detail=f"checkpointed on {signal_name} (exit 75) to {location}; resumes from it",
                )
                return location
        # Not checkpointed on request: the last checkpoint it announced, if any, is still whole.
        if killed:
            outcome, why = "killed_after_grace", f"ignored {signal_name} for {config.preempt_grace_s:g} s: killed"
        elif code == CHECKPOINTED_EXIT:
            outcome, why = "checkpointed", "exited 75 but named and wrote no checkpoint"
        else:
            outcome, why = "stopped", f"ended ({_describe_exit(code)}) on {signal_name} without checkpointing"
        if job.checkpoint:
            self._preempted_as(
                job,
                outcome,
                checkpoint=job.checkpoint,
                exit_code=code,
                detail=f"{why}; restarts from its last checkpoint",
            )
            return job.checkpoint
        self._preempted_as(job, outcome, checkpoint=None, exit_code=code, detail=f"{why}; restarts from scratch")
        raise unsupported(self.name, "checkpoint this job", f"it {why}, with no checkpoint; it restarts from scratch")

    def _preempted_as(self, job: _Job, outcome: str, **fields: Any) -> None:
        self._save_attempt(job, outcome, **fields)
        self._preemptions[job.lease_id] = {"outcome": outcome, "request_id": job.request_id, **fields}

    def take_preemption(self, lease_id: str) -> dict[str, Any] | None:
        """How the job of `lease_id` ended on its preemption (outcome, checkpoint, exit code and
        a detail saying whether it resumes from a checkpoint or starts over), once: the node
        records it as a `job_preempted` event."""
        return self._preemptions.pop(lease_id, None)

    async def sleep(self, model: LoadedModel) -> int:
        raise unsupported(self.name, "sleep", "a job holds its memory only while it runs")

    async def wake(self, model: LoadedModel, heartbeat: Heartbeat) -> int:
        raise unsupported(self.name, "wake", "a job holds its memory only while it runs")

    async def run_job(
        self, deployment: Deployment, device_indices: list[int], payload: dict[str, Any], heartbeat: Heartbeat
    ) -> dict[str, Any]:
        """This node's part (`modelforge_rank` of `modelforge_world_size` nodes) of a gang job:
        one process on this node's cards (all of them in CUDA_VISIBLE_DEVICES), given the
        torchrun variables and a rendezvous that rank 0 publishes in the shared checkpoint store."""
        config = SubprocessJobConfig.of(deployment)
        lease_id = str(payload.get("modelforge_lease_id", "")) or f"lease-{next(_fake_pids)}"
        rank = int(payload.get("modelforge_rank", 0))
        world = int(payload.get("modelforge_world_size", 1))
        samples = {d.index: d for d in await asyncio.to_thread(self._devices.sample)}
        cards = ",".join(samples[i].uuid for i in device_indices if i in samples and i != CPU_DEVICE_INDEX)
        address, port = await self._rendezvous(payload, rank, world, heartbeat)
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "NODE_RANK": str(rank),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": address,
            "MASTER_PORT": str(port),
            # torchrun as the command: one worker per card of this node, the nodes rendezvous.
            "PET_NNODES": str(world),
            "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": str(max(1, len(device_indices))),
            "PET_MASTER_ADDR": address,
            "PET_MASTER_PORT": str(port),
        }
        tag = f"modelforge:job:{lease_id}"
        pids: dict[int, int] = {}
        try:
            if self._devices.simulated_gpus:  # the envelope on each simulated card while it runs
                for index in device_indices:
                    if index != CPU_DEVICE_INDEX:
                        pids[index] = next(_fake_pids)
                        self._simulated_pids.add(pids[index])  # managed, never external
                        self._devices.allocate(index, pids[index], deployment.envelope_bytes, tag)
            key = f"{deployment.deployment_id}:{lease_id}"
            output = await self._run(
                key, f"{lease_id}#rank{rank}", f"-rank{rank}", config, deployment, cards, payload, heartbeat, env
            )
        finally:
            for index, pid in pids.items():
                self._devices.free(index, pid, tag)
                self._simulated_pids.discard(pid)
        return {**output, "rank": rank, "world_size": world}

    async def _rendezvous(
        self, payload: dict[str, Any], rank: int, world: int, heartbeat: Heartbeat
    ) -> tuple[str, int]:
        """MASTER_ADDR and MASTER_PORT of a gang: rank 0's node address (MODELFORGE_NODE_ADDRESS
        of its worker, 127.0.0.1 by default) and a port free there, written by rank 0 into the
        checkpoint store (shared by the nodes of a cluster) and read there by the other ranks."""
        address = os.environ.get("MODELFORGE_NODE_ADDRESS", "127.0.0.1")
        place = payload.get("modelforge_rendezvous")
        if world <= 1 and not place:
            return address, free_port(address)
        if not isinstance(place, str) or not place:
            raise unsupported(self.name, "run a multi-node job", "this node has no checkpoint store for its rendezvous")
        path = Path(place)
        if rank == 0:
            port = free_port(address)
            private_dir(path.parent)
            _write_json(path, {"address": address, "port": port})
            return address, port
        for waited in range(1200):  # up to 120 s for rank 0 to start
            try:
                found = json.loads(path.read_text(encoding="utf-8"))
                return str(found["address"]), int(found["port"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
            if waited % 20 == 0:
                heartbeat(f"rank {rank}: waiting for rank 0's rendezvous")
            await asyncio.sleep(0.1)
        raise ModelForgeError(FailureClass.TIMEOUT, f"rank {rank}: rank 0 published no rendezvous within 120 s")

    async def checkpoint_job(self, lease_id: str, rank: int, destination: str) -> str:
        """Preempt this node's part of a gang job as `checkpoint` does a job: the signal, the
        grace, its checkpoint (or its last announced one) or none."""
        job = self._jobs.get(f"{lease_id}#rank{rank}")
        if job is None or job.process.returncode not in (None, CHECKPOINTED_EXIT):
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"no job of lease {lease_id!r} rank {rank} is running")
        return await self._preempt(job)

    async def unload(self, model: LoadedModel) -> None:
        for job in [j for j in self._jobs.values() if j.key == model.resident_key]:
            await self._terminate(job, 0)
        self._configs.pop(model.resident_key, None)
        self._deployments.pop(model.resident_key, None)
        self._uuids.pop(model.resident_key, None)
        if model.device_index != CPU_DEVICE_INDEX and self._devices.simulated_gpus:
            self._devices.free(model.device_index, model.pid, f"modelforge:{model.resident_key}")

    async def close(self) -> None:
        """Stop every running job (the node worker is shutting down)."""
        for job in list(self._jobs.values()):
            await self._terminate(job, 0)

    def reap_orphans(self) -> list[int]:
        """Kill jobs a previous run of this node worker started and never stopped (it was
        killed), found by their pid files: the job's shim, checked against the command it ran,
        with its whole tree, and every process carrying the attempt's tag (a detached grandchild
        whose shim is gone too)."""
        reaped: list[int] = []
        running_dir = self._root / "running"
        if not running_dir.is_dir():
            return reaped
        for pid_file in sorted(running_dir.glob("*.pid")):
            tag = ""
            try:
                record = json.loads(pid_file.read_text(encoding="utf-8"))
                tag = str(record.get("tag") or "")
                pid, argv = int(record["pid"]), [str(a) for a in record["argv"]]
                running = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[:-1]
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                running, pid, argv = [], 0, []
            leader = pid if pid and [a.decode(errors="replace") for a in running] == argv and alive(pid) else None
            reaped.extend(kill_job_processes(leader, tag))
            if leader is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(leader, signal.SIGKILL)
                reaped.insert(0, leader)
            pid_file.unlink(missing_ok=True)
        return reaped


def _read_to_end(fd: int) -> bytes:
    """What is written to `fd` until its writers close it; `fd` is closed here, by its reader
    (an invoke cancelled meanwhile does not close it under the reading thread)."""
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def tagged_processes(tag: str) -> set[int]:
    """The live processes whose environment (as they were started) holds JOB_TAG=`tag`: a
    128-bit random value per attempt, so a match is the job's and never another's."""
    if not tag:
        return set()
    wanted = f"{JOB_TAG}={tag}".encode()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if wanted in environ.split(b"\0"):
            found.add(int(entry.name))
    return found


def kill_job_processes(leader: int | None, tag: str, within_s: float = 5.0) -> list[int]:
    """SIGKILL every live process of a job but its shim (`leader`, None when it is gone): the
    shim's descendants and every process with the job's tag, again until none is left (one may
    fork while it is being killed); the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + within_s
    while True:
        found = tagged_processes(tag)
        if leader is not None and alive(leader):
            found |= process_tree(leader)
        victims = sorted(pid for pid in found - {leader, os.getpid()} if alive(pid))
        if not victims or time.monotonic() > deadline:
            return killed
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed.extend(pid for pid in victims if pid not in killed)
        time.sleep(0.01)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
    return f"exit code {code}"


async def _exited(process: asyncio.subprocess.Process, timeout: float) -> bool:
    """Whether the process ends within `timeout`. Not asyncio.wait_for: on Python 3.11 it loses
    a cancellation that lands as the process exits, and a preempted invoke must hear its cancel."""
    if process.returncode is not None:
        return True
    waiter = asyncio.ensure_future(process.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        if not waiter.done():
            waiter.cancel()
    return process.returncode is not None


def _list_outputs(output_dir: Path) -> list[dict[str, Any]]:
    """The job's output files with their sizes and sha256 digests (the first MAX_OUTPUT_FILES)."""
    found: list[dict[str, Any]] = []
    for path in sorted(p for p in output_dir.rglob("*") if p.is_file() and not p.is_symlink()):
        if len(found) >= MAX_OUTPUT_FILES:
            break
        digest = hashlib.sha256()
        with path.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
        found.append(
            {"path": str(path.relative_to(output_dir)), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}
        )
    return found


ARTIFACT_ARG = re.compile(r"^artifact:sha256:([0-9a-f]{64})$")


IN_USE = "in-use"  # <store>/in-use/<request>.json: the artifacts a job takes as input
# A job that may run again (preempted, retried) keeps its inputs this long after it last ran:
# the longest lease a request may ask for (7 days).
IN_USE_WAITING_S = 7 * 24 * 3600.0


def artifact_store(home: Path, configured: Path | None = None) -> Path:
    """Where jobs' outputs are kept by content, `<store>/sha256/<digest>`: the configured store
    (MODELFORGE_ARTIFACT_STORE), else `<home>/artifacts/store`."""
    return configured if configured is not None else home / "artifacts" / "store"


def _write_pin(pin: Path, record: dict[str, Any]) -> None:
    pin.parent.mkdir(parents=True, exist_ok=True)
    aside = pin.with_name(f".{pin.name}.{os.urandom(6).hex()}.tmp")
    aside.write_text(json.dumps({**record, "at": time.time()}), encoding="utf-8")
    aside.replace(pin)


def _release_pin(pin: Path, record: dict[str, Any], final: bool) -> None:
    """The request is done with its inputs (removed), or may run again (kept, `waiting`)."""
    with contextlib.suppress(OSError):
        if final:
            pin.unlink(missing_ok=True)
        else:
            _write_pin(pin, {**record, "state": "waiting"})


def artifacts_in_use(store: Path, now: float | None = None) -> dict[str, list[str]]:
    """The artifacts jobs take as input, by digest, with the requests that take them: a job
    running now on any node that writes to this store, or one that may run again (preempted or
    retried, for IN_USE_WAITING_S after it last ran). A job still queued for its first attempt
    is not known here."""
    now = time.time() if now is None else now
    found: dict[str, list[str]] = {}
    for pin in sorted((store / IN_USE).glob("*.json")):
        try:
            record = json.loads(pin.read_text(encoding="utf-8"))
            digests, request_id = [str(d) for d in record["artifacts"]], str(record["request_id"])
            stale = record.get("state") != "running" and now - float(record["at"]) > IN_USE_WAITING_S
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not stale:
            for digest in digests:
                found.setdefault(digest, []).append(request_id)
    return found


def collect_garbage(
    store: Path, older_than_s: float, *, dry_run: bool = False, now: float | None = None
) -> dict[str, Any]:
    """Delete the artifacts last registered more than `older_than_s` ago, except those a job
    takes as input (`artifacts_in_use`). Each deletion is a tombstone line appended to
    `index.jsonl` (append-only: a node registering an output meanwhile loses nothing), and
    writers' leftovers (`.*.tmp` aside files) of that age go too. Returns what was deleted and
    what was kept because a job uses it."""
    now = time.time() if now is None else now
    in_use = artifacts_in_use(store, now)
    deleted: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    tombstones: list[str] = []
    for row in artifact_rows(store):
        at = row.get("at")
        if not row["present"] or not isinstance(at, int | float) or now - float(at) <= older_than_s:
            continue
        digest = row["artifact"].removeprefix("artifact:sha256:")
        summary = {"artifact": row["artifact"], "kind": row["kind"], "bytes": row["bytes"], "at": at}
        if digest in in_use:
            kept.append({**summary, "in_use_by": in_use[digest]})
            continue
        deleted.append(summary)
        if dry_run:
            continue
        path = store / "sha256" / digest
        if path.is_dir() and not path.is_symlink():
            _writable(path)
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        tombstones.append(json.dumps({"sha256": digest, "deleted": True, "at": now}))
    if tombstones:
        with (store / "index.jsonl").open("a", encoding="utf-8") as index:
            index.write("\n".join(tombstones) + "\n")
    if not dry_run:
        for leftover in (store / "sha256").glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - leftover.lstat().st_mtime > older_than_s:
                    if leftover.is_dir() and not leftover.is_symlink():
                        _writable(leftover)
                        shutil.rmtree(leftover, ignore_errors=True)
                    else:
                        leftover.unlink()
    return {
        "deleted": deleted,
        "kept_in_use": kept,
        "bytes_freed": sum(int(d["bytes"] or 0) for d in deleted),
        "dry_run": dry_run,
    }


def register_outputs(
    store: Path, output_dir: Path, outputs: list[dict[str, Any]], request_id: str, node: str
) -> str | None:
    """Keep each output file in the store under its sha256 (read-only, written aside and renamed
    into place; one already there is kept), note who made it in `index.jsonl`, and name the
    artifact in the output's entry (`artifact:sha256:<digest>`, what a later job's args take).
    The whole output directory is kept too, as one artifact (`store_directory`); returns its
    digest, or None when there is no output or more files than the answer lists."""
    content = store / "sha256"
    content.mkdir(parents=True, exist_ok=True)
    lines = []
    now = time.time()
    for entry in outputs:
        target = content / entry["sha256"]
        if not target.exists():
            aside = content / f".{entry['sha256']}.{os.urandom(6).hex()}.tmp"  # never another writer's
            shutil.copyfile(output_dir / entry["path"], aside)
            aside.chmod(0o444)
            aside.replace(target)
        entry["artifact"] = f"artifact:sha256:{entry['sha256']}"
        lines.append(
            json.dumps(
                {
                    "sha256": entry["sha256"],
                    "bytes": entry["bytes"],
                    "path": entry["path"],
                    "request_id": request_id,
                    "node": node,
                    "at": now,
                }
            )
        )
    listed = sum(1 for p in output_dir.rglob("*") if p.is_file() and not p.is_symlink())
    directory = store_directory(store, outputs) if outputs and listed == len(outputs) else None
    if directory is not None:
        lines.append(
            json.dumps(
                {
                    "sha256": directory,
                    "bytes": sum(int(entry["bytes"]) for entry in outputs),
                    "path": "./",
                    "kind": "directory",
                    "files": len(outputs),
                    "request_id": request_id,
                    "node": node,
                    "at": now,
                }
            )
        )
    if lines:
        with (store / "index.jsonl").open("a", encoding="utf-8") as index:
            index.write("\n".join(lines) + "\n")
    return directory


def _writable(path: Path) -> None:
    """Make a stored directory artifact's folders writable again, so it can be removed."""
    for folder in [path, *(p for p in path.rglob("*") if p.is_dir() and not p.is_symlink())]:
        with contextlib.suppress(OSError):
            folder.chmod(0o755)


def store_directory(store: Path, outputs: list[dict[str, Any]]) -> str:
    """The output files (already in the store by content) as one directory artifact,
    `<store>/sha256/<digest>/<relative path>...`, its digest the one a deployment's
    `artifact_sha256` checks for a model directory (sha256 over each file's relative path and
    digest, sorted: `artifact_digest`). Its files are links to the stored files (copies where
    the filesystem has no links), read-only, its folders closed to writing; assembled aside and
    renamed into place, so a reader never sees half of it; one already there is kept."""
    content = store / "sha256"
    aside = content / f".dir.{os.urandom(6).hex()}.tmp"
    try:
        for entry in outputs:
            target = aside / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(content / entry["sha256"], target)
            except OSError:
                shutil.copyfile(content / entry["sha256"], target)
                target.chmod(0o444)
        digest = artifact_digest(aside)
        final = content / digest
        if not final.exists():
            for folder in sorted((p for p in aside.rglob("*") if p.is_dir()), reverse=True):
                folder.chmod(0o555)
            aside.chmod(0o555)
            try:
                aside.replace(final)
            except OSError:  # another writer put the same directory there first
                if not final.is_dir():
                    raise
        return digest
    finally:
        if aside.exists():
            _writable(aside)
            shutil.rmtree(aside, ignore_errors=True)


def verified_artifact(store: Path, argument: str) -> Path:
    """The store's file or directory an `artifact:sha256:<digest>` names, after hashing it again
    (its files read from descriptors, no link followed out of the store): ARTIFACT_CORRUPT when
    its bytes no longer hash to the digest, REQUEST_INVALID for a digest the store does not hold."""
    found = ARTIFACT_ARG.match(argument.strip())
    if found is None:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, f"{argument[:100]!r} is not artifact:sha256:<64 hex digits>"
        )
    path = store / "sha256" / found.group(1)
    if not os.path.lexists(path):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{argument}: no such artifact in {store}")
    try:
        checked = check_artifact(str(path), [store], found.group(1))
    except ModelForgeError as error:
        if error.failure == FailureClass.ARTIFACT_CORRUPT:
            raise ModelForgeError(
                FailureClass.ARTIFACT_CORRUPT,
                f"{argument}: {path} no longer has that digest (changed on disk: {error.message})",
            ) from None
        raise
    return checked.path


def resolve_artifact_args(store: Path, args: list[str]) -> list[str]:
    """`artifact:sha256:<digest>` arguments as the store's file or directory, verified: its bytes
    must still hash to the digest (ARTIFACT_CORRUPT otherwise); an unknown one is REQUEST_INVALID."""
    return [str(verified_artifact(store, a)) if ARTIFACT_ARG.match(a) else a for a in args]


def artifact_rows(store: Path) -> list[dict[str, Any]]:
    """The store's artifacts (newest first): digest, kind (file or directory), size, the outputs
    and requests that made it."""
    rows: dict[str, dict[str, Any]] = {}
    try:
        lines = (store / "index.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
            digest = str(entry["sha256"])
        except (ValueError, KeyError, TypeError):
            continue
        if entry.get("deleted"):  # collected (`collect_garbage`): what came before is gone
            rows.pop(digest, None)
            continue
        row = rows.setdefault(
            digest,
            {
                "artifact": f"artifact:sha256:{digest}",
                "kind": "directory" if entry.get("kind") == "directory" else "file",
                "bytes": entry.get("bytes"),
                "paths": [],
                "requests": [],
            },
        )
        if row["kind"] == "directory":
            row["files"] = entry.get("files")
        row["at"] = entry.get("at")
        for name, value in (("paths", entry.get("path")), ("requests", entry.get("request_id"))):
            if value not in row[name]:
                row[name].append(value)
        row["file"] = str(store / "sha256" / digest)
        stored = store / "sha256" / digest
        row["present"] = stored.is_dir() if row["kind"] == "directory" else stored.is_file()
    return sorted(rows.values(), key=lambda row: float(row.get("at") or 0), reverse=True)


def job_log_dirs(home: Path, request_id: str) -> list[Path]:
    """A request's job directories on this host (every node, every run), newest last."""
    name = job_directory_name(request_id)
    found = [d for d in (home / "jobs").glob(f"*/{name}/*") if (d / "job.log").is_file()]
    return sorted(found, key=lambda d: (d / "job.log").stat().st_mtime)


__all__ = [
    "CHECKPOINTED_EXIT",
    "SubprocessJobConfig",
    "SubprocessJobRuntime",
    "artifact_rows",
    "artifact_store",
    "artifacts_in_use",
    "collect_garbage",
    "job_directory_name",
    "job_log_dirs",
]
