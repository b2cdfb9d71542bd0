"""The simulator on small scenarios whose figures are worked out by hand in the comments, and the
baselines' distinctive behaviours."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from modelforge.domain import Accelerator, Catalog, Deployment, GiB, Priority, Residency, Tenant
from modelforge.failures import FailureClass
from modelforge.policy import PolicyConfig
from modelforge.simulate import POLICIES as POLICIES_BY_NAME
from modelforge.simulate import (
    ExternalUsage,
    FifoScheduler,
    GangFifoScheduler,
    OllamaScheduler,
    Scenario,
    ScenarioError,
    SimRequest,
    SimulationConfig,
    load_scenario,
    parse_request_lines,
    simulate,
)
from modelforge.simulate._engine import Simulation
from modelforge.simulate._modelforge import ModelForgeScheduler
from modelforge.simulate._protocol import Actions, CardView, Start

POLICIES = ["modelforge", "fifo", "ollama", "fifo-gang"]


def card(id: str = "gpu/0", gib: float = 24, reserve: float = 1) -> Accelerator:
    return Accelerator(
        id=id, node=id.split("/")[0], total_bytes=int(gib * GiB), production_eligible=True, model="M",
        reserve_bytes=int(reserve * GiB),
    )  # fmt: skip


def model(capability: str, gib: float, **kw: object) -> Deployment:
    kw.setdefault("measured_on", ["M"])
    kw.setdefault("queue_limit", 1000)
    return Deployment(capability=capability, envelope_bytes=int(gib * GiB), **kw)  # type: ignore[arg-type]


def scenario(
    cards: list[Accelerator],
    deployments: list[Deployment],
    requests: list[dict[str, object]],
    external: list[ExternalUsage] | None = None,
    tenants: list[Tenant] | None = None,
    **config: float,
) -> Scenario:
    catalog = Catalog(
        accelerators=cards,
        deployments=deployments,
        tenants=tenants or [Tenant("t", 1.0, Priority.INTERACTIVE, Priority.PRODUCTION)],
    )
    lines = [json.dumps({"tenant": "t", "priority": "interactive", **r}) for r in requests]
    parsed, catalog = parse_request_lines(lines, catalog)
    return Scenario(catalog, parsed, external or [], SimulationConfig(**config))  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", POLICIES)
def test_waits_and_loads_on_one_model(policy: str) -> None:
    # One 4 GiB model, 4 s to load, one request at a time; three 1 s requests at t = 0, 1, 2.
    # Load 0 -> 4; r0 runs 4-5, r1 5-6, r2 6-7: waits 4, 4, 4 s; one load; all complete.
    s = scenario(
        [card()],
        [model("m@1", 4, load_s=4.0)],
        [{"t": t, "capability": "m@1", "service_s": 1.0} for t in (0, 1, 2)],
    )
    result = simulate(s, policy)
    interactive = result.by_class["interactive"]
    assert (result.completed, result.loads) == (3, 1)
    assert (interactive["wait_p50_s"], interactive["wait_p99_s"]) == (4.0, 4.0)
    assert result.virtual_s == 7.0


@pytest.mark.parametrize("policy", POLICIES)
def test_vram_utilization_is_held_bytes_over_capacity_over_time(policy: str) -> None:
    # A 10 GiB card; a 5 GiB model loads at once and serves one 10 s request: 5 GiB held for
    # the whole 10 s run, so 5 / 10 = 0.5, all of it busy.
    s = scenario([card(gib=10)], [model("m@1", 5)], [{"t": 0, "capability": "m@1", "service_s": 10.0}])
    result = simulate(s, policy)
    assert result.vram_utilization == pytest.approx(0.5)
    assert result.vram_busy_utilization == pytest.approx(0.5)


def test_jain_fairness_over_weighted_gpu_seconds() -> None:
    # Tenants a and b (weight 1 each) get 10 and 30 GPU-seconds: (10 + 30)^2 / (2 * (100 + 900)) = 0.8.
    tenants = [Tenant("a", 1.0, Priority.INTERACTIVE, Priority.INTERACTIVE), Tenant("b", 1.0)]
    s = scenario(
        [card()],
        [model("m@1", 2, concurrency=2)],
        [
            {"t": 0, "capability": "m@1", "service_s": 10.0, "tenant": "a"},
            {"t": 0, "capability": "m@1", "service_s": 30.0, "tenant": "b"},
        ],
        tenants=tenants,
    )
    assert simulate(s).jain_fairness == pytest.approx(0.8)


def two_models_and_a_transcode() -> Scenario:
    # A 12 GiB card (1 GiB static reserve). A transcode takes 3 GiB from 0 to 10 s and again from
    # 100 to 150 s. Models a and b (5 GiB each) are asked for at 20 and 21 s, 200 s of work each.
    # fifo and ollama load both (10 GiB); at 100 s 10 + 3 = 13 > 12 GiB: an out-of-memory moment.
    # ModelForge saw the 3 GiB swing, so its reserve is 3 GiB: 12 - 3 = 9 GiB, a fits, b waits
    # for a to end (220 s), evicts it and runs: never over the card.
    return scenario(
        [card(gib=12)],
        [model("a@1", 5, load_s=1.0), model("b@1", 5, load_s=1.0)],
        [
            {"t": 20, "capability": "a@1", "service_s": 200.0},
            {"t": 21, "capability": "b@1", "service_s": 200.0},
        ],
        external=[ExternalUsage("gpu/0", 3 * GiB, 0.0, 10.0), ExternalUsage("gpu/0", 3 * GiB, 100.0, 150.0)],
    )


def test_oom_events_count_moments_over_the_card() -> None:
    s = two_models_and_a_transcode()
    assert simulate(s, "fifo").oom_events == 1
    assert simulate(s, "ollama").oom_events == 1
    result = simulate(s, "modelforge")
    assert result.oom_events == 0
    assert result.completed == 2
    # b waited for a: from 21 s to 221 s (a's end) + 1 s to load it again = 201 s.
    assert result.by_class["interactive"]["wait_p99_s"] == pytest.approx(201.0)
    assert result.evictions == 1


def test_invariant_violations_count_placements_into_the_reserve() -> None:
    # A 10 GiB card with a 1 GiB reserve and a 9.5 GiB model: fifo loads it (10 GiB free), which
    # leaves 0.5 GiB of the 1 GiB reserve: one violation. ModelForge refuses it:
    # 10 - 1 = 9 < 9.5 GiB on any card.
    s = scenario([card(gib=10)], [model("big@1", 9.5)], [{"t": 0, "capability": "big@1", "service_s": 1.0}])
    fifo = simulate(s, "fifo")
    assert (fifo.invariant_violations, fifo.completed) == (1, 1)
    mine = simulate(s, "modelforge")
    assert (mine.invariant_violations, mine.completed) == (0, 0)
    assert mine.rejected == {"INSUFFICIENT_SCHEDULABLE_VRAM": 1}


def test_preemption_lets_production_in_and_the_job_resumes_from_its_checkpoint() -> None:
    # 16 GiB card, 1 GiB reserve. A preemptible background job (6 GiB, batch) starts at 0 for
    # 1,000 s. A production call needs a 10 GiB model at 100 s: 16 - 6 - 1 = 9 < 10, so the job
    # is preempted (it ran 100 s >= 30 s minimum), checkpoints in 1 s, its runner unloads, the
    # model loads in 2 s: production waits 3 s and runs 10 s (done at 113). The job cannot evict
    # the warm production model; it resumes when that model's 60 s TTL lets it go at 173, with
    # 1,000 - 101 = 899 s left: done at 1,072.
    s = scenario(
        [card(gib=16)],
        [
            model("job@1", 6, residency=Residency.NONE, preemptible=True),
            model("llm@1", 10, load_s=2.0, ttl_s=60.0),
        ],
        [
            {"t": 0, "capability": "job@1", "service_s": 1000.0, "priority": "background"},
            {"t": 100, "capability": "llm@1", "service_s": 10.0, "priority": "production"},
        ],
        checkpoint_s=1.0,
    )
    result = simulate(s, "modelforge")
    assert result.preemptions == 1
    assert result.completed == 2
    assert result.by_class["production"]["wait_p99_s"] == pytest.approx(3.0)
    assert result.virtual_s == pytest.approx(1072.0)
    # ollama cannot preempt, and 10 > 0.8 * (16 - 6 - 0.5): production waits for the whole job,
    # 1,000 - 100 + 2 s to load = 902 s. fifo keeps no reserve: it loads into the last 1 GiB
    # (6 + 10 = 16 of 16 GiB), a violation of the invariant, and production waits only the load.
    assert simulate(s, "ollama").by_class["production"]["wait_p99_s"] == pytest.approx(902.0)
    fifo = simulate(s, "fifo")
    assert fifo.by_class["production"]["wait_p99_s"] == pytest.approx(2.0)
    assert fifo.invariant_violations == 1


def test_a_deadline_that_a_load_cannot_meet_is_refused_early_by_modelforge_only() -> None:
    # Loading takes 10 s, the deadline is 5 s: ModelForge says so at once; the baselines serve it
    # late (done at 11 s), so the deadline is met by no one.
    s = scenario(
        [card()],
        [model("m@1", 2, load_s=10.0)],
        [{"t": 0, "capability": "m@1", "service_s": 1.0, "deadline_s": 5.0}],
    )
    mine = simulate(s, "modelforge")
    assert mine.rejected == {"DEADLINE_CANNOT_BE_MET": 1}
    fifo = simulate(s, "fifo")
    assert fifo.completed == 1
    assert fifo.by_class["interactive"]["deadline_met_ratio"] == 0.0


def test_max_duration_cuts_a_run_with_timeout() -> None:
    s = scenario(
        [card()],
        [model("job@1", 2, residency=Residency.NONE)],
        [{"t": 0, "capability": "job@1", "service_s": 100.0, "max_duration_s": 30.0}],
    )
    result = simulate(s, "modelforge")
    assert result.rejected == {"TIMEOUT": 1}
    assert result.virtual_s == pytest.approx(30.0)


def remaining_models(scheduler: FifoScheduler | OllamaScheduler) -> list[str]:
    return sorted(r.deployment.capability for r in scheduler.runners.values() if not r.unloading)


def test_ollama_loads_only_within_80_percent_of_free_memory() -> None:
    # 10 GiB card, ollama's 0.5 GiB overhead. a (5 GiB) is loaded; b (4 GiB) comes at 10 s:
    # free is 5 GiB; fifo loads b (4 <= 5); ollama needs 4 <= 0.8 * (5 - 0.5) = 3.6: no, so it
    # unloads idle a first.
    s = scenario(
        [card(gib=10)],
        [model("a@1", 5), model("b@1", 4)],
        [{"t": 0, "capability": "a@1", "service_s": 1.0}, {"t": 10, "capability": "b@1", "service_s": 1.0}],
        ollama_overhead_bytes=GiB // 2,
    )
    assert simulate(s, "fifo").evictions == 0
    assert simulate(s, "ollama").evictions == 1


def test_ollama_evicts_the_shortest_keep_alive_and_fifo_the_least_recently_used() -> None:
    # A 20 GiB card. x, y, z (5 GiB each; keep-alive 900, 60 and 600 s) are used at 0, 1, 2 s.
    # w (6 GiB) at 10 s: ollama is at its 3 models per GPU and unloads y (shortest keep-alive);
    # fifo sees 5 GiB free < 6 and unloads x (least recently used).
    s = scenario(
        [card(gib=20)],
        [model("x@1", 5, ttl_s=900.0), model("y@1", 5, ttl_s=60.0), model("z@1", 5, ttl_s=600.0), model("w@1", 6)],
        [
            {"t": 0, "capability": "x@1", "service_s": 0.5},
            {"t": 1, "capability": "y@1", "service_s": 0.5},
            {"t": 2, "capability": "z@1", "service_s": 0.5},
            {"t": 10, "capability": "w@1", "service_s": 0.5},
        ],
    )
    ollama = OllamaScheduler(s)
    Simulation(s, ollama).run()
    assert remaining_models(ollama) == ["w@1", "x@1", "z@1"]
    fifo = FifoScheduler(s)
    Simulation(s, fifo).run()
    assert remaining_models(fifo) == ["w@1", "y@1", "z@1"]


def test_ollama_queue_is_bounded_at_512() -> None:
    # One slot, 1,000 s each, 600 requests at once: one runs (after the instant load), 512 wait,
    # the other 87 are refused QUEUE_FULL.
    s = scenario(
        [card()],
        [model("m@1", 1)],
        [{"t": 0, "capability": "m@1", "service_s": 1000.0} for _ in range(600)],
    )
    result = simulate(s, "ollama")
    assert result.rejected == {"QUEUE_FULL": 88}


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"t": 0, "capability": "nope", "service_s": 1}', "capability 'nope' has no deployment"),
        ('{"t": -1, "capability": "m@1", "service_s": 1}', "t must be at least 0"),
        ('{"t": 0, "capability": "m@1"}', "service_s is required"),
        ('{"t": 0, "capability": "m@1", "service_s": "1"}', "service_s must be a finite number"),
        ('{"t": 0, "capability": "m@1", "service_s": true}', "service_s must be a finite number"),
        ('{"t": 0, "capability": "m@1", "service_s": NaN}', "service_s must be a finite number"),
        ('{"t": 0, "capability": "m@1", "service_s": 1, "deadline_s": Infinity}', "deadline_s must be a finite number"),
        # An integer beyond a float's range: a typed error, not an OverflowError's traceback.
        ('{"t": 0, "capability": "m@1", "service_s": 1' + "0" * 400 + "}", "service_s must be a finite number"),
        ('{"t": 0, "capability": "m@1", "service_s": 1, "priority": "urgent"}', "priority 'urgent' is not one of"),
        ('{"t": 0, "capability": "m@1", "service_s": 1, "tenant": "eve"}', "tenant 'eve' is not in"),
        ('{"t": 0, "capability": "m@1", "service_s": 1, "colour": "red"}', "unknown field 'colour'"),
        ('{"t": 0, "capability": "m@1", "service_s": 1, "gpu_count": 0}', "gpu_count must be an integer"),
        ("[1, 2]", "expected an object"),
        ("{not json", "not JSON"),
    ],
)
def test_bad_request_lines_name_the_line_and_field(line: str, fragment: str) -> None:
    catalog = Catalog(accelerators=[card()], deployments=[model("m@1", 1)], tenants=[Tenant("default")])
    good = '{"t": 0, "capability": "m@1", "service_s": 1}'
    with pytest.raises(ScenarioError) as error:
        parse_request_lines([good, line], catalog)
    assert "request line 2" in error.value.message
    assert fragment in error.value.message


def test_request_lines_must_be_in_time_order() -> None:
    catalog = Catalog(accelerators=[card()], deployments=[model("m@1", 1)], tenants=[Tenant("default")])
    lines = ['{"t": 5, "capability": "m@1", "service_s": 1}', '{"t": 4, "capability": "m@1", "service_s": 1}']
    with pytest.raises(ScenarioError, match="earlier than the line before"):
        parse_request_lines(lines, catalog)


def test_a_request_with_its_own_shape_gets_a_variant_deployment() -> None:
    catalog = Catalog(accelerators=[card()], deployments=[model("job@1", 1, residency=Residency.NONE)])
    lines = [
        json.dumps({"t": 0, "capability": "job@1", "service_s": 1, "bytes_per_gpu": 3 * GiB, "tenant": "default"}),
        json.dumps({"t": 1, "capability": "job@1", "service_s": 1, "bytes_per_gpu": 3 * GiB, "tenant": "default"}),
        json.dumps({"t": 2, "capability": "job@1", "service_s": 1, "tenant": "default"}),
    ]
    catalog = Catalog(accelerators=catalog.accelerators, deployments=catalog.deployments, tenants=[Tenant("default")])
    requests, extended = parse_request_lines(lines, catalog)
    assert [r.capability for r in requests] == ["job@1.shape1", "job@1.shape1", "job@1"]
    variant = extended.deployment_for("job@1.shape1")
    assert variant is not None and variant.envelope_bytes == 3 * GiB


def test_a_gang_job_runs_inside_one_nvlink_group_under_modelforge_only() -> None:
    # Four cards, two NVLink groups. A 1-GPU job holds 20 GiB of a0 first; a 2-GPU NVLink job
    # (8 GiB each) then fits only in group b: 2 starts, no split. The baselines place single-GPU
    # work only and refuse the gang, typed.
    cards = [
        Accelerator(id=f"{g}{i}", node=f"node-{g}", total_bytes=24 * GiB, production_eligible=True, model="M",
                    nvlink_group=f"nvl-{g}")
        for g in "ab" for i in range(2)
    ]  # fmt: skip
    s = scenario(
        cards,
        [model("train@1", 8, residency=Residency.NONE, idle_bytes=0, concurrency=4)],
        [
            {"t": 0, "capability": "train@1", "service_s": 100.0, "bytes_per_gpu": 20 * GiB},
            {"t": 1, "capability": "train@1", "service_s": 10.0, "gpu_count": 2, "nvlink_required": True},
        ],
    )
    result = simulate(s, "modelforge")
    assert (result.completed, result.gang_starts, result.gang_splits) == (2, 1, 0)
    assert result.by_class["interactive"]["wait_p99_s"] == 0.0
    for policy in ("fifo", "ollama"):
        assert simulate(s, policy).rejected == {FailureClass.CAPABILITY_UNAVAILABLE.value: 1}, policy


def test_scenario_files_load_with_requests_beside_them(tmp_path: Path) -> None:
    (tmp_path / "requests.jsonl").write_text('{"t": 0, "capability": "emb@1", "service_s": 0.5, "tenant": "rag"}\n')
    (tmp_path / "s.toml").write_text(
        """
[simulation]
checkpoint_s = 2
[[accelerators]]
id = "gpu-node/0"
node = "gpu-node"
total_bytes = 25769803776
[[external]]
accelerator = "gpu-node/0"
bytes = 6442450944
start_s = 0
end_s = 1800
[[deployments]]
capability = "emb@1"
envelope_bytes = 1216348160
[[tenants]]
name = "rag"
[requests]
path = "requests.jsonl"
"""
    )
    loaded = load_scenario(tmp_path / "s.toml")
    assert loaded.config.checkpoint_s == 2.0
    assert loaded.external[0].end_s == 1800.0
    assert simulate(loaded).completed == 1


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[[accelerators]]\nid = 1\n", "[requests] path"),
        ('[requests]\npath = "missing.jsonl"\n', "requests file not found"),
        ('[simulation]\nspeed = 2\n[requests]\npath = "r.jsonl"\n', "simulation.speed: unknown setting"),
        ("not toml = = 1", "not valid TOML"),
    ],
)
def test_bad_scenario_files_are_refused_with_a_reason(tmp_path: Path, content: str, fragment: str) -> None:
    (tmp_path / "s.toml").write_text(content)
    with pytest.raises(ScenarioError) as error:
        load_scenario(tmp_path / "s.toml")
    assert fragment in error.value.message


def test_json_has_the_keys_of_design_section_7() -> None:
    s = scenario([card()], [model("m@1", 1)], [{"t": 0, "capability": "m@1", "service_s": 1.0}])
    keys = set(simulate(s).to_json())
    required = {"policy", "requests", "completed", "rejected", "by_class", "loads", "evictions", "preemptions"}
    required |= {"invariant_violations", "oom_events", "vram_utilization", "jain_fairness", "wall_s"}
    assert required <= keys
    assert set(simulate(s).by_class["interactive"]) >= {"completed", "wait_p50_s", "wait_p99_s", "deadline_met_ratio"}


def test_a_gang_reservation_stops_a_stream_of_small_jobs_from_starving_the_gang() -> None:
    # Four 24 GiB cards. Background jobs of one card (12 GiB, 300 s, max_duration 400 s) arrive
    # every 100 s until 3,000 s, so three cards are busy at any time and a freed card is taken
    # at once. A four-card interactive gang (12 GiB each, 200 s) arrives at 50 s.
    cards = [card(f"n/{i}") for i in range(4)]
    requests: list[dict[str, object]] = [
        {"t": float(t), "capability": "small@1", "service_s": 300.0, "max_duration_s": 400.0, "priority": "background"}
        for t in range(0, 3001, 100)
    ]
    requests.append({"t": 50.0, "capability": "gang@1", "service_s": 200.0, "priority": "interactive"})
    requests.sort(key=lambda r: float(r["t"]))  # type: ignore[arg-type]
    s = scenario(
        cards,
        [
            model("small@1", 12, residency=Residency.NONE, concurrency=1),
            model("gang@1", 12, residency=Residency.NONE, idle_bytes=0, gpu_count=4),
        ],
        requests,
        lease_timeout_s=10_000.0,
    )
    reserving = Simulation(s, ModelForgeScheduler(s)).run()
    waiting = Simulation(s, ModelForgeScheduler(s, PolicyConfig(gang_reservations=False))).run()
    assert reserving.gang_starts == waiting.gang_starts == 1
    assert reserving.completed == waiting.completed == len(requests)
    # Reserving: every job running when the gang arrives ends by its max_duration (400 s after
    # it started, the last at 0..50 s -> by 450 s), and nothing that would end later starts on
    # the reserved cards: the gang starts by 450 s, a wait under 400 s.
    assert reserving.by_class["interactive"]["wait_p99_s"] <= 400.0
    # Without a reservation each freed card goes to the next small job: the gang waits for the
    # stream to end (the last job arrives at 3,000 s and runs 300 s).
    assert waiting.by_class["interactive"]["wait_p99_s"] >= 3000.0


def _gang_on_two_nodes() -> Scenario:
    # Nodes a and b, two 24 GiB cards each, listed a/0, b/0, a/1, b/1. Two 20 GiB jobs at 0 land
    # on a/0 (runs 10 s) and b/0 (runs 20 s): the cards with the most room, first listed first.
    # A 2-card job of 12 GiB a card at 1: no node has two cards with 12 GiB free (a/1 and b/1
    # are on different nodes). A 4 GiB job at 2 would fit on a/1, but waits behind the gang.
    cards = [card("a/0"), card("b/0"), card("a/1"), card("b/1")]
    return scenario(
        cards,
        [
            model("job@1", 20, residency=Residency.NONE),
            model("small@1", 4, residency=Residency.NONE),
            model("gang@1", 12, residency=Residency.NONE, idle_bytes=0, gpu_count=2),
        ],
        [
            {"t": 0.0, "capability": "job@1", "service_s": 10.0},
            {"t": 0.0, "capability": "job@1", "service_s": 20.0},
            {"t": 1.0, "capability": "gang@1", "service_s": 5.0},
            {"t": 2.0, "capability": "small@1", "service_s": 1.0},
        ],
    )


def test_fifo_gang_starts_a_multi_gpu_job_whole_on_one_node_and_the_queue_waits_for_it() -> None:
    s = _gang_on_two_nodes()
    scheduler = POLICIES_BY_NAME["fifo-gang"](s)
    starts: list[Start] = []
    step = scheduler.step

    def recording(now: float, cards: CardView, touched: dict[str, bool]) -> Actions:
        actions = step(now, cards, touched)
        starts.extend(actions.starts)
        return actions

    scheduler.step = recording  # type: ignore[method-assign]
    sim = Simulation(s, scheduler)
    result = sim.run()
    assert result.completed == 4 and result.gang_starts == 1 and result.gang_splits == 0
    waits = [o.first_start - o.arrived for o in sim.outcomes if o.first_start is not None]
    # a/0's job ends at 10 and its process goes (no unload time): the gang starts on a/0 and a/1
    # at 10 (9 s), and the 4 GiB job behind it then, on b/1, the card with the most room (8 s).
    assert waits == [0.0, 0.0, 9.0, 8.0]
    gang = next(start for start in starts if start.gang)
    assert sorted(gang.accelerators) == ["a/0", "a/1"] and gang.bytes == 12 * GiB
    # `fifo` refuses the multi-GPU job at submission, and the small one starts at once.
    fifo = Simulation(s, FifoScheduler(s))
    assert fifo.run().rejected == {FailureClass.CAPABILITY_UNAVAILABLE.value: 1}
    assert fifo.outcomes[3].first_start == 2.0


def test_fifo_gang_refuses_a_job_no_node_can_hold() -> None:
    s = scenario(
        [card("a/0"), card("b/0")],
        [model("gang@1", 12, residency=Residency.NONE, idle_bytes=0, gpu_count=2)],
        [{"t": 0.0, "capability": "gang@1", "service_s": 5.0}],
    )
    result = simulate(s, "fifo-gang")
    assert result.rejected == {FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM.value: 1}


class _GangFifoSearchingEverywhere(GangFifoScheduler):
    """fifo-gang searching every node for every job, never only the nodes whose cards changed."""

    def _gang_cards(self, request: SimRequest, deployment: Deployment, free: Any) -> list[str] | None:
        self.no_room = None
        return super()._gang_cards(request, deployment, free)


def test_fifo_gang_searching_only_changed_nodes_starts_what_a_search_everywhere_starts() -> None:
    rng = random.Random(11)
    cards = [card(f"n{node}/{n}") for n in range(4) for node in range(5)]
    requests: list[dict[str, object]] = []
    for i in range(400):
        kind = rng.choice(["small@1", "big@1", "pair@1", "quad@1"])
        # In bursts, with whole-second runs: jobs end together, and nodes tie on room.
        requests.append({"t": (i // 4) * 2.0, "capability": kind, "service_s": float(rng.choice([5, 10, 20, 30]))})
    s = scenario(
        cards,
        [
            model("small@1", 6, residency=Residency.NONE),
            model("big@1", 16, residency=Residency.NONE),
            model("pair@1", 10, residency=Residency.NONE, idle_bytes=0, gpu_count=2),
            model("quad@1", 8, residency=Residency.NONE, idle_bytes=0, gpu_count=4),
        ],
        requests,
        lease_timeout_s=100_000.0,
    )
    runs = []
    for scheduler in (GangFifoScheduler(s), _GangFifoSearchingEverywhere(s)):
        starts: list[tuple[float, int, tuple[str, ...]]] = []
        step = scheduler.step

        def recording(
            now: float, view: CardView, touched: dict[str, bool], step: Any = step, starts: Any = starts
        ) -> Actions:
            actions = step(now, view, touched)
            starts.extend((now, start.request_index, start.accelerators) for start in actions.starts)
            return actions

        scheduler.step = recording  # type: ignore[method-assign]
        sim = Simulation(s, scheduler)
        result = sim.run()
        runs.append((starts, result.completed))
        gang_waits = [
            o.first_start - o.arrived
            for r, o in zip(s.requests, sim.outcomes, strict=True)
            if r.capability in ("pair@1", "quad@1") and o.first_start is not None
        ]
        # Busy enough that jobs wait for a node with room (the narrowed search is used).
        assert max(gang_waits) > 10.0
    assert runs[0] == runs[1]
    assert runs[0][1] == len(requests)


@pytest.mark.parametrize(("sleepy", "second_wait_s", "loads"), [(True, 4.0, 2), (False, 32.0, 3)])
def test_a_model_that_can_sleep_is_woken_in_seconds_instead_of_reloaded(
    sleepy: bool, second_wait_s: float, loads: int
) -> None:
    # One 24 GiB card (1 GiB reserve). a@1: 16 GiB, loads in 30 s, unloads in 2; asleep it keeps
    # 2 GiB, sleeps in 1 s, wakes in 2. b@1: 12 GiB, loads in 5 s, cannot sleep.
    # a at 0 (loads 0-30, runs to 40); b at 50: 23 - 16 = 7 < 12, so a sleeps (50-51) or is
    # unloaded (50-52), and b loads. a again at 100: waking needs 14 GiB, 23 - 2 - 12 = 9 are
    # free, so b (idle) is unloaded (100-102) and a woken (102-104): a 4 s wait. Without sleep a
    # loads again after b's unload: 102 + 30 = 132, a 32 s wait.
    sleep = {"sleep_bytes": 2 * GiB, "sleep_s": 1.0, "wake_s": 2.0} if sleepy else {}
    s = scenario(
        [card(gib=24)],
        [
            model("a@1", 16, load_s=30.0, unload_s=2.0, ttl_s=1000.0, **sleep),
            model("b@1", 12, load_s=5.0, unload_s=2.0, ttl_s=1000.0),
        ],
        [
            {"t": 0.0, "capability": "a@1", "service_s": 10.0},
            {"t": 50.0, "capability": "b@1", "service_s": 10.0},
            {"t": 100.0, "capability": "a@1", "service_s": 10.0},
        ],
    )
    simulation = Simulation(s, ModelForgeScheduler(s))
    result = simulation.run()
    assert result.completed == 3 and result.invariant_violations == 0
    third = simulation.outcomes[2]
    assert third.first_start is not None
    assert third.first_start - third.arrived == pytest.approx(second_wait_s)
    assert (result.loads, result.sleeps, result.wakes) == (loads, int(sleepy), int(sleepy))


def test_a_card_a_catalog_brings_in_over_its_size_counts_an_out_of_memory_moment() -> None:
    # A process on gpu/1 uses 30 GiB from the start, before any catalog has the 24 GiB card;
    # the catalog applied at t=50 brings it in: the card is over its size from that moment.
    # Taken out again at t=100, it is no longer watched and the run ends with its work.
    s = scenario(
        [card("gpu/0")],
        [model("m@1", 4, load_s=1.0)],
        [{"t": 0.0, "capability": "m@1", "service_s": 200.0}],
        external=[ExternalUsage("gpu/1", 30 * GiB, 0.0, math.inf)],
    )
    both = replace(s.catalog, accelerators=[card("gpu/0"), card("gpu/1")])
    s = replace(s, catalog_changes=[(50.0, both), (100.0, replace(s.catalog, accelerators=[card("gpu/0")]))])
    result = simulate(s, "modelforge")
    assert result.completed == 1
    assert result.oom_events == 1
    assert result.invariant_violations == 0
