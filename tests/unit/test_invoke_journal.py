"""The node's note of its running invokes: written as an invoke starts, gone when it ends, and
what a worker started again finds of its previous process (tests/faults/test_kill_node_worker.py
kills a real node worker mid-invoke and checks the request ends at its restart)."""

from __future__ import annotations

import stat
from pathlib import Path

from activities._invoke_journal import InvokeJournal, invoke_journal_dir


def test_a_running_invoke_is_noted_privately_and_forgotten_when_it_ends(tmp_path: Path) -> None:
    journal = InvokeJournal(invoke_journal_dir(tmp_path, "gpu-node"))
    first = journal.begin("lease-1", "req-1", b"\x00token-1\xff", "request:cap@1:req-1")
    second = journal.begin("lease-2", "req-2", b"token-2", "request:cap@1:req-2")
    assert first is not None and second is not None and first != second
    assert stat.S_IMODE(first.stat().st_mode) == 0o600  # it holds a task token
    assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    journal.end(first)
    journal.end(first)  # twice: nothing to do
    assert not first.exists() and second.exists()
    # This process's own invokes are not "left": only what a previous process left is.
    assert journal.left() == []


def test_a_worker_started_again_finds_what_its_previous_process_was_running(tmp_path: Path) -> None:
    directory = invoke_journal_dir(tmp_path, "gpu node/ü")  # any node name: one safe path component
    assert directory.parent == tmp_path / "invokes"
    before = InvokeJournal(directory)
    before.begin("lease-1", "req-1", b"\x00token-1\xff", "request:cap@1:req-1")
    (directory / "garbage.json").write_text("{not json", encoding="utf-8")  # a torn write
    again = InvokeJournal(directory)
    [left] = again.left()
    assert (left.task_token, left.lease_id, left.request_id, left.workflow_id) == (
        b"\x00token-1\xff",
        "lease-1",
        "req-1",
        "request:cap@1:req-1",
    )
    assert not (directory / "garbage.json").exists()  # unreadable: removed, logged
    again.end(left.path)
    assert InvokeJournal(directory).left() == []


def test_no_home_no_note(tmp_path: Path) -> None:
    journal = InvokeJournal(None)
    assert journal.begin("lease-1", "req-1", b"t", "w") is None
    assert journal.left() == []
