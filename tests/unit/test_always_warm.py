"""always_warm deployments (README, "How it works"): loaded when the pool starts and again after a loss, with
no request asking; never by making room; retried with backoff when the load fails."""

from __future__ import annotations

from modelforge.domain import Residency
from modelforge.failures import FailureClass
from modelforge.policy import PoolState, apply_decisions, decide, resident_failed, resident_ready
from tests.builders import NOW, deployment, gpu, observe, state

KEY = "pinned@1@n/0"


def pool(total: float = 24) -> PoolState:
    return state([gpu("n/0", total=total)], [deployment("pinned@1", gib=4, residency=Residency.ALWAYS_WARM)])


def test_loaded_at_start_without_a_request_once_observations_are_fresh() -> None:
    s = pool()
    assert decide(s, NOW).loads == [], "never on data it has not observed"
    observe(s, "n/0", at=NOW)
    [load] = decide(s, NOW).loads
    assert (load.resident_key, load.for_requests) == (KEY, [])
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert decide(s, NOW + 1).loads == [], "loading once is enough"


def test_no_room_means_no_load_and_nothing_evicted() -> None:
    s = pool(total=4)  # 4 GiB - 1 GiB reserve < 4 GiB
    observe(s, "n/0", at=NOW)
    decisions = decide(s, NOW)
    assert decisions.loads == [] and decisions.unloads == [] and decisions.preemptions == []


def test_reloaded_after_a_loss_and_backed_off_after_failed_loads() -> None:
    s = pool()
    observe(s, "n/0", at=NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    resident_ready(s, KEY, 0, NOW)
    observe(s, "n/0", at=NOW + 10, loaded=[])  # the node no longer holds it: lost
    assert KEY not in s.residents
    [reload] = decide(s, NOW + 10).loads
    assert reload.resident_key == KEY

    apply_decisions(s, decide(s, NOW + 10), NOW + 10, {})
    resident_failed(s, KEY, FailureClass.MODEL_LOAD_FAILED, "boom", NOW + 11)
    # First failure: 10 s backoff; second: 20 s.
    observe(s, "n/0", at=NOW + 20)
    assert decide(s, NOW + 20).loads == []
    observe(s, "n/0", at=NOW + 21)
    apply_decisions(s, decide(s, NOW + 21), NOW + 21, {})
    resident_failed(s, KEY, FailureClass.MODEL_LOAD_FAILED, "boom", NOW + 22)
    observe(s, "n/0", at=NOW + 41)
    assert decide(s, NOW + 41).loads == []
    observe(s, "n/0", at=NOW + 42)
    assert [load.resident_key for load in decide(s, NOW + 42).loads] == [KEY]
