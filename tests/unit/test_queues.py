"""Queues as configuration: named queues with their own levels, which levels preempt
which, and per-queue fair-share weights; the five built-in classes as the built-in default queue.
Both tables (the built-in classes and a three-queue design) ship as example catalogs
(queues-seed000.toml, queues-seed003.toml) and are exercised here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelforge.catalog import CatalogError, load_catalog_file, parse_catalog
from modelforge.domain import Catalog, GiB, Residency
from modelforge.failures import FailureClass
from modelforge.policy import (
    AdmissionRejected,
    PolicyConfig,
    PoolState,
    apply_decisions,
    decide,
    enqueue,
    queue_order,
    release_lease,
    resident_ready,
    resolve_priority,
)
from tests.builders import NOW, ask, deployment, gpu, observe, resident

EXAMPLES = Path(__file__).parents[2] / "modelforge" / "examples"
SEED_003 = EXAMPLES / "queues-seed003.toml"
SEED_000 = EXAMPLES / "queues-seed000.toml"


def seed003() -> Catalog:
    catalog, _ = load_catalog_file(SEED_003)
    return catalog


def pool(catalog: Catalog, accelerators: Any, deployments: Any, config: PolicyConfig | None = None) -> PoolState:
    """The example's queues and tenants over test accelerators and deployments."""
    return PoolState(
        pool="default",
        config=config or PolicyConfig(preempt_min_runtime_s=30, preempt_grace_s=20),
        catalog=Catalog(
            accelerators=accelerators, deployments=deployments, tenants=catalog.tenants, queues=catalog.queues
        ),
    )


# ---- the catalogs ---------------------------------------------------------------------------


def test_seed_003_example_catalog_has_the_seed_table() -> None:
    classes = seed003().classes
    # Highest first across queues; equal priorities keep queue order (merge before eval).
    assert list(classes) == [
        "inference.realtime",
        "merge.critical",
        "merge.high",
        "eval.high",
        "merge.normal",
        "eval.normal",
        "inference.normal",
        "merge.low",
        "eval.low",
    ]
    assert classes["merge.critical"].preempts == ("merge.normal", "merge.low")
    assert classes["inference.realtime"].preempts == ("inference.normal",)
    assert all(not classes[c].preempts for c in classes if c.startswith("eval."))
    assert {c.queue: c.queue_weight for c in classes.values()} == {"inference": 3.0, "merge": 2.0, "eval": 1.0}


def test_seed_000_written_out_is_the_built_in_default() -> None:
    written, _ = load_catalog_file(SEED_000)
    built_in = Catalog()
    assert written.classes == built_in.classes
    assert list(built_in.classes) == ["production", "interactive", "background", "benchmark", "maintenance"]
    assert built_in.classes["interactive"].preempts == ("background", "benchmark", "maintenance")
    assert [c.production for c in built_in.classes.values()] == [True, False, False, False, False]


def _queues(*levels: dict[str, Any], name: str = "merge") -> dict[str, Any]:
    return {"queues": [{"name": name, "levels": list(levels)}]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_queues({"name": "high", "priority": 2, "preempts": ["nope"]}), "no level 'nope'"),
        (
            _queues({"name": "low", "priority": 1, "preempts": ["high"]}, {"name": "high", "priority": 2}),
            "may only preempt lower priorities",
        ),
        (
            _queues({"name": "a", "priority": 2, "preempts": ["b"]}, {"name": "b", "priority": 2}),
            "may only preempt lower priorities",
        ),
        (_queues({"name": "a", "priority": 2}, {"name": "a", "priority": 1}), "duplicate level 'a'"),
        (
            {"queues": [{"name": "q", "levels": [{"name": "a", "priority": 1}]}] * 2},
            "duplicate 'q'",
        ),
        (
            _queues({"name": "rt", "priority": 5, "production": True}, {"name": "batch", "priority": 5}),
            "priority 5 is shared by production and other levels",
        ),
        ({"queues": [{"name": "Merge Queue", "levels": [{"name": "a", "priority": 1}]}]}, "queues.0.name"),
        ({"queues": [{"name": "empty", "levels": []}]}, "queues.0.levels"),
        (
            {**_queues({"name": "a", "priority": 1}), "tenants": [{"name": "t", "default_priority": "interactive"}]},
            "no class 'interactive'",
        ),
        (
            {
                **_queues({"name": "a", "priority": 2}, {"name": "b", "priority": 1}),
                "tenants": [{"name": "t", "default_priority": "merge.a", "max_priority": "merge.b"}],
            },
            "'merge.a' is above max_priority 'merge.b'",
        ),
        (
            {**_queues({"name": "a", "priority": 1}), "tenants": [{"name": "t", "queues": ["eval"]}]},
            "no queue 'eval'",
        ),
    ],
)
def test_bad_queue_configuration_is_refused_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(CatalogError) as caught:
        parse_catalog(data)
    assert caught.value.failure == FailureClass.REQUEST_INVALID
    assert message in caught.value.message


def test_a_tenant_without_classes_gets_the_first_queues_lowest_level_as_default_and_ceiling() -> None:
    catalog, _ = parse_catalog(
        {**_queues({"name": "a", "priority": 2}, {"name": "b", "priority": 1}), "tenants": [{"name": "t"}]}
    )
    [t] = catalog.tenants
    assert (t.default_priority, t.max_priority) == ("merge.b", "merge.b")


# ---- classes stamped from identity ----------------------------------------------------------


@pytest.mark.parametrize(
    ("tenant", "asked", "expected"),
    [
        ("merge-team", None, "merge.normal"),  # the tenant's default
        ("merge-team", "critical", "merge.critical"),  # a bare level in the tenant's own queue
        ("merge-team", "merge.low", "merge.low"),
        ("app", "realtime", "inference.realtime"),
        ("eval-team", "high", "eval.high"),  # eval's high, not merge's
        ("default", "normal", "eval.normal"),
        ("default", "merge.low", "merge.low"),  # no queue list: any queue, under the ceiling
    ],
)
def test_classes_are_stamped_from_identity(tenant: str, asked: str | None, expected: str) -> None:
    s = pool(seed003(), [gpu()], [deployment()])
    assert resolve_priority(s, ask("r", tenant_name=tenant, priority=asked)) == expected


@pytest.mark.parametrize(
    ("tenant", "asked", "message"),
    [
        ("eval-team", "critical", "may submit to eval, not queue 'merge'"),
        ("app", "low", "'low' is a level of merge, eval: name the queue (merge.low, eval.low)"),
        ("eval-team", "eval.urgent", "unknown priority 'eval.urgent'"),
        ("merge-team", "production", "unknown priority 'production'"),
        ("default", "eval.high", "may ask for at most 'eval.normal', not 'eval.high'"),
        ("default", "merge.critical", "may ask for at most 'eval.normal', not 'merge.critical'"),
    ],
)
def test_a_class_outside_the_identity_is_refused_saying_why(tenant: str, asked: str, message: str) -> None:
    s = pool(seed003(), [gpu()], [deployment()])
    with pytest.raises(AdmissionRejected) as caught:
        resolve_priority(s, ask("r", tenant_name=tenant, priority=asked))
    assert caught.value.failure == FailureClass.REQUEST_INVALID
    assert message in caught.value.message


# ---- order ------------------------------------------------------------------------------------


def test_queue_order_is_level_priority_across_queues_then_fair_share_then_submission() -> None:
    catalog = seed003()
    s = pool(catalog, [gpu()], [deployment()])
    asks = [
        ("e-low", "eval-team", "eval.low"),
        ("m-normal", "merge-team", "merge.normal"),
        ("i-normal", "app", "inference.normal"),
        ("m-critical", "merge-team", "merge.critical"),
        ("e-high", "eval-team", "eval.high"),
        ("i-realtime", "app", "inference.realtime"),
    ]
    for offset, (request_id, tenant_name, klass) in enumerate(asks):
        enqueue(s, ask(request_id, tenant_name=tenant_name), klass, NOW + offset)
    # No usage yet: equal scores, so equal priorities (normal: 20) go by submission time.
    assert [q.request_id for q in queue_order(s, NOW + 10)] == [
        "i-realtime",  # 50
        "m-critical",  # 40
        "e-high",  # 30
        "m-normal",  # 20, submitted at +1
        "i-normal",  # 20, submitted at +2
        "e-low",  # 10
    ]
    # The merge team has used 100 GPU-seconds, nobody else anything: at priority 20 the
    # inference tenant (score 1 + (target - 0) / target = 2) now goes before merge (score 0).
    from modelforge.policy import TenantUsage

    s.usage["merge/merge-team"] = TenantUsage(gpu_seconds=100, updated_at=NOW)
    order = [q.request_id for q in queue_order(s, NOW + 10)]
    assert order.index("i-normal") < order.index("m-normal")
    assert order[:3] == ["i-realtime", "m-critical", "e-high"]


# ---- preemption between levels -----------------------------------------------------------------


def running_job(job_class: str, tenant_name: str) -> PoolState:
    """One 24 GiB card (1 GiB reserve) running a 16 GiB preemptible job of `job_class` since NOW;
    the asker's job needs 12 GiB: 24 - 1 - 16 = 7 GiB free < 12."""
    s = pool(
        seed003(),
        [gpu("n/0", total=24)],
        [
            deployment("job@1", gib=16, residency=Residency.NONE, preemptible=True),
            deployment("other@1", gib=12, residency=Residency.NONE, preemptible=True),
        ],
    )
    observe(s, "n/0", at=NOW)
    enqueue(s, ask("job", "job@1", tenant_name=tenant_name), job_class, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    resident_ready(s, "job@1@n/0", 16 * GiB, NOW)
    observe(s, "n/0", managed_gib=16, at=NOW, loaded=["job@1@n/0"])
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert len(s.leases) == 1
    return s


@pytest.mark.parametrize(
    ("job_class", "job_tenant", "asker_class", "asker_tenant", "preempted"),
    [
        ("merge.low", "merge-team", "merge.critical", "merge-team", True),
        ("merge.normal", "merge-team", "merge.critical", "merge-team", True),
        ("merge.high", "merge-team", "merge.critical", "merge-team", False),  # not in critical's list
        ("eval.low", "eval-team", "merge.critical", "merge-team", False),  # another queue's work
        ("eval.low", "eval-team", "eval.high", "eval-team", False),  # eval: no preemption
        ("inference.normal", "app", "inference.realtime", "app", True),
        ("merge.normal", "merge-team", "inference.realtime", "app", False),  # not in realtime's list
        ("merge.low", "merge-team", "merge.high", "merge-team", False),  # high preempts nothing
    ],
)
def test_levels_preempt_exactly_what_their_queue_says(
    job_class: str, job_tenant: str, asker_class: str, asker_tenant: str, preempted: bool
) -> None:
    s = running_job(job_class, job_tenant)
    at = NOW + 60  # past the 30 s minimum runtime
    observe(s, "n/0", managed_gib=16, at=at, loaded=["job@1@n/0"])
    enqueue(s, ask("asker", "other@1", tenant_name=asker_tenant), asker_class, at)
    decisions = decide(s, at)
    assert decisions.grants == [] and decisions.loads == []
    if preempted:
        [preempt] = decisions.preemptions
        assert preempt.request_id == "job"
        assert f"{asker_class} other@1 needs room on n/0" in preempt.reason
    else:
        assert decisions.preemptions == []
        [wait] = [w for w in decisions.waits if w.request_id == "asker"]
        assert "n/0" in wait.reason


def test_a_preempted_job_is_requeued_at_its_original_level() -> None:
    s = running_job("merge.low", "merge-team")
    at = NOW + 60
    observe(s, "n/0", managed_gib=16, at=at, loaded=["job@1@n/0"])
    enqueue(s, ask("asker", "other@1", tenant_name="merge-team"), "merge.critical", at)
    apply_decisions(s, decide(s, at), at, {})
    [lease] = list(s.leases.values())
    release_lease(s, lease.lease_id, at + 5, "preempted")
    requeued = ask("job", "job@1", tenant_name="merge-team", priority=lease.priority, preempted=True, submitted_at=NOW)
    klass = resolve_priority(s, requeued)
    queued = enqueue(s, requeued, klass, at + 5)
    assert (queued.priority, queued.preempted, queued.submitted_at) == ("merge.low", True, NOW)


# ---- fair share between queues -------------------------------------------------------------------


@pytest.mark.parametrize(("merge_weight", "eval_weight"), [(2.0, 1.0), (1.0, 3.0), (1.0, 1.0)])
def test_saturated_queues_share_the_pool_by_queue_weight(merge_weight: float, eval_weight: float) -> None:
    """Two tenants, one per queue, at the same priority (normal: 20) saturate one warm slot; over
    150 leases of 10 s each the queues' GPU time splits by their weights, within 10%."""
    catalog, _ = parse_catalog(
        {
            "queues": [
                {"name": "merge", "weight": merge_weight, "levels": [{"name": "normal", "priority": 20}]},
                {"name": "eval", "weight": eval_weight, "levels": [{"name": "normal", "priority": 20}]},
            ],
            "tenants": [
                {"name": "m", "queues": ["merge"], "default_priority": "merge.normal"},
                {"name": "e", "queues": ["eval"], "default_priority": "eval.normal"},
            ],
        }
    )
    s = pool(catalog, [gpu("a/0")], [deployment("emb@1", gib=1, queue_limit=100, residency=Residency.ALWAYS_WARM)])
    resident(s, "emb@1", "a/0", 1, residency=Residency.ALWAYS_WARM)
    now = NOW
    for serial in range(150):
        observe(s, "a/0", managed_gib=1, at=now, loaded=["emb@1@a/0"])
        for tenant_name, klass in (("m", "merge.normal"), ("e", "eval.normal")):
            if not any(q.tenant == tenant_name for q in s.queue):
                enqueue(s, ask(f"{tenant_name}{serial}", tenant_name=tenant_name, lease_timeout_s=10**5), klass, now)
        decisions = decide(s, now)
        assert len(decisions.grants) == 1
        apply_decisions(s, decisions, now, {})
        now += 10
        for lease_id in list(s.leases):
            release_lease(s, lease_id, now, "ok")
    merge_s = s.usage["merge/m"].gpu_seconds
    eval_s = s.usage["eval/e"].gpu_seconds
    target = merge_weight / (merge_weight + eval_weight)
    # e.g. 2:1 -> merge's target share 0.667; within 10% is 0.600..0.733.
    assert abs(merge_s / (merge_s + eval_s) - target) <= 0.10 * target


@pytest.mark.parametrize(
    ("job_class", "asker_class", "preempted"),
    [
        ("merge.low", "merge.critical", True),
        ("merge.high", "merge.critical", False),
        ("eval.low", "eval.high", False),
    ],
)
def test_a_slot_of_the_same_deployment_is_freed_by_preempting_its_holder(
    job_class: str, asker_class: str, preempted: bool
) -> None:
    """Same job type, one slot (concurrency 1): no bytes to find, only the slot. The asker
    preempts the holder if its level may, and then waits for that slot, not a second one."""
    tenant_name = "eval-team" if job_class.startswith("eval") else "merge-team"
    s = running_job(job_class, tenant_name)
    at = NOW + 60
    observe(s, "n/0", managed_gib=16, at=at, loaded=["job@1@n/0"])
    enqueue(s, ask("asker", "job@1", tenant_name=tenant_name), asker_class, at)
    enqueue(s, ask("asker2", "job@1", tenant_name=tenant_name), asker_class, at + 1)
    decisions = decide(s, at + 1)
    assert decisions.grants == []
    if preempted:
        [preempt] = decisions.preemptions  # one slot wanted first: one holder stopped, not two
        assert preempt.request_id == "job"
        assert f"{asker_class} job@1 needs a slot of job@1@n/0" in preempt.reason
        apply_decisions(s, decisions, at + 1, {})
        # The next pass stops nothing more while that slot is being freed.
        assert decide(s, at + 2).preemptions == []
    else:
        assert decisions.preemptions == []
