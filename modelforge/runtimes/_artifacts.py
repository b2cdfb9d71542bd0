"""Model artifacts before a load: confined to the configured roots (no traversal, no symlink out)
and checked against the catalog's sha256 (ARTIFACT_CORRUPT), so a runtime never opens a file the
operator did not put where models live, nor a file that is not the one the catalog describes.

The runtime opens exactly what was checked (`check_artifact`): the artifact is resolved once to
an absolute real path inside a root, which is what the runtime is handed (never the catalog's
relative path, which a runtime would open against its own working directory); every file is
hashed from a descriptor opened on that real path (no symlink followed at open), and its
identity (device, inode, size, mtime_ns) taken from that descriptor before and after hashing.
After the runtime's load the node checks the identities again (`CheckedArtifact.verify_unchanged`):
a file replaced or rewritten between the check and the load is ARTIFACT_CORRUPT and the model is
unloaded. Handing over `/proc/self/fd/N` instead was not chosen: model servers (vLLM) read their
weights in worker processes they spawn, which do not inherit the descriptor."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
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
    real = Path(os.path.realpath(candidate))
    if _inside(real, roots):
        if not real.exists():
            raise ModelForgeError(FailureClass.MODEL_LOAD_FAILED, f"artifact {artifact!r} does not exist")
        return real
    raise ModelForgeError(
        FailureClass.REQUEST_INVALID,
        f"artifact {artifact!r} is outside the artifact roots ({', '.join(str(r) for r in roots)})",
    )


def _inside(real: Path, roots: list[Path]) -> bool:
    return any(real.is_relative_to(os.path.realpath(root)) for root in roots)


@dataclass(frozen=True)
class FileIdentity:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileIdentity:
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def _files(path: Path) -> list[Path]:
    """A directory's files, in the order its manifest lists them."""
    return sorted(p for p in path.rglob("*") if p.is_file())


def _hash_file(path: Path, roots: list[Path] | None, read: bool = True) -> tuple[str, FileIdentity]:
    """sha256 of one file read from a descriptor opened on its real path, and the identity of
    what was read; ARTIFACT_CORRUPT when it changed while it was read. `read=False`: the
    identity alone (no sha256 to compare with)."""
    real = Path(os.path.realpath(path))
    if roots is not None and not _inside(real, roots):
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, f"artifact file {path.name!r} links outside the artifact roots"
        )
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise ModelForgeError(
            FailureClass.MODEL_LOAD_FAILED, f"artifact file {path.name!r}: {error.strerror or error}"
        ) from None
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"artifact file {path.name!r} is not a regular file")
        digest = hashlib.sha256()
        while read and (chunk := os.read(fd, _CHUNK)):
            digest.update(chunk)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if FileIdentity.of(before) != FileIdentity.of(after):
        raise ModelForgeError(
            FailureClass.ARTIFACT_CORRUPT, f"artifact file {path.name!r} changed while it was checked"
        )
    return digest.hexdigest(), FileIdentity.of(before)


def _digest(path: Path, roots: list[Path] | None, read: bool = True) -> tuple[str, dict[str, FileIdentity]]:
    if not path.is_dir():
        digest, identity = _hash_file(path, roots, read)
        return digest, {"": identity}
    identities: dict[str, FileIdentity] = {}
    manifest = hashlib.sha256()
    for file in _files(path):
        name = file.relative_to(path).as_posix()
        digest, identities[name] = _hash_file(file, roots, read)
        manifest.update(f"{name}\0{digest}\n".encode())
    return manifest.hexdigest(), identities


def artifact_digest(path: Path) -> str:
    """sha256 of a file; of a directory, sha256 over its files' relative paths and digests, in
    sorted order (a model directory is one artifact)."""
    return _digest(path, None)[0]


def verify_artifact(path: Path, sha256: str) -> None:
    if not sha256:
        return
    found = artifact_digest(path)
    if found != sha256:
        raise ModelForgeError(
            FailureClass.ARTIFACT_CORRUPT,
            f"artifact {path.name}: sha256 {found[:16]}... is not the catalog's {sha256[:16]}...",
        )


def _identities_now(path: Path) -> dict[str, FileIdentity] | None:
    try:
        if not path.is_dir():
            return {"": FileIdentity.of(os.stat(path))}
        return {file.relative_to(path).as_posix(): FileIdentity.of(os.stat(file)) for file in _files(path)}
    except OSError:
        return None


@dataclass(frozen=True)
class CheckedArtifact:
    """An artifact as the node checked it: `path` is what the runtime is handed."""

    path: Path
    digest: str
    identities: dict[str, FileIdentity]

    def verify_unchanged(self) -> None:
        """ARTIFACT_CORRUPT unless every file is still the one hashed (same device, inode, size
        and mtime) and no file came or went."""
        if _identities_now(self.path) != self.identities:
            raise ModelForgeError(
                FailureClass.ARTIFACT_CORRUPT,
                f"artifact {self.path.name} was replaced or modified after it was checked",
            )


def check_artifact(artifact: str, roots: list[Path], sha256: str) -> CheckedArtifact:
    """Resolve once inside the roots, hash from descriptors, and compare with the catalog's
    sha256 (without one, only the identities are taken). Blocking: run it in a thread."""
    path = resolve_artifact(artifact, roots)
    digest, identities = _digest(path, roots, read=bool(sha256))
    if sha256 and digest != sha256:
        raise ModelForgeError(
            FailureClass.ARTIFACT_CORRUPT,
            f"artifact {path.name}: sha256 {digest[:16]}... is not the catalog's {sha256[:16]}...",
        )
    checked = CheckedArtifact(path, digest, identities)
    checked.verify_unchanged()  # the path still names what was hashed
    return checked
