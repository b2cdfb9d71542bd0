"""Which cards are stale, kept across passes (`_fit_index.Staleness`): the fast pass finds the
cards gone stale since the last pass without reading every card's observation. It must say what
`is_fresh` says of every card, whatever order observations land in and time moves."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from modelforge.policy import PolicyConfig
from modelforge.policy._fit_index import Staleness
from modelforge.policy._pass import start_pass
from modelforge.policy._rules import PRESSURE, STALE, shut_cards
from tests.builders import NOW, deployment, gpu, observe, state
from tests.tiers import examples

CARDS = [f"c{i}" for i in range(6)]

step = st.one_of(
    st.tuples(st.just("observed"), st.sampled_from(CARDS), st.floats(-100, 100)),  # at now + offset
    st.tuples(st.just("silent"), st.sampled_from(CARDS)),  # a card with no observation
    st.tuples(st.just("time"), st.floats(-30, 60)),  # time moves, sometimes back (another caller)
    st.tuples(st.just("limit"), st.sampled_from([10.0, 30.0, 45.0])),
)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(step, max_size=40))
def test_the_kept_stale_cards_are_those_the_rule_finds_stale(steps: list[tuple[object, ...]]) -> None:
    staleness = Staleness()
    received: dict[str, float | None] = dict.fromkeys(CARDS)
    for card in CARDS:
        staleness.received_at(card, None)
    now, limit = 1000.0, 30.0
    for kind, *args in steps:
        if kind == "observed":
            received[str(args[0])] = now + float(args[1])  # type: ignore[arg-type]
            staleness.received_at(str(args[0]), received[str(args[0])])
        elif kind == "silent":
            received[str(args[0])] = None
            staleness.received_at(str(args[0]), None)
        elif kind == "time":
            now += float(args[0])  # type: ignore[arg-type]
        else:
            limit = float(args[0])  # type: ignore[arg-type]
        expected = {card for card, at in received.items() if at is None or max(0.0, now - at) > limit}
        assert set(staleness.stale_at(now, limit)) == expected


def test_a_large_pool_finds_cards_gone_silent_between_passes_as_every_budget_does() -> None:
    """More cards than a walk reads one by one: the fast pass's stale cards, and those under
    GPU_PRESSURE, come from what it kept. Nodes go silent and come back, an unmanaged process
    fills some cards for a while; each pass's stale cards are exactly those whose budgets are not
    fresh, and the cards it shuts to lower work for pressure those the observations put under it
    (less the stale ones)."""
    cards = [f"n{node:02d}/{i}" for node in range(20) for i in range(4)]
    s = state(
        [gpu(card) for card in cards],
        [deployment("emb@1")],
        config=PolicyConfig(freshness_s=30.0, volatility_window_s=20.0, pressure_hold_s=20.0),
    )
    for card in cards:
        observe(s, card, at=NOW)
    silent_from = {f"n{node:02d}": 10.0 * (node % 5) for node in range(20)}
    counts, pressured = [], []
    for step in range(16):
        now = NOW + 10.0 * step
        for card in cards:
            node = card.split("/")[0]
            # Nodes report every 10 s, except in their silent spell (from silent_from for 40 s);
            # on n19 an unmanaged process takes all but 0.5 GiB from 20 s to 50 s.
            external = 22.5 if node == "n19" and 20 <= now - NOW < 50 else 0.0
            if not silent_from[node] <= now - NOW < silent_from[node] + 40:
                observe(s, card, external_gib=external, at=now)
        pass_ = start_pass(s, now)
        assert pass_.fit is not None
        kept = {card for card, why in shut_cards(pass_, True).items() if why == STALE}
        assert kept == set(pass_.budgets.stale(cards))
        assert kept == {card for card in cards if not pass_.budgets[card].fresh}
        counts.append(len(kept))
        under = {card for card, why in shut_cards(pass_, False).items() if why == PRESSURE}
        assert under == {card for card in cards if s.accelerators[card].pressure and card not in kept}
        pressured.append(len(under))
    # Cards went stale and came back; n19's cards went under pressure and left it (once the
    # unmanaged process's swing is out of the reserve's window and 20 s more have passed).
    assert counts[0] == 0 and max(counts) >= 16 and counts[-1] == 0
    assert pressured[0] == 0 and max(pressured) == 4 and pressured[-1] == 0
