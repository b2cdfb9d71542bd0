"""Model artifacts before a load: confined to the configured roots (no traversal, no symlink out)
and checked against the catalog's sha256 (ARTIFACT_CORRUPT), so a runtime never opens a file the
operator did not put where models live, nor a file that is not the one the catalog describes."""

from __future__ import annotations

import hashlib
from pathlib import Path

from modelforge.failures import FailureClass, ModelForgeError

_CHUNK = 1 << 20


def resolve_artifact(artifact: str, roots: list[Path]) -> Path:
    """The artifact's real path (symlinks resolved), which must lie inside one of `roots`.
    A relative artifact is relative to the first root."""
    if not roots:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, "no artifact roots are configured (MODELFORGE_ARTIFACT_ROOTS)"
        )
    if "\x00" in artifact:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "artifact path contains a NUL byte")
    candidate = Path(artifact)
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    real = candidate.resolve()
    for root in roots:
        if real.is_relative_to(root.resolve()):
            if not real.exists():
                raise ModelForgeError(FailureClass.MODEL_LOAD_FAILED, f"artifact {artifact!r} does not exist")
            return real
    raise ModelForgeError(
        FailureClass.REQUEST_INVALID,
        f"artifact {artifact!r} is outside the artifact roots ({', '.join(str(r) for r in roots)})",
    )


def artifact_digest(path: Path) -> str:
    """sha256 of a file; of a directory, sha256 over its files' relative paths and digests, in
    sorted order (a model directory is one artifact)."""
    if path.is_file():
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()
    manifest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        manifest.update(f"{file.relative_to(path).as_posix()}\0{artifact_digest(file)}\n".encode())
    return manifest.hexdigest()


def verify_artifact(path: Path, sha256: str) -> None:
    if not sha256:
        return
    found = artifact_digest(path)
    if found != sha256:
        raise ModelForgeError(
            FailureClass.ARTIFACT_CORRUPT,
            f"artifact {path.name}: sha256 {found[:16]}... is not the catalog's {sha256[:16]}...",
        )
