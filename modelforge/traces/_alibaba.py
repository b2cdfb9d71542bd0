"""Alibaba GPU cluster trace 2023 (clusterdata, `openb_node_list` and `openb_pod_list` CSVs)
-> a cluster scenario.

- Nodes: each GPU of a node is an accelerator `<node>/<i>` of its model's memory. The trace
  anonymises some models (G2, G3) and gives no memory sizes: the table below is an assumption,
  overridable per model (`--gpu-memory G2=24`).
- Topology: the trace has none. A node's GPUs form one NVLink group (`nvlink:<node>`) and
  nodes are grouped `rack_size` to a rack, in file order: assumptions, stated in the output.
- Tasks: every pod that asks for GPUs and was scheduled in the trace becomes a job at its
  `creation_time`, running `deletion_time - scheduled_time` seconds, on `num_gpu` GPUs (a gang)
  with `gpu_milli / 1000` of the smallest card's usable memory on each (so a whole-card job
  fits any model); gangs require NVLink.
  Pods with `num_gpu = 0` (CPU only) and pods never scheduled (no duration) are counted and
  left out.
- `qos` maps to classes: Guaranteed -> production, LS (latency sensitive) -> interactive,
  Burstable -> background, BE (best effort) -> maintenance and preemptible.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from modelforge.domain import GiB
from modelforge.traces._common import TraceError, write_scenario

# GiB per GPU model. P100/T4/V100 sizes are the products'; G2/G3/A10 are assumptions where the
# trace anonymises the model (A10 is 24 GiB as sold).
DEFAULT_GPU_GIB: dict[str, float] = {
    "P100": 16,
    "T4": 16,
    "V100M16": 16,
    "V100M32": 32,
    "A10": 24,
    "G2": 24,
    "G3": 32,
}
QOS_CLASS = {"Guaranteed": "production", "LS": "interactive", "Burstable": "background", "BE": "maintenance"}


@dataclass(frozen=True)
class AlibabaOptions:
    gpu_gib: dict[str, float] = field(default_factory=dict)
    rack_size: int = 32
    # A smaller cluster of the same mix: this many nodes, evenly spaced through the file (0: all).
    nodes: int = 0
    # This many pods, evenly spaced through the file (0: all), for a lighter replay.
    pods: int = 0
    # Only pods created before this many seconds (0: all).
    max_time_s: float = 0.0


def _rows(path: Path, required: set[str]) -> list[dict[str, str]]:
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = required - set(reader.fieldnames or [])
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
            # Each row keeps its line number, so errors name it after sampling too.
            return [{**row, "_line": str(line)} for line, row in enumerate(reader, start=2)]
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None


def _evenly(rows: list[dict[str, str]], count: int) -> list[dict[str, str]]:
    if count <= 0 or count >= len(rows):
        return rows
    return [rows[i * len(rows) // count] for i in range(count)]


def _int(row: dict[str, str], name: str, path: Path, line: int, *, empty: int | None = None) -> int:
    text = (row.get(name) or "").strip()
    if not text and empty is not None:
        return empty
    try:
        value = int(float(text))
    except ValueError:
        raise TraceError(f"{path} line {line}: {name} must be a number, got {text!r}") from None
    if value < 0:
        raise TraceError(f"{path} line {line}: {name} must not be negative, got {value}")
    return value


def convert_alibaba(nodes_csv: Path, pods_csv: Path, out_dir: Path, options: AlibabaOptions | None = None) -> Path:
    options = options or AlibabaOptions()
    gib = {**DEFAULT_GPU_GIB, **options.gpu_gib}
    nodes = _rows(nodes_csv, {"sn", "gpu", "model"})
    pods = _rows(pods_csv, {"name", "num_gpu", "gpu_milli", "qos", "creation_time", "deletion_time", "scheduled_time"})
    if options.nodes < 0 or options.pods < 0:
        raise TraceError("nodes and pods must not be negative")
    nodes = _evenly(nodes, options.nodes)
    pods = _evenly(pods, options.pods)
    reserve = 256 * 1024**2
    accelerators: list[dict[str, object]] = []
    models: dict[str, int] = {}
    largest_gang = 0
    for position, node in enumerate(nodes):
        line = int(node["_line"])
        count = _int(node, "gpu", nodes_csv, line)
        model = node["model"].strip()
        if count == 0:
            continue
        if model not in gib:
            raise TraceError(
                f"{nodes_csv} line {line}: GPU model {model!r} has no memory size; pass --gpu-memory {model}=GiB"
            )
        models[model] = models.get(model, 0) + count
        largest_gang = max(largest_gang, count)
        for index in range(count):
            accelerators.append(
                {
                    "id": f"{node['sn']}/{index}",
                    "node": node["sn"],
                    "total_bytes": int(gib[model] * GiB),
                    "production_eligible": True,
                    "model": model,
                    "nvlink_group": f"nvlink:{node['sn']}" if count > 1 else "",
                    "rack": f"rack-{position // options.rack_size:03d}",
                    "reserve_bytes": reserve,
                }
            )
    if not accelerators:
        raise TraceError(f"{nodes_csv}: no GPUs")
    # gpu_milli is a share of a card: of the smallest card's usable memory, so that a whole-card
    # job fits on any model.
    smallest_model = min(sorted(models), key=lambda m: gib[m])
    card_bytes = int(gib[smallest_model] * GiB) - reserve
    jobs: list[tuple[int, str, dict[str, object]]] = []
    skipped = {"cpu_only": 0, "never_scheduled": 0, "too_large": 0, "after_max_time": 0}
    for pod in pods:
        line = int(pod["_line"])
        num_gpu = _int(pod, "num_gpu", pods_csv, line)
        if num_gpu == 0:
            skipped["cpu_only"] += 1
            continue
        created = _int(pod, "creation_time", pods_csv, line)
        scheduled = _int(pod, "scheduled_time", pods_csv, line, empty=-1)
        deleted = _int(pod, "deletion_time", pods_csv, line, empty=-1)
        if scheduled < 0 or deleted < scheduled:
            skipped["never_scheduled"] += 1
            continue
        if options.max_time_s and created > options.max_time_s:
            skipped["after_max_time"] += 1
            continue
        if num_gpu > largest_gang:
            skipped["too_large"] += 1
            continue
        milli = _int(pod, "gpu_milli", pods_csv, line)
        qos = pod["qos"].strip()
        klass = QOS_CLASS.get(qos)
        if klass is None:
            raise TraceError(f"{pods_csv} line {line}: unknown qos {qos!r} (expected {', '.join(QOS_CLASS)})")
        per_gpu = max(1, card_bytes * min(milli, 1000) // 1000)
        jobs.append(
            (
                created,
                pod["name"],
                {
                    "t": float(created),
                    "capability": "job.gpu@1",
                    "priority": klass,
                    "tenant": f"qos-{qos.lower()}",
                    "service_s": float(deleted - scheduled),
                    "gpu_count": num_gpu,
                    "bytes_per_gpu": per_gpu,
                    "nvlink_required": num_gpu > 1,
                    "preemptible": qos == "BE",
                    "id": pod["name"],
                },
            )
        )
    jobs.sort(key=lambda job: (job[0], job[1]))
    requests = [job[2] for job in jobs]
    tenants = [
        {"name": f"qos-{qos.lower()}", "weight": 1.0, "default_priority": klass, "max_priority": klass}
        for qos, klass in QOS_CLASS.items()
    ]
    scenario: dict[str, object] = {
        # A batch job waits up to a week for its GPUs (the longest lease timeout admission takes).
        "simulation": {"lease_timeout_s": 7 * 24 * 3600.0, "checkpoint_s": 30.0},
        "accelerators": accelerators,
        "deployments": [
            {
                "capability": "job.gpu@1",
                "envelope_bytes": card_bytes,
                # A batch job holds nothing before it runs: its lease carries all its bytes,
                # so jobs of the same shape share a card up to its memory.
                "idle_bytes": 0,
                "residency": "none",
                "concurrency": 64,
                "queue_limit": 1_000_000,
                "measured_on": sorted(models),
            }
        ],
        "tenants": tenants,
    }
    header = (
        f"Converted from {nodes_csv.name} and {pods_csv.name} by `modelforge trace alibaba`.\n"
        f"{len(accelerators)} GPUs on {len(nodes)} nodes; {len(requests)} jobs; left out: "
        + ", ".join(f"{k} {v}" for k, v in skipped.items())
        + f".\nGPU memory (GiB, G2/G3/A10 assumed): {', '.join(f'{m}={gib[m]:g}' for m in sorted(models))}; "
        f"gpu_milli is a share of the smallest card ({smallest_model}, less its reserve).\n"
        f"Assumed topology: one NVLink group per multi-GPU node, {options.rack_size} nodes per rack."
    )
    return write_scenario(out_dir, scenario, requests, header)
