"""`modelforge status --builds` and `modelforge upgrade` on the embedded stack as a user runs it
(`modelforge dev`, Worker Versioning on by default; tests/workflow/test_upgrade.py runs an upgrade
between two builds with work in flight)."""

from __future__ import annotations

from pathlib import Path

import pytest

import modelforge
from tests.e2e.dev_process import running

pytestmark = pytest.mark.e2e


def test_status_shows_each_build_and_upgrade_moves_the_long_lived_workflows(tmp_path: Path) -> None:
    version = modelforge.__version__
    with running(tmp_path / "home") as dev:
        view = dev.json("status", "--builds")
        assert isinstance(view, dict)
        # The first control worker made its build current; every long-lived workflow runs on it.
        assert view["current"] == version and view["deployment"] == "modelforge"
        assert view["workflows"]["scheduler:default"] == version
        assert view["workflows"]["telemetry:gpu-node"] == version
        # The control worker's queues are versioned; the node worker only reports its build.
        assert f"{version} (versioned)" in view["workers"]["modelforge-control"]
        assert f"{version} (versioned)" in view["workers"]["modelforge-scheduler"]
        assert view["workers"]["modelforge-node-gpu-node"] == [f"{version} (unversioned)"]

        before = dev.json("status")
        moved = dev.json("upgrade")
        assert isinstance(moved, dict) and moved["current"] == version
        assert {"scheduler:default", "telemetry:gpu-node", "telemetry:desktop"} <= set(moved["moved"])
        assert set(moved["moved"].values()) == {version}
        # The same build: no loaded model's residency run has anywhere to move.
        assert moved["residents_moved"] == [] and moved["residents_staying"] == []
        # The scheduler continued as new with its state: the pool looks the same after.
        after = dev.json("status")
        assert isinstance(before, dict) and isinstance(after, dict)
        assert [a["id"] for a in after["accelerators"]] == [a["id"] for a in before["accelerators"]]

        # A build no worker runs cannot be made current: a typed error, not a traceback.
        refused = dev.cli("upgrade", "--build-id", "9.9.9")
        assert refused.returncode != 0
        assert "CAPABILITY_UNAVAILABLE" in refused.stderr and "Traceback" not in refused.stderr
