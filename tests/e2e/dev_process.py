"""`modelforge dev` run as a user runs it, in a process of its own, and the CLI beside it. A helper
module: the end-to-end tests import it, never each other."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tests.worker_process import free_port

MODELFORGE = [sys.executable, "-m", "modelforge"]


class Dev:
    def __init__(self, home: Path, *, ignore_sigint: bool = False, args: tuple[str, ...] = ()) -> None:
        self.home = home
        self.args = args  # more of `modelforge dev`'s options (--catalog)
        self.env = {
            **os.environ,
            "MODELFORGE_HOME": str(home),
            "MODELFORGE_TEMPORAL_ADDRESS": f"127.0.0.1:{free_port()}",
            "MODELFORGE_GPU_BACKEND": "simulated",
            # Ports of its own: stacks of tests run side by side (./scripts/test) would share the
            # defaults (the control worker's metrics port 9464 is taken: it exits and restarts).
            "MODELFORGE_METRICS_PORT": str(free_port()),
            "MODELFORGE_TEMPORAL_HTTP_ADDRESS": f"127.0.0.1:{free_port()}",
            "MODELFORGE_TEMPORAL_METRICS_ADDRESS": "off",
        }
        self.env.pop("MODELFORGE_DATABASE_URL", None)
        self.ui_port = free_port()
        # As a shell that ignores SIGINT (a background job, nohup) starts it: SIG_IGN inherited.
        self.ignore_sigint = ignore_sigint
        self.process: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self._up = threading.Event()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.output.append(line)
            if "ModelForge is up" in line:
                self._up.set()

    def start(self, timeout_s: float = 120.0) -> None:
        self._up.clear()
        self.process = subprocess.Popen(
            [*MODELFORGE, "dev", "--ui-port", str(self.ui_port), *self.args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: the teardown can always kill it
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if self.ignore_sigint else None,
        )
        self._reader = threading.Thread(target=self._read, args=(self.process,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while not self._up.wait(0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                # Nothing left behind for the tests after it: its processes, and its output's pipe
                # (left open, it failed an unrelated later test of this worker as a ResourceWarning).
                self.kill_everything()
                raise AssertionError("modelforge dev did not come up:\n" + "".join(self.output))

    def stop(self, sig: int = signal.SIGINT) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=90)  # dev.py's graces add up to 75 s at most
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGUSR1)  # dev's stacks, by faulthandler
            time.sleep(2)
            raise AssertionError("modelforge dev did not stop in 90 s:\n" + "".join(self.output)) from None
        self._close()
        return code

    def _close(self) -> None:
        assert self.process is not None
        self._reader.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None

    def kill_everything(self) -> None:
        """Whatever a failed test left running: `dev` itself, the children it recorded (each
        in a session of its own) and the embedded Postgres."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            self._close()
        pids = [path.read_text() for path in (self.home / "run").glob("*.pid")]
        postmaster = self.home / "pgdata" / "postmaster.pid"
        for text in pids:
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                os.killpg(int(text.strip()), signal.SIGKILL)
        if postmaster.exists():
            with contextlib.suppress(ValueError, IndexError, ProcessLookupError, PermissionError):
                os.kill(int(postmaster.read_text().splitlines()[0]), signal.SIGQUIT)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*MODELFORGE, *args], env=self.env, capture_output=True, text=True, timeout=120)

    def json(self, *args: str) -> object:
        done = self.cli(*args, "--json")
        assert done.returncode == 0, f"{args}: {done.stderr}{done.stdout}"
        return json.loads(done.stdout)


@contextlib.contextmanager
def running(home: Path, *, ignore_sigint: bool = False, args: tuple[str, ...] = ()) -> Iterator[Dev]:
    """A started stack, stopped with SIGINT when the test is done and killed if that fails or
    the test failed before: a test never leaks a stack (ports, the metrics port, Postgres)."""
    stack = Dev(home, ignore_sigint=ignore_sigint, args=args)
    try:
        stack.start()
        yield stack
        if stack.process is not None:
            stack.stop()
    finally:
        stack.kill_everything()
