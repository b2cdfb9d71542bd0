"""The memory budget has one formula (`budget_from_sums`, the invariant) and one copy written out
for speed in the decision pass (`Budgets`, asked of every card of a full pool): the two must give
the same budget for every card state, observed or not, fresh or stale, with any history of
external usage; and the freshness it reads without working out the budget (`Budgets.fresh`)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from modelforge.domain import Accelerator, Catalog, GiB, Observation, ProcessUsage
from modelforge.policy import PolicyConfig, PoolState
from modelforge.policy._budget import budget_from_sums
from modelforge.policy._pass import Budgets
from modelforge.policy._state import AcceleratorRuntime

NOW = 1_000_000.0
gib = st.integers(0, 96).map(lambda n: n * GiB // 2)


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(8, 96).map(lambda n: n * GiB),
    reserve=gib,
    observed=st.none() | st.tuples(gib, gib, st.floats(0, 120)),
    history=st.lists(st.tuples(st.floats(0, 900), gib), max_size=6),
    resident=gib,
    leased=gib,
    volatility_window_s=st.sampled_from([60.0, 300.0, 600.0]),
    freshness_s=st.sampled_from([10.0, 30.0]),
)
def test_the_pass_budget_is_the_invariants_formula(
    total: int,
    reserve: int,
    observed: tuple[int, int, float] | None,
    history: list[tuple[float, int]],
    resident: int,
    leased: int,
    volatility_window_s: float,
    freshness_s: float,
) -> None:
    accelerator = Accelerator(id="n/0", node="n", total_bytes=total, reserve_bytes=reserve)
    observation = None
    if observed is not None:
        used, managed, age = observed
        observation = Observation(
            accelerator="n/0",
            total_bytes=total,
            used_bytes=used,
            processes=[ProcessUsage(pid=1, used_bytes=managed, managed=True)],
            received_at=NOW - age,
        )
    runtime = AcceleratorRuntime(
        observation=observation,
        external_history=[[NOW - ago, float(b)] for ago, b in sorted(history, reverse=True)],
    )
    config = PolicyConfig(volatility_window_s=volatility_window_s, freshness_s=freshness_s)
    state = PoolState(pool="p", catalog=Catalog(accelerators=[accelerator]), config=config)
    state.accelerators["n/0"] = runtime
    budgets = Budgets(state, {"n/0": resident}, {"n/0": leased}, NOW)
    # Freshness asked before the budget (the landing rules' shortcut) says what the budget says.
    fresh_first = budgets.fresh("n/0")
    written_out = budgets["n/0"]
    assert written_out == budget_from_sums(accelerator, runtime, resident, leased, config, NOW)
    assert fresh_first == written_out.fresh == budgets.fresh("n/0")
    assert (
        Budgets(state, {}, {}, NOW).stale(["n/0"]) == budgets.stale(["n/0"]) == ([] if written_out.fresh else ["n/0"])
    )
