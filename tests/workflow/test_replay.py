"""A release's recorded histories replay against the workflow code (docs/RELEASING.md).

tests/histories/<version>/ holds the histories one release's workflows write, every workflow type,
recorded by `python -m tests.workflow.record_histories` (tests/workflow/record_histories.py).

- The set of the version in pyproject.toml (the release being prepared, or the last one) must
  replay: until its tag it is re-recorded after a change to a workflow (`--replace`), never
  patched; once tagged it is never rewritten.
- The set of every older release still supported must replay too, through the patches written
  at release time. On main between releases the workflows change without patches (main is not a
  release): an older set that no longer replays is reported as an expected failure there, and
  fails the release check (MODELFORGE_RELEASE_CHECK=1, run when a release is cut)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workers.control import workflow_runner
from workflows import ALL_WORKFLOWS

ROOT = Path(__file__).resolve().parents[1] / "histories"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
CURRENT: str = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
RELEASE_CHECK = os.environ.get("MODELFORGE_RELEASE_CHECK") == "1"


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split("."))


# One folder per release, oldest first ("0.10.0" after "0.9.0").
RELEASES = sorted(
    (path.name for path in ROOT.iterdir() if path.is_dir() and not path.name.startswith(".")), key=_version_key
)
OLDER = [version for version in RELEASES if _version_key(version) < _version_key(CURRENT)]
HISTORIES = sorted(path for version in RELEASES for path in (ROOT / version).glob("*.json"))
ALL_TYPES = {w.__temporal_workflow_definition.name for w in ALL_WORKFLOWS}  # type: ignore[attr-defined]


def _types(version: str) -> set[str]:
    types = set()
    for path in (ROOT / version).glob("*.json"):
        history = WorkflowHistory.from_json(path.stem, path.read_text())
        types.add(history.events[0].workflow_execution_started_event_attributes.workflow_type.name)
    return types


def test_the_current_version_has_a_set_with_every_workflow_type() -> None:
    # Record it (tests/workflow/record_histories.py) when a workflow type is added.
    assert CURRENT in RELEASES, f"no tests/histories/{CURRENT}/: record it (tests/workflow/record_histories.py)"
    assert _types(CURRENT) == ALL_TYPES


@pytest.mark.parametrize("version", RELEASES)
def test_every_recorded_type_still_exists(version: str) -> None:
    assert _types(version) <= ALL_TYPES


@pytest.mark.parametrize("path", HISTORIES, ids=[f"{p.parent.name}/{p.stem}" for p in HISTORIES])
async def test_history_replays(path: Path) -> None:
    replayer = Replayer(workflows=ALL_WORKFLOWS, workflow_runner=workflow_runner())
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    if path.parent.name == CURRENT or RELEASE_CHECK:
        await replayer.replay_workflow(history)
        return
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    if result.replay_failure is not None:
        pytest.xfail(
            f"release {path.parent.name} no longer replays on main: its patches are written when the next "
            f"release is cut (docs/RELEASING.md): {result.replay_failure}"
        )


def test_only_the_previous_release_is_still_supported() -> None:
    """A release replays the runs of the one before it (a rolling upgrade, through the patches
    written when it was cut); the release after deprecates those patches, and that older set
    goes (docs/RELEASING.md)."""
    assert len(OLDER) <= 1, f"remove tests/histories/{OLDER[0]}/: its patches are deprecated"
