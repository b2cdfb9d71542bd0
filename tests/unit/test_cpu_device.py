"""The host CPU declared as a device (`kind = "cpu"`) is for the deployments placed there, never a
fallback: work whose placement list does not name it never lands on it, whatever the class, the
fit or the pressure on the cards."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.domain import Priority, Residency
from modelforge.failures import FailureClass
from modelforge.policy import PoolState, decide, enqueue, filter_accelerators, validate_request
from tests.builders import NOW, ask, deployment, gpu, observe, state

CARD = gpu("g/0", total=24)
# A CPU device that a small model fits best: 4 GiB, less 256 MiB, leaves less over than the card.
CPU = gpu("g/cpu", total=4, production=False, reserve=0.25, model="host CPU", kind="cpu")


@dataclass(frozen=True)
class Case:
    name: str
    placement: list[str] = field(default_factory=list)  # the deployment's `accelerators`
    pool: tuple[str, ...] = ("g/0", "g/cpu")
    priority: Priority = Priority.INTERACTIVE
    card_external_gib: float = 0  # unmanaged usage on the card
    gpu_count: int = 1
    loads_on: str | None = None
    refused: FailureClass | None = None
    reason: str = ""  # in the wait or refusal


CASES = [
    Case("no placement list: the card, though the CPU fits best", loads_on="g/0"),
    Case("no placement list, background", priority=Priority.BACKGROUND, loads_on="g/0"),
    Case("placed on the CPU", placement=["g/cpu"], loads_on="g/cpu"),
    Case("placed on both: best fit may pick the CPU", placement=["g/0", "g/cpu"], loads_on="g/cpu"),
    Case(
        "card full of external usage: waits or is refused, never the CPU",
        card_external_gib=22.5,
        refused=FailureClass.EXTERNAL_GPU_PRESSURE,
        reason="g/0: external",
    ),
    Case(
        "only a CPU device in the pool",
        pool=("g/cpu",),
        refused=FailureClass.CAPABILITY_UNAVAILABLE,
        reason="g/cpu: a CPU device",
    ),
    Case(
        "a gang of two never takes the CPU as its second card",
        gpu_count=2,
        refused=FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
        reason="the pool has 1",
    ),
    Case(
        "production placed on the CPU: refused (a CPU device is never production eligible)",
        placement=["g/cpu"],
        priority=Priority.PRODUCTION,
        refused=FailureClass.CAPABILITY_UNAVAILABLE,
        reason="production_eligible=false",
    ),
]


def _pool(case: Case) -> PoolState:
    accelerators = [a for a in (CARD, CPU) if a.id in case.pool]
    kwargs: dict[str, object] = {"accelerators": case.placement, "gpu_count": case.gpu_count}
    if case.gpu_count > 1:
        kwargs["residency"] = Residency.NONE
    s = state(accelerators, [deployment("emb@1", gib=1, **kwargs)])
    for accelerator in accelerators:
        observe(s, accelerator.id, external_gib=case.card_external_gib if accelerator.kind == "gpu" else 0)
    return s


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_cpu_device_takes_only_what_is_placed_there(case: Case) -> None:
    s = _pool(case)
    request = ask("r1", "emb@1", priority=case.priority)
    _, priority = validate_request(s, request, gangs=True)
    enqueue(s, request, priority, NOW)
    decisions = decide(s, NOW)
    assert [load.accelerator for load in decisions.loads] == ([case.loads_on] if case.loads_on else [])
    assert all("g/cpu" not in grant.lease.accelerators for grant in decisions.grants) or "g/cpu" in case.placement
    if case.refused is not None:
        [reject] = decisions.rejects
        assert reject.failure == case.refused, reject
        assert case.reason in reject.message, reject.message
    else:
        assert decisions.rejects == []


def test_the_filter_says_why_a_cpu_device_is_out() -> None:
    s = state([CARD, CPU], [deployment("emb@1", gib=1)])
    results = {r.accelerator: r for r in filter_accelerators(s, s.catalog.deployments[0], "interactive", NOW)}
    assert results["g/0"].passed
    assert not results["g/cpu"].passed and results["g/cpu"].permanent
    assert "a CPU device" in results["g/cpu"].reason


@pytest.mark.parametrize("reporting", [("gpu-node",), ("gpu-node", "desktop")], ids=["gpu-node reports", "both report"])
def test_the_example_catalogs_embedding_never_falls_back_to_the_host_cpu(reporting: tuple[str, ...]) -> None:
    """`modelforge request rag.embedding@1 --tenant default` on the example catalog was
    leased on gpu-node/cpu, which its deployment does not name: now on a GPU, the best fit among
    the cards whose nodes report."""
    catalog, _ = load_catalog_file(example_catalog_path())
    s = PoolState(pool="default", catalog=catalog)
    for accelerator in catalog.accelerators:
        if accelerator.node in reporting:
            observe(s, accelerator.id, external_gib=6 if accelerator.id == "gpu-node/0" else 0)
    request = ask("r1", "rag.embedding@1", tenant_name="default")
    _, priority = validate_request(s, request)
    enqueue(s, request, priority, NOW)
    [load] = decide(s, NOW).loads
    assert load.deployment == "rag.embedding@1"
    assert load.accelerator == ("gpu-node/0" if reporting == ("gpu-node",) else "desktop/0")
