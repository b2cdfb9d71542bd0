"""A 2-rank (or N-rank) torch.distributed job: a ModelForge `subprocess_job` gang example.

    python examples/jobs/allreduce.py [--steps 10] [--step-delay-s 0]

Each rank is one node's part of a gang lease; ModelForge gives it RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT (gloo on the CPU, so it runs anywhere). Every step all-reduces (sums) a tensor of
(rank + 1) x step over the ranks and adds it to a running total, then checkpoints (step, total)
into MODELFORGE_CHECKPOINT_DIR. On SIGTERM the ranks agree (an all-reduce of their stop flags)
to stop after the same step, and each exits 75 with its checkpoint; resumed from them
(MODELFORGE_RESUME_FROM), they go on from that step. Rank 0 writes the total to
MODELFORGE_OUTPUT_DIR/total.json: sum over ranks of (rank + 1), times steps x (steps + 1) / 2."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

CHECKPOINTED_EXIT = 75
_stop = False


def _on_signal(signum: int, frame: object) -> None:
    global _stop
    _stop = True


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _on_signal)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoints = Path(os.environ.get("MODELFORGE_CHECKPOINT_DIR", f"allreduce-out/rank{rank}"))
    checkpoints.mkdir(parents=True, exist_ok=True)
    start, total = 0, torch.zeros(4, dtype=torch.float64)
    resume = os.environ.get("MODELFORGE_RESUME_FROM", "")
    if resume:
        saved = json.loads(Path(resume).read_text(encoding="utf-8"))
        start, total = int(saved["step"]), torch.tensor(saved["total"], dtype=torch.float64)
        report(progress=start / args.steps, message=f"rank {rank}: resumed after step {start}")
    # Every rank resumes from the same step, or the sums go wrong: checked before anything else.
    first = torch.tensor([float(start)])
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    if int(first.item()) != start:
        print(f"rank {rank} resumes at step {start}, another at {int(first.item())}", file=sys.stderr)
        return 65
    for step in range(start, args.steps):
        flag = torch.tensor([1.0 if _stop else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks stop after the same step
        if flag.item() > 0:
            report(message=f"rank {rank}: stopping after step {step} (exit 75)")
            dist.destroy_process_group()
            return CHECKPOINTED_EXIT
        contribution = torch.full((4,), float((rank + 1) * (step + 1)), dtype=torch.float64)
        dist.all_reduce(contribution, op=dist.ReduceOp.SUM)
        total += contribution
        state = checkpoints / "state.json"
        aside = state.with_name("state.json.tmp")
        aside.write_text(json.dumps({"step": step + 1, "total": total.tolist(), "rank": rank, "world": world}))
        aside.replace(state)
        report(progress=(step + 1) / args.steps, message=f"rank {rank}: step {step + 1}", checkpoint=str(state))
        waited = 0.0
        while waited < args.step_delay_s and not _stop:
            time.sleep(0.02)
            waited += 0.02
    dist.destroy_process_group()
    if rank == 0:
        output = Path(os.environ.get("MODELFORGE_OUTPUT_DIR", "allreduce-out/output"))
        output.mkdir(parents=True, exist_ok=True)
        (output / "total.json").write_text(json.dumps({"total": total.tolist(), "world": world}))
    report(progress=1.0, message=f"rank {rank}: done", result={"total": total.tolist(), "rank": rank, "world": world})
    return 0


if __name__ == "__main__":
    sys.exit(main())
