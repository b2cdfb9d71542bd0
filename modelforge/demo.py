"""The example requests `modelforge dev --demo` submits, each printed with its result."""

from __future__ import annotations

from modelforge.client import ModelForgeClient, Result
from modelforge.settings import Settings

DEMO_REQUESTS: list[tuple[str, str, dict[str, object], str | None]] = [
    (
        "cold start: lease, load, health check, invoke, release, keep warm",
        "rag.embedding@1",
        {"text": "What is a GPU lease?"},
        "rag",
    ),
    ("warm: the resident model answers without a load", "rag.embedding@1", {"text": "And a second one?"}, "rag"),
    ("load_on_demand: loaded for this lease, unloaded after", "chat.small@1", {"prompt": "hello"}, "default"),
    ("production work never lands on the desktop", "lab.experiment@1", {}, "lab"),
    ("unknown capability", "vision.ocr@9", {}, "default"),
]


def describe(result: Result) -> str:
    if result.ok:
        lease = result.lease
        where = f"{lease.accelerator} ({lease.priority})" if lease else "?"
        timing = ", ".join(f"{k}={v:.2f}" if k.endswith("_s") else f"{k}={v:g}" for k, v in result.timings.items())
        return f"OK on {where}; {timing}; output={result.output}"
    return f"{result.failure_class}: {result.message}"


async def run_demo(settings: Settings) -> int:
    client = await ModelForgeClient.connect(settings)
    unexpected = 0
    for title, capability, payload, tenant in DEMO_REQUESTS:
        priority = "production" if capability == "lab.experiment@1" else None
        result = await client.request(capability, payload, tenant=tenant or "default", priority=priority)
        print(f"- {title}\n  modelforge request {capability} --tenant {tenant}: {describe(result)}", flush=True)
        expected_ok = capability in ("rag.embedding@1", "chat.small@1")
        unexpected += int(result.ok != expected_ok)
    status = await client.status()
    for acc in status.accelerators:
        print(
            f"  {acc.id}: total {acc.total_bytes} B, external {acc.external_bytes} B, resident "
            f"{acc.resident_bytes} B, schedulable {acc.schedulable_bytes} B",
            flush=True,
        )
    return 1 if unexpected else 0
