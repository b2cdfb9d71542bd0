"""Scores a merged model against the two models it was merged from: a ModelForge `subprocess_job`
example, the step after examples/jobs/merge_slerp.py.

    python examples/jobs/evaluate.py --model merged.npy [--dataset triples.jsonl] [--seed-a 1 --seed-b 2]
    python examples/jobs/evaluate.py --model MODEL_DIR [--dataset triples.jsonl] [--base DIR]
                                     [--model-a DIR --model-b DIR]

The model is a stack of square layers: merge_slerp.py's `merged.npy`, or its whole output directory
(the layers and their manifest). Through ModelForge, name the merge's `merged.npy` or its
`output_artifact` (the directory) as `artifact:sha256:<digest>` and the node hands over the
verified file or directory. The parents are derived from their seeds as merge_slerp.py derives
them.

The evaluation set is a JSON-lines file of sentence triples, `{"anchor", "positive", "negative"}`
(a paraphrase and an unrelated sentence); by default the 36 triples shipped beside this script
(`examples/jobs/data/eval-triples.jsonl`, the project's own text: nothing is downloaded). Each
sentence becomes a vector by feature hashing (its words and character trigrams, hashed with
blake2b into `dim` signed buckets: the same text always gives the same vector), and each model
maps it through its layers (h = tanh(W h / sqrt(dim))). The scores: the mean cosine similarity of
the merged model's outputs to each parent's over every sentence (`similarity_to_a`,
`similarity_to_b`), and for each model the share of triples whose anchor lands closer to its
paraphrase than to the unrelated sentence (`ranking_accuracy`). `--probes N` scores N seeded
random inputs instead (the earlier behaviour). The score is written to
MODELFORGE_OUTPUT_DIR/score.json and reported as the result.

A sentence-transformers model directory (what `merge_slerp.py --base` writes: `modules.json`,
`model.safetensors` and the recipe, `merge.json`) is scored as an embedding model: each sentence
of the set is embedded by the merged model and by its two parents (sentence-transformers on the
CPU; the parents rebuilt from the recipe's base and seeds, or given as `--model-a/--model-b`
directories), with the same scores (`model` is then `"embedding"`, with `dimensions`). The base
must be the one the recipe names (its weights' sha256 is checked): the shipped MiniLM, or
`--base DIR` for another.

Under ModelForge every path argument (`--model`, `--dataset`, `--base`, `--model-a/--model-b`)
must be an artifact of this job (`artifact:sha256:<digest>`) or a path inside the job's own
directories; any other host path is refused as a usage error (exit 2: REQUEST_INVALID)."""

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
from merge_slerp import (  # the parents, made alike; paths taken as the merge takes them
    WEIGHTS,
    allowed_path,
    derived_layer,
    file_sha256,
    resolve_base,
    write_parent,
)

PROBE_SEED = 20261201
DATASET = Path(__file__).resolve().parent / "data" / "eval-triples.jsonl"
FIELDS = ("anchor", "positive", "negative")


def load_triples(path: Path) -> list[dict[str, str]]:
    """The evaluation set: one JSON object per line with the three FIELDS as strings
    (ValueError, or OSError, naming the file and line otherwise)."""
    triples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            triple = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(triple, dict) or not all(isinstance(triple.get(f), str) for f in FIELDS):
            raise ValueError(f"{path}:{number}: needs string fields {', '.join(FIELDS)}")
        triples.append({field: triple[field] for field in FIELDS})
    if not triples:
        raise ValueError(f"{path}: no triples")
    return triples


def embed(text: str, dim: int) -> np.ndarray:
    """A unit vector for `text` by feature hashing: each lower-cased word and character trigram
    adds +-1 in the bucket its blake2b digest names (deterministic across runs and machines)."""
    vector = np.zeros(dim)
    words = "".join(c if c.isalnum() else " " for c in text.lower()).split()
    features = words + [f"#{w[i : i + 3]}" for w in (f" {w} " for w in words) for i in range(len(w) - 2)]
    for feature in features:
        digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
        bucket = int.from_bytes(digest[:4], "little") % dim
        vector[bucket] += 1.0 if digest[4] & 1 else -1.0
    norm = np.linalg.norm(vector)
    return vector / norm if norm else vector


def ranking_accuracy(outputs: np.ndarray) -> float:
    """Share of triples (rows anchor, positive, negative in turn) whose anchor is closer, by
    cosine, to the paraphrase than to the unrelated sentence."""
    unit = outputs / (np.linalg.norm(outputs, axis=1, keepdims=True) + 1e-12)
    anchor, positive, negative = unit[0::3], unit[1::3], unit[2::3]
    return float(np.mean(np.sum(anchor * positive, axis=1) > np.sum(anchor * negative, axis=1)))


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


def is_model_directory(path: Path) -> bool:
    return path.is_dir() and (path / "modules.json").is_file() and (path / WEIGHTS).is_file()


def score_embedding_model(args: argparse.Namespace, triples: list[dict[str, str]]) -> dict[str, object]:
    """The merged embedding model against its parents on the triples (see the docstring)."""
    import tempfile

    from sentence_transformers import SentenceTransformer

    recipe = json.loads((args.model / "merge.json").read_text(encoding="utf-8"))
    sentences = [t[field] for t in triples for field in FIELDS]
    with tempfile.TemporaryDirectory(prefix="evaluate-parents-") as scratch:
        if args.model_a is not None and args.model_b is not None:
            parents = [args.model_a, args.model_b]
        else:
            seeds = [recipe["parents"][name].get("seed") for name in ("a", "b")]
            if None in seeds:
                raise SystemExit("the merge's parents were model directories: give them as --model-a and --model-b")
            if args.base is None and recipe["base"] == "directory":
                raise SystemExit("the merge's base was a model directory: give it as --base")
            base, _ = resolve_base(args.base or recipe["base"])
            if file_sha256(base / WEIGHTS) != recipe["base_sha256"]:
                raise SystemExit(f"{base}: not the base this merge was made from (its weights' sha256 differs)")
            scale = float(recipe["parents"]["delta_scale"])
            parents = [write_parent(base, seed, scale, Path(scratch) / f"parent-{seed}") for seed in seeds]
        vectors = []
        for step, directory in enumerate([args.model, *parents]):
            model = SentenceTransformer(str(directory), device="cpu", local_files_only=True)
            vectors.append(np.asarray(model.encode(sentences, normalize_embeddings=True), dtype=np.float64))
            del model
            report = {"progress": 0.2 + 0.25 * step, "message": f"embedded {len(sentences)} sentences ({step + 1}/3)"}
            print(json.dumps(report), flush=True)
    merged, a, b = vectors
    return {
        "similarity_to_a": round(similarity(merged, a), 6),
        "similarity_to_b": round(similarity(merged, b), 6),
        "ranking_accuracy": {
            name: round(ranking_accuracy(result), 6) for name, result in (("merged", merged), ("a", a), ("b", b))
        },
        "model": "embedding",
        "dimensions": int(merged.shape[1]),
        "t": recipe["t"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dataset", type=Path, default=DATASET, help="sentence triples, JSON lines")
    parser.add_argument("--seed-a", type=int, default=1)
    parser.add_argument("--seed-b", type=int, default=2)
    parser.add_argument("--probes", type=int, help="score this many seeded random inputs instead of the dataset")
    parser.add_argument("--base", help="a model directory's base, when not the shipped MiniLM")
    parser.add_argument("--model-a", type=Path, help="a model directory's first parent (else from its recipe)")
    parser.add_argument("--model-b", type=Path, help="a model directory's second parent (else from its recipe)")
    args = parser.parse_args()
    args.model = allowed_path(args.model, "--model")
    if args.dataset != DATASET:  # the shipped dataset is the example's own
        args.dataset = allowed_path(args.dataset, "--dataset")
    for option in ("model_a", "model_b"):
        if getattr(args, option) is not None:
            setattr(args, option, allowed_path(getattr(args, option), f"--{option.replace('_', '-')}"))
    if is_model_directory(args.model):
        if args.probes is not None:
            parser.error("--probes: a model directory is scored on sentences (--dataset)")
        if (args.model_a is None) != (args.model_b is None):
            parser.error("give both --model-a and --model-b, or neither")
        try:
            triples = load_triples(args.dataset)
        except (OSError, ValueError) as error:
            parser.error(f"--dataset: {error}")
        print(json.dumps({"progress": 0.1, "message": f"{len(triples)} triples from {args.dataset.name}"}), flush=True)
        scored = {**score_embedding_model(args, triples), "dataset": args.dataset.name, "triples": len(triples)}
        return write_score(scored)
    merged = load_model(args.model)
    if merged.ndim != 3 or merged.shape[1] != merged.shape[2]:
        print(f"{args.model}: not a stack of square layers (shape {merged.shape})", file=sys.stderr)
        return 65
    count, dim = merged.shape[0], merged.shape[1]
    parents = [np.stack([derived_layer(seed, i, dim) for i in range(count)]) for seed in (args.seed_a, args.seed_b)]
    if args.probes is not None:
        probes = np.random.default_rng(PROBE_SEED).standard_normal((args.probes, dim))
        source: dict[str, object] = {"probes": args.probes}
    else:
        try:
            triples = load_triples(args.dataset)
        except (OSError, ValueError) as error:  # exit 2: the request's arguments are wrong
            parser.error(f"--dataset: {error}")
        probes = np.stack([embed(t[field], dim) for t in triples for field in FIELDS])
        source = {"dataset": args.dataset.name, "triples": len(triples), "probes": len(probes)}
        print(json.dumps({"progress": 0.1, "message": f"{len(triples)} triples from {args.dataset.name}"}), flush=True)
    outputs = forward(merged, probes)
    parent_outputs = [forward(parent, probes) for parent in parents]
    score: dict[str, object] = {
        "similarity_to_a": round(similarity(outputs, parent_outputs[0]), 6),
        "similarity_to_b": round(similarity(outputs, parent_outputs[1]), 6),
        "layers": count,
        **source,
    }
    if args.probes is None:
        score["ranking_accuracy"] = {
            name: round(ranking_accuracy(result), 6)
            for name, result in (("merged", outputs), ("a", parent_outputs[0]), ("b", parent_outputs[1]))
        }
    return write_score(score)


def write_score(score: dict[str, object]) -> int:
    output = Path(os.environ.get("MODELFORGE_OUTPUT_DIR", "evaluate-out"))
    output.mkdir(parents=True, exist_ok=True)
    (output / "score.json").write_text(json.dumps(score, indent=1))
    print(json.dumps({"progress": 1.0, "message": "scored", "result": score}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
