"""Scores a merged model against the two models it was merged from: a ModelForge `subprocess_job`
example, the step after examples/jobs/merge_slerp.py.

    python examples/jobs/evaluate.py --model merged.npy [--seed-a 1 --seed-b 2] [--probes 32]

The model is a stack of square layers: merge_slerp.py's `merged.npy`, or its whole output directory
(the layers and their manifest). Through ModelForge, name the merge's `merged.npy` or its
`output_artifact` (the directory) as `artifact:sha256:<digest>` and the node hands over the
verified file or directory. The parents are derived from their seeds as merge_slerp.py derives
them, and the probe set from a fixed seed, so the same files always score the same. Each model
maps a probe x through its layers (h = tanh(W h / sqrt(dim))); the score is the mean cosine
similarity of the merged model's outputs to each parent's. It is written to
MODELFORGE_OUTPUT_DIR/score.json and reported as the result."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_slerp import derived_layer  # the parents, derived the same way

PROBE_SEED = 20261201


def load_model(path: Path) -> np.ndarray:
    """A stack of layers: one `.npy` file (merge_slerp.py's `merged.npy`), or a model directory
    (merge_slerp.py's whole output, the job's output artifact): its `manifest.json` names the
    layers in order with their sha256, each checked before it is used."""
    if not path.is_dir():
        single: np.ndarray = np.load(path, allow_pickle=False)
        return single
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    layers = []
    for name, digest in manifest["layers"].items():
        data = (path / f"{name}.npy").read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"{path / name}.npy: not the layer its manifest names (sha256 differs)")
        layers.append(np.load(io.BytesIO(data), allow_pickle=False))
    return np.stack(layers)


def forward(layers: np.ndarray, probes: np.ndarray) -> np.ndarray:
    hidden = probes.astype(np.float64)
    scale = np.sqrt(layers.shape[-1])
    for weights in layers.astype(np.float64):
        hidden = np.tanh(hidden @ weights.T / scale)
    return hidden


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    dots = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)
    return float(np.mean(dots))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--seed-a", type=int, default=1)
    parser.add_argument("--seed-b", type=int, default=2)
    parser.add_argument("--probes", type=int, default=32)
    args = parser.parse_args()
    merged = load_model(args.model)
    if merged.ndim != 3 or merged.shape[1] != merged.shape[2]:
        print(f"{args.model}: not a stack of square layers (shape {merged.shape})", file=sys.stderr)
        return 65
    count, dim = merged.shape[0], merged.shape[1]
    parents = [np.stack([derived_layer(seed, i, dim) for i in range(count)]) for seed in (args.seed_a, args.seed_b)]
    probes = np.random.default_rng(PROBE_SEED).standard_normal((args.probes, dim))
    outputs = forward(merged, probes)
    score = {
        "similarity_to_a": round(similarity(outputs, forward(parents[0], probes)), 6),
        "similarity_to_b": round(similarity(outputs, forward(parents[1], probes)), 6),
        "layers": count,
        "probes": args.probes,
    }
    output = Path(os.environ.get("MODELFORGE_OUTPUT_DIR", "evaluate-out"))
    output.mkdir(parents=True, exist_ok=True)
    (output / "score.json").write_text(json.dumps(score, indent=1))
    print(json.dumps({"progress": 1.0, "message": "scored", "result": score}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
