"""The node's record of each invoke's outcome (activities/_invoke_outcomes.py): found by its
lease and request while it runs and for KEEP_S after it ends, then forgotten; bounded in number."""

from __future__ import annotations

from activities._invoke_outcomes import InvokeOutcomes
from modelforge.messages import InvokeResult


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_outcome_is_found_by_its_lease_and_request_while_it_runs_and_after_it_ends() -> None:
    clock = Clock()
    outcomes = InvokeOutcomes(keep_s=600, keep=10, clock=clock)
    running = outcomes.begin("lease-1", "req-1")
    assert outcomes.find("lease-1", "req-1") is running and not running.ended.is_set()
    assert outcomes.find("lease-1", "someone-else") is None  # another request never sees it
    assert outcomes.find("lease-2", "req-1") is None
    answer = InvokeResult(output={"ok": True}, invoke_s=0.1)
    outcomes.end(running, answer, None)
    clock.now = 599.0
    found = outcomes.find("lease-1", "req-1")
    assert found is not None and found.ended.is_set() and found.result == answer
    clock.now = 601.0
    assert outcomes.find("lease-1", "req-1") is None  # forgotten KEEP_S after it ended
    assert len(outcomes) == 0


def test_the_oldest_ended_outcomes_go_first_past_the_bound_and_a_running_one_is_kept() -> None:
    clock = Clock()
    outcomes = InvokeOutcomes(keep_s=600, keep=3, clock=clock)
    ended = [outcomes.begin(f"lease-{i}", f"req-{i}") for i in range(4)]
    for outcome in ended:
        outcomes.end(outcome, None, RuntimeError("failed"))
    outcomes.begin("lease-4", "req-4")  # five recorded, three kept: the oldest ended go
    assert [outcomes.find(f"lease-{i}", f"req-{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    # A long invoke at the front is never dropped while it runs, whatever the bound.
    busy = InvokeOutcomes(keep_s=1, keep=1, clock=clock)
    long_one = busy.begin("long", "req-long")
    for i in range(3):
        busy.end(busy.begin(f"short-{i}", f"req-{i}"), None, None)
    clock.now += 10
    assert busy.find("long", "req-long") is long_one
