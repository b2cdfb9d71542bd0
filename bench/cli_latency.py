"""The wall time of a short CLI command, side by side on one stack: `temporal workflow describe` of
the scheduler (the Temporal CLI, Go, the yardstick), `modelforge status --json` and a warm
`modelforge request rag.embedding@1 --json`, each by the fast path (Temporal's HTTP API,
modelforge/_fastcli.py) and by the SDK path (MODELFORGE_TEMPORAL_HTTP_ADDRESS=off), and
`status --json` again from a shell with the workers' settings exported (the fast path leaves
them aside). Rounds
alternate the commands so load drifts alike; medians and minimums, each fast path's ratio to
`describe`, and PASS/MISS against the 2x target.

    python -m bench.cli_latency                 # its own `modelforge dev` in a temporary home
    python -m bench.cli_latency --rounds 10
    python -m bench.cli_latency --home ~/.modelforge --address localhost:7233   # a running stack

The fast request after the first starts from the route the fast path remembered (for 30 s after
it asked for the pools, modelforge/_fastcli.py). The commands inherit the environment: with
PYTHONDONTWRITEBYTECODE=1 each compiles its modules from source; `env -u PYTHONDONTWRITEBYTECODE
PYTHONPYCACHEPREFIX=/tmp/pyc` times them as an installed CLI, with bytecode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TARGET = 2.0
BIN = Path(sys.executable).parent
REQUEST = ["request", "rag.embedding@1", "--tenant", "rag", "--input", '{"text": "a warm one"}', "--json"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _modelforge() -> list[str]:
    script = BIN / "modelforge"
    return [str(script)] if script.exists() else [sys.executable, "-m", "modelforge"]


def _start_dev(home: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    process = subprocess.Popen(  # noqa: S603 (an argument list of our own)
        [*_modelforge(), "dev", "--ui-port", str(_free_port())],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    up = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "ModelForge is up" in line:
                up.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 180
    while not up.wait(0.5):
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise SystemExit("modelforge dev did not come up:\n" + "".join(lines))
    return process


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run(  # noqa: S603 (an argument list of our own)
        argv,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return took, done.stdout


# Settings an operator exports for the workers (modelforge/settings.py); the CLI does not read them.
WORKER_SETTINGS = {
    "MODELFORGE_METRICS_PORT": "9464",
    "MODELFORGE_METRICS_HOST": "0.0.0.0",
    "MODELFORGE_DELEGATION_SYNC_S": "2",
    "MODELFORGE_SNAPSHOT_RETENTION_DAYS": "14",
    "MODELFORGE_LOG_LEVEL": "info",
    "MODELFORGE_GATEWAY_OPERATORS": "ops",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--home", type=Path, help="MODELFORGE_HOME of a running `modelforge dev`")
    parser.add_argument("--address", help="its MODELFORGE_TEMPORAL_ADDRESS")
    options = parser.parse_args()

    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    process = None
    scratch = None
    if options.home is None:
        scratch = Path(tempfile.mkdtemp(prefix="mf-cli-latency-"))
        env |= {
            "MODELFORGE_HOME": str(scratch),
            "MODELFORGE_TEMPORAL_ADDRESS": f"127.0.0.1:{_free_port()}",
            "MODELFORGE_GPU_BACKEND": "simulated",
        }
        dev_env = env | {
            "MODELFORGE_TEMPORAL_HTTP_ADDRESS": f"127.0.0.1:{_free_port()}",
            "MODELFORGE_METRICS_PORT": str(_free_port()),
            "MODELFORGE_TEMPORAL_METRICS_ADDRESS": "off",
        }
        print(f"starting modelforge dev in {scratch} ...", flush=True)
        process = _start_dev(scratch, dev_env)
    else:
        env["MODELFORGE_HOME"] = str(options.home)
        if options.address:
            env["MODELFORGE_TEMPORAL_ADDRESS"] = options.address
    address = env.get("MODELFORGE_TEMPORAL_ADDRESS", "localhost:7233")
    sdk_env = env | {"MODELFORGE_TEMPORAL_HTTP_ADDRESS": "off"}
    # A shell an operator also starts the workers from: their settings exported.
    worker_env = env | WORKER_SETTINGS
    temporal = shutil.which("temporal", path=str(BIN)) or "temporal"
    commands = {
        "temporal workflow describe": (
            [temporal, "workflow", "describe", "--address", address, "-w", "scheduler:default"],
            env,
        ),
        "status --json (fast)": ([*_modelforge(), "status", "--json"], env),
        "request --json (fast)": ([*_modelforge(), *REQUEST], env),
        "status --json (worker env)": ([*_modelforge(), "status", "--json"], worker_env),
        "status --json (SDK)": ([*_modelforge(), "status", "--json"], sdk_env),
        "request --json (SDK)": ([*_modelforge(), *REQUEST], sdk_env),
    }
    try:
        _timed(commands["request --json (SDK)"][0], sdk_env)  # the model loads: later ones are warm
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(options.rounds):
            for name, (argv, command_env) in commands.items():
                times[name].append(_timed(argv, command_env)[0])
    finally:
        if process is not None:
            _stop(process)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    base = statistics.median(times["temporal workflow describe"])
    print(f"\n{options.rounds} rounds on one stack ({address}); wall time of each command, ms\n")
    print(f"{'command':30} {'median':>8} {'min':>8} {'x describe':>11}  target 2x")
    for name, values in times.items():
        median = statistics.median(values)
        ratio = median / base
        verdict = "" if name.startswith("temporal") else ("PASS" if ratio <= TARGET else "MISS")
        if name.endswith("(SDK)"):
            verdict = f"({verdict.lower()}, reference)"
        print(f"{name:30} {median * 1000:8.1f} {min(values) * 1000:8.1f} {ratio:10.2f}x  {verdict}")


if __name__ == "__main__":
    main()
