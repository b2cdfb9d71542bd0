"""A job's whole process tree ends with the job: a grandchild that
double-forks and calls setsid() (a session of its own, out of the job's process group) used to
outlive the job and its lease, still holding the card's CUDA_VISIBLE_DEVICES. Every job now runs
under a subreaper shim and carries a random tag in its environment; the node kills both what the
shim holds and what carries the tag, and the orphan reaper of a restarted node worker does too."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelforge.domain import GiB
from modelforge.gpu import HostMemoryDevice, NodeDevices, SimulatedGpuBackend
from modelforge.runtimes import SubprocessJobRuntime
from modelforge.runtimes._process import alive
from modelforge.runtimes._subprocess_job import JOB_TAG
from tests.runtimes.jobs import UUID, Node, job, python

# The job forks a child that calls setsid() and forks the grandchild, which writes its pid and
# environment and sleeps; the child exits at once, so the grandchild is nobody's in the job's
# tree but the shim's (re-parented to it), in a session and process group of its own.
DETACHING_JOB = """
import json, os, sys, time
where = sys.argv[1]
job_sid = os.getsid(0)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(where + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "sid": os.getsid(0), "job_sid": job_sid,
                       "cards": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
        os.rename(where + ".tmp", where)
        time.sleep(600)
    os._exit(0)
os.wait()
while not os.path.exists(where):
    time.sleep(0.01)
print(json.dumps({"progress": 0.5, "message": "detached"}), flush=True)
if sys.argv[2] == "stay":
    time.sleep(600)
"""


async def _grandchild(where: Path, within_s: float = 20.0) -> dict[str, int | str]:
    for _ in range(int(within_s * 20)):
        if where.exists():
            found: dict[str, int | str] = json.loads(where.read_text())
            return found
        await asyncio.sleep(0.05)
    raise AssertionError("the job's grandchild never started")


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def grandchildren() -> Iterator[list[int]]:
    """Pids to kill whatever the test's outcome (it checks they are gone: before the fix they were not)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, 9)


async def test_a_grandchild_that_calls_setsid_ends_with_the_job(
    node: Node, tmp_path: Path, grandchildren: list[int]
) -> None:
    where = tmp_path / "grandchild.json"
    await node.load(job(python(DETACHING_JOB)), key="merge.job@1@n/0")
    output = await node.invoke("detached-ends", {"args": [str(where), "end"]}, key="merge.job@1@n/0")
    assert output["exit_code"] == 0
    grandchild = await _grandchild(where)
    pid = int(grandchild["pid"])
    grandchildren.append(pid)
    assert grandchild["sid"] != grandchild["job_sid"] and grandchild["cards"] == UUID  # out of its session, on the card
    assert _gone(pid), "the job's setsid() grandchild outlived the job and its lease"
    assert not node.runtime.running_pids()


async def test_a_grandchild_that_calls_setsid_ends_when_the_job_is_cancelled(
    node: Node, tmp_path: Path, grandchildren: list[int]
) -> None:
    where = tmp_path / "grandchild.json"
    await node.load(job(python(DETACHING_JOB)))
    environment = node.env()
    invoke = asyncio.ensure_future(node.invoke("detached-cancelled", {"args": [str(where), "stay"]}, env=environment))
    grandchild = await _grandchild(where)
    pid = int(grandchild["pid"])
    grandchildren.append(pid)
    # While it runs the grandchild is the job's (its NVML bytes are managed, not external).
    deadline = time.monotonic() + 5
    while pid not in node.runtime.running_pids() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert pid in node.runtime.running_pids()
    environment.cancel()  # as the request workflow cancels the invoke (a preemption, the client gone)
    with pytest.raises(asyncio.CancelledError):
        await invoke
    assert _gone(pid), "the cancelled job's setsid() grandchild outlived it"


def test_a_restarted_node_worker_reaps_a_detached_grandchild_whose_job_is_gone(tmp_path: Path) -> None:
    devices = NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice("n", 8 * GiB))
    runtime = SubprocessJobRuntime(devices, tmp_path, "n")
    # What a killed worker (and a dead shim) leave: the job's detached grandchild, carrying the
    # attempt's tag, and the pid file naming the shim, long gone.
    tag = os.urandom(16).hex()
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True, env={**os.environ, JOB_TAG: tag}
    )
    stranger = subprocess.Popen(  # another attempt's tag: never this one's to kill
        [sys.executable, "-c", "import time; time.sleep(600)"],
        start_new_session=True,
        env={**os.environ, JOB_TAG: os.urandom(16).hex()},
    )
    try:
        running = runtime.jobs_dir / "running"
        running.mkdir(parents=True)
        (running / "lease-1.pid").write_text(json.dumps({"pid": 1, "argv": ["gone"], "tag": tag}))
        assert SubprocessJobRuntime(devices, tmp_path, "n").reap_orphans() == [orphan.pid]
        assert orphan.wait(timeout=10) == -9
        assert stranger.poll() is None
        assert list(running.iterdir()) == []
    finally:
        for process in (orphan, stranger):
            process.kill()
            process.wait()
