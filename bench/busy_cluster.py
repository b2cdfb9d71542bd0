"""A busy cluster from the shipped Alibaba trace: every node of `data/traces`, a pod list drawn
from the shipped one with half the pods multi-GPU, offered faster than the cluster serves them
(thousands of gangs waiting at once). The shipped
cluster is almost idle (its replay leaves VRAM 0.2% used); a real cluster is busy exactly when
scheduling costs most.

    .venv/bin/python -m bench.busy_cluster OUT_DIR [--pods 8000] [--load 3] [--seed 1] [--max-run-s 3600]

writes OUT_DIR/pods.csv (the Alibaba pod list's columns) and the scenario `modelforge trace
alibaba` makes of it with the shipped node list, and prints where both are. `bench/simulate.py
--busy` builds the same trace (the defaults) and replays it. Deterministic for a seed: the same
files on every run, so only the generator is shipped, not its output.

How the pods are drawn (`busy_pods`):
- half of them single-GPU: a shipped single-GPU pod drawn at random (its share of a card, its
  qos, its run time);
- the other half gangs: 2, 4 or 8 whole cards, in the proportions of the shipped multi-GPU pods
  (16 : 15 : 44), each with the qos and run time of a shipped pod drawn at random;
- arrivals a Poisson process whose rate offers `load` times the cluster's GPU-seconds over the
  span of the arrivals (load 3: three times what the cards can run).

Run times are capped at `max_run_s` (an hour by default). The shipped ones are heavy-tailed
(mean about 31,000 s, median 655 s, p99 41 hours): uncapped, a few pods of months carry most of
the GPU-seconds, the rate worked out from them spreads the arrivals over half a day, and the
cards stay nearly idle while the pods arrive (no gang ever waited). Capped at an hour, the same
8,000 pods arrive over about half an hour at three times what the cards can run.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

from modelforge.traces import AlibabaOptions, convert_alibaba

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
NODES = TRACES / "alibaba_gpu_2023_nodes.csv"
PODS = TRACES / "alibaba_gpu_2023_pods_default.csv"
GANG_SIZES = ((2, 16), (4, 15), (8, 44))  # (GPUs, shipped pods of that size)
MAX_RUN_S = 3600  # a drawn pod's run time at most (the shipped tail runs for months)
COLUMNS = [
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
]


def _shipped(pods_csv: Path) -> list[dict[str, str]]:
    """The shipped pods that ran on GPUs (scheduled, with a run time)."""
    with pods_csv.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return [
        row
        for row in rows
        if int(row["num_gpu"] or 0) > 0
        and row["scheduled_time"]
        and row["deletion_time"]
        and int(row["deletion_time"]) >= int(row["scheduled_time"])
    ]


def _gpus(nodes_csv: Path) -> int:
    with nodes_csv.open(newline="", encoding="utf-8") as handle:
        return sum(int(row["gpu"] or 0) for row in csv.DictReader(handle))


def busy_pods(
    out_csv: Path,
    pods: int = 8_000,
    load: float = 3.0,
    seed: int = 1,
    nodes_csv: Path = NODES,
    pods_csv: Path = PODS,
    max_run_s: int = MAX_RUN_S,
) -> dict[str, float]:
    """Writes the busy pod list to `out_csv`; returns what it drew (pods, gangs, arrival span)."""
    rng = random.Random(seed)
    shipped = _shipped(pods_csv)
    single = [row for row in shipped if int(row["num_gpu"]) == 1]
    sizes = [size for size, _ in GANG_SIZES]
    weights = [count for _, count in GANG_SIZES]
    drawn: list[tuple[int, int, str, int]] = []  # (GPUs, milli, qos, run seconds)
    for n in range(pods):
        if n % 2 == 0:
            row = rng.choice(single)
            drawn.append((1, int(row["gpu_milli"]), row["qos"], min(_run_s(row), max_run_s)))
        else:
            row = rng.choice(shipped)
            drawn.append((rng.choices(sizes, weights)[0], 1000, row["qos"], min(_run_s(row), max_run_s)))
    gpu_s = sum(gpus * milli / 1000 * run_s for gpus, milli, _, run_s in drawn)
    span = gpu_s / (load * _gpus(nodes_csv))
    mean_gap = span / pods
    t = 0.0
    with out_csv.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for n, (gpus, milli, qos, run_s) in enumerate(drawn):
            created = int(t)
            writer.writerow(
                [
                    f"busy-pod-{n:05d}",
                    8000,
                    16384,
                    gpus,
                    milli,
                    "",
                    qos,
                    "Succeeded",
                    created,
                    created + run_s,
                    created,
                ]
            )
            t += rng.expovariate(1.0 / mean_gap)
    return {"pods": pods, "gangs": sum(1 for d in drawn if d[0] > 1), "span_s": t, "gpu_s": gpu_s}


def _run_s(row: dict[str, str]) -> int:
    return max(1, int(row["deletion_time"]) - int(row["scheduled_time"]))


def busy_scenario(
    out_dir: Path, pods: int = 8_000, load: float = 3.0, seed: int = 1, max_run_s: int = MAX_RUN_S
) -> tuple[Path, dict[str, float]]:
    """The busy pod list and its scenario (every shipped node) under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = busy_pods(out_dir / "pods.csv", pods, load, seed, max_run_s=max_run_s)
    scenario = convert_alibaba(NODES, out_dir / "pods.csv", out_dir / "scenario", AlibabaOptions())
    return scenario, drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--pods", type=int, default=8_000)
    parser.add_argument("--load", type=float, default=3.0, help="offered GPU-seconds over the cluster's, >1: busy")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-run-s", type=int, default=MAX_RUN_S, help="a pod's run time at most")
    args = parser.parse_args()
    scenario, drawn = busy_scenario(args.out_dir, args.pods, args.load, args.seed, args.max_run_s)
    print(
        f"{int(drawn['pods']):,} pods ({int(drawn['gangs']):,} gangs) arriving over {drawn['span_s']:,.0f} s: "
        f"{args.out_dir / 'pods.csv'}; scenario {scenario}"
    )


if __name__ == "__main__":
    main()
