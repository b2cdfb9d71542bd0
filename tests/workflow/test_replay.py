"""Checked-in histories of every workflow type replay against today's workflow code: a change
that would break running workflows fails here (guard deliberate ones with workflow.patched)."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workers.control import workflow_runner
from workflows import ALL_WORKFLOWS

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


def test_every_workflow_type_has_a_history() -> None:
    types = set()
    for path in HISTORIES:
        history = WorkflowHistory.from_json(path.stem, path.read_text())
        types.add(history.events[0].workflow_execution_started_event_attributes.workflow_type.name)
    assert types == {w.__temporal_workflow_definition.name for w in ALL_WORKFLOWS}  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_history_replays(path: Path) -> None:
    replayer = Replayer(workflows=ALL_WORKFLOWS, workflow_runner=workflow_runner())
    await replayer.replay_workflow(WorkflowHistory.from_json(path.stem, path.read_text()))
