"""The key nodes and gateways share for streamed answers (MODELFORGE_STREAM_KEY, or the file
MODELFORGE_STREAM_KEY_FILE names): a node signs the stream id it pushes to, so a push cannot be
forged by whoever reads a request's history (which holds the id, never the key)."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from modelforge.failures import FailureClass, ModelForgeError

STREAM_KEY_ENV = "MODELFORGE_STREAM_KEY"
STREAM_KEY_FILE_ENV = "MODELFORGE_STREAM_KEY_FILE"
SIGNATURE_HEADER = "X-ModelForge-Stream-Signature"


def stream_key() -> bytes | None:
    """The key shared by the gateway and the nodes; None where none is configured (the
    gateway then takes pushes from loopback only)."""
    path = os.environ.get(STREAM_KEY_FILE_ENV)
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip().encode() or None
        except OSError as error:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"{STREAM_KEY_FILE_ENV}: cannot read {path}: {error.strerror}"
            ) from None
    value = os.environ.get(STREAM_KEY_ENV, "")
    return value.encode() if value else None


def signature(key: bytes, stream_id: str) -> str:
    return hmac.new(key, stream_id.encode(), hashlib.sha256).hexdigest()
