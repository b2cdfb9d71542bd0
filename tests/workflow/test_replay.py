"""Checked-in histories of every workflow type replay against today's workflow code: a change
that would break running workflows fails here (guard deliberate ones with workflow.patched)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workers.control import workflow_runner
from workflows import ALL_WORKFLOWS
from workflows.scheduler import SCHEDULER_RULES

ROOT = Path(__file__).resolve().parents[1] / "histories"
# One folder per recording (one per workflow change; tests/workflow/record_histories.py): every one must keep replaying.
HISTORIES = sorted(ROOT.glob("*/*.json"))
# By number: v10 is newer than v9 (sorted as text it was not, and v9 passed for the newest).
VERSIONS = sorted({path.parent.name for path in HISTORIES}, key=lambda name: int(name.removeprefix("v")))


def _types(version: str) -> set[str]:
    types = set()
    for path in HISTORIES:
        if path.parent.name == version:
            history = WorkflowHistory.from_json(path.stem, path.read_text())
            types.add(history.events[0].workflow_execution_started_event_attributes.workflow_type.name)
    return types


def test_the_newest_recording_has_every_workflow_type() -> None:
    # Record a new version (tests/workflow/record_histories.py) when a workflow type is added.
    assert _types(VERSIONS[-1]) == {w.__temporal_workflow_definition.name for w in ALL_WORKFLOWS}  # type: ignore[attr-defined]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_recorded_type_still_exists(version: str) -> None:
    assert _types(version) <= {w.__temporal_workflow_definition.name for w in ALL_WORKFLOWS}  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", HISTORIES, ids=[f"{p.parent.name}/{p.stem}" for p in HISTORIES])
async def test_history_replays(path: Path) -> None:
    replayer = Replayer(workflows=ALL_WORKFLOWS, workflow_runner=workflow_runner())
    await replayer.replay_workflow(WorkflowHistory.from_json(path.stem, path.read_text()))


async def test_a_run_an_older_worker_started_from_an_input_with_rules_replays_without_them() -> None:
    """A worker of a release before `SchedulerInput.rules` ignores the field (an unknown key), so
    in a rolling upgrade it may run a scheduler continued as new with `rules` set, by the old
    rules. Replayed here (the scheduler of v11, recorded before the field, its input given
    `rules: 1`), the run must follow the commands it recorded: the rules hold only in a run
    that has the one marker new workers ask first."""
    path = ROOT / "v11" / "scheduler.json"
    document = json.loads(path.read_text())
    started = document["events"][0]["workflowExecutionStartedEventAttributes"]["input"]["payloads"][0]
    start = json.loads(base64.b64decode(started["data"]))
    assert "rules" not in start, "v11 was recorded before SchedulerInput.rules"
    start["rules"] = SCHEDULER_RULES
    started["data"] = base64.b64encode(json.dumps(start).encode()).decode()
    replayer = Replayer(workflows=ALL_WORKFLOWS, workflow_runner=workflow_runner())
    await replayer.replay_workflow(WorkflowHistory.from_json("scheduler-with-rules", json.dumps(document)))
