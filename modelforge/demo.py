"""The example requests `modelforge dev --demo` submits, each printed with its result and the
command line that sends the same request."""

from __future__ import annotations

import json
import shlex
from typing import Any

from modelforge.client import ModelForgeClient, Result
from modelforge.settings import Settings

# (title, capability, input, tenant, priority): what is sent, exactly as printed.
DEMO_REQUESTS: list[tuple[str, str, dict[str, object], str, str | None]] = [
    (
        "cold start: lease, load, health check, invoke, release, keep warm",
        "rag.embedding@1",
        {"text": "What is a GPU lease?"},
        "rag",
        None,
    ),
    ("warm: the resident model answers without a load", "rag.embedding@1", {"text": "And a second one?"}, "rag", None),
    (
        "load_on_demand: loaded for this lease, unloaded after",
        "chat.small@1",
        {"messages": [{"role": "user", "content": "hello"}]},
        "default",
        None,
    ),
    ("production work never lands on the desktop", "lab.experiment@1", {}, "lab", "production"),
    ("unknown capability", "vision.ocr@9", {}, "default", None),
]
EXPECTED_OK = ("rag.embedding@1", "chat.small@1")


def command_line(capability: str, payload: dict[str, object], tenant: str, priority: str | None) -> str:
    """The `modelforge request` command that sends exactly this request."""
    argv = ["modelforge", "request", capability, "--tenant", tenant]
    if priority is not None:
        argv += ["--priority", priority]
    if payload:
        argv += ["--input", json.dumps(payload)]
    return shlex.join(argv)


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 3:
        head = ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in value[:3])
        return f"[{head}, ... {len(value)} numbers]"
    return str(value)


def describe(result: Result) -> str:
    if result.ok:
        lease = result.lease
        where = f"{lease.accelerator} ({lease.priority})" if lease else "?"
        timing = ", ".join(f"{k}={v:.2f}" if k.endswith("_s") else f"{k}={v:g}" for k, v in result.timings.items())
        output = result.output if isinstance(result.output, dict) else {}
        if isinstance(output.get("text"), str):  # a chat answer
            shown = f"answer={output['text']!r}"
        elif "embedding" in output:
            shown = f"embedding={_short(output['embedding'])}"
        else:
            shown = f"output={result.output}"
        return f"OK on {where}; {timing}; {shown}"
    return f"{result.failure_class}: {result.message}"


async def run_demo(settings: Settings) -> int:
    client = await ModelForgeClient.connect(settings)
    unexpected = 0
    for title, capability, payload, tenant, priority in DEMO_REQUESTS:
        result = await client.request(capability, payload, tenant=tenant, priority=priority)
        print(f"- {title}\n  {command_line(capability, payload, tenant, priority)}: {describe(result)}", flush=True)
        unexpected += int(result.ok != (capability in EXPECTED_OK))
    status = await client.status()
    for acc in status.accelerators:
        print(
            f"  {acc.id}: total {acc.total_bytes} B, external {acc.external_bytes} B, resident "
            f"{acc.resident_bytes} B, schedulable {acc.schedulable_bytes} B",
            flush=True,
        )
    return 1 if unexpected else 0
