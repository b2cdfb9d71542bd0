"""SLERP of two models' weights, layer by layer: a ModelForge `subprocess_job` example.

    python examples/jobs/merge_slerp.py [--t 0.5] [--layers 8] [--dim 128] [--seed-a 1 --seed-b 2]
                                        [--model-a A.npz --model-b B.npz] [--layer-delay-s 0]

Without `--model-a/--model-b` the two models are derived deterministically from their seeds (a
small stand-in for two fine-tunes of one base: the same base weights plus a different delta).
Each merged layer is checkpointed into MODELFORGE_CHECKPOINT_DIR as it is done, so a preempted
run (SIGTERM) stops after the current layer, exits 75, and the resumed run
(MODELFORGE_RESUME_FROM) merges only the layers left: its output is byte-identical to an
uninterrupted run's. The merged layers are written to MODELFORGE_OUTPUT_DIR as `.npy` files with
a `manifest.json` of their sha256 digests, and stacked into one `merged.npy` (the model as one
artifact, what examples/jobs/evaluate.py takes). Progress is reported as JSON lines on stdout.

Outside ModelForge it runs too (the directories default to ./merge-out)."""

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
_stop_requested = False


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=float, default=0.5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed-a", type=int, default=1)
    parser.add_argument("--seed-b", type=int, default=2)
    parser.add_argument("--model-a", type=Path)
    parser.add_argument("--model-b", type=Path)
    parser.add_argument("--layer-delay-s", type=float, default=0.0, help="slow each layer down (demos, tests)")
    parser.add_argument("--ignore-sigterm", action="store_true", help="misbehave: never checkpoint on SIGTERM")
    args = parser.parse_args()
    if not 0.0 <= args.t <= 1.0 or args.layers < 1 or args.dim < 1:
        parser.error("--t is in 0..1, --layers and --dim at least 1")
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, _on_signal)

    checkpoints = Path(os.environ.get("MODELFORGE_CHECKPOINT_DIR", "merge-out/checkpoints"))
    output = Path(os.environ.get("MODELFORGE_OUTPUT_DIR", "merge-out/output"))
    checkpoints.mkdir(parents=True, exist_ok=True)
    output.mkdir(parents=True, exist_ok=True)

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
