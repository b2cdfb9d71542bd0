"""A large embedding answer by reference as float32 (modelforge/payloads.py, put_output and
get_output): what the client reads back is the answer the runtime gave, value for value, as
plain lists; nothing float32 cannot hold exactly is rounded; answers stored as JSON before the
float32 form still read."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest

from modelforge.payloads import (
    FLOAT32_FORMAT,
    FLOAT32_MAGIC,
    OUTPUT_REF,
    FilesystemPayloadStore,
    Float32Vectors,
    PayloadMissing,
    get_output,
    put_output,
)


def _vectors(rows: int, width: int, seed: int = 7) -> list[list[float]]:
    """Unit vectors of float32 values handed over as doubles, as a model's `.tolist()` does."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        raw = [rng.gauss(0.0, 1.0) for _ in range(width)]
        norm = sum(x * x for x in raw) ** 0.5
        out.append(array("f", [x / norm for x in raw]).tolist())
    return out


def _answer(rows: int = 2048, width: int = 384) -> dict[str, Any]:
    vectors = _vectors(rows, width)
    return {"embeddings": vectors, "embedding": vectors[0], "dimensions": width, "usage": {"prompt_tokens": 9}}


def _stored(store: FilesystemPayloadStore, ref: dict[str, Any]) -> bytes:
    return store.path_for(ref[OUTPUT_REF]["sha256"]).read_bytes()


def test_a_2048_x_384_answer_goes_as_float32_and_reads_back_as_the_same_lists(tmp_path: Path) -> None:
    store = FilesystemPayloadStore(tmp_path)
    answer = _answer()
    ref = put_output(store, answer)
    assert set(ref) == {OUTPUT_REF} and ref[OUTPUT_REF]["format"] == FLOAT32_FORMAT
    data = _stored(store, ref)
    # Four bytes a value (plus a small header), where JSON took about twenty.
    assert 4 * (2048 + 1) * 384 < len(data) == ref[OUTPUT_REF]["size"] < 4 * (2048 + 1) * 384 + 512
    assert len(data) * 4 < len(json.dumps(answer))
    assert data.startswith(FLOAT32_MAGIC) and hashlib.sha256(data).hexdigest() == ref[OUTPUT_REF]["sha256"]

    back = get_output(store, ref)
    # Value for value what the runtime answered (its values are float32: nothing rounds), in the
    # same key order, as plain JSON lists for the CLI and the Python API.
    assert back == answer and list(back) == list(answer)
    assert json.loads(json.dumps(back)) == answer
    assert all(type(row) is list for row in back["embeddings"]) and type(back["embedding"]) is list
    vectors = back["embeddings"]
    assert isinstance(vectors, Float32Vectors)
    # The bytes the gateway's base64 answer is made of: each row as little-endian float32.
    rows = vectors.row_bytes()
    assert rows is not None and len(rows) == 2048
    assert rows[5] == struct.pack("<384f", *answer["embeddings"][5])
    # A copy by iteration (dataclasses.asdict does that) has lists and no bytes, never wrong ones.
    copied = Float32Vectors(list(row) for row in vectors)
    assert copied == vectors and copied.row_bytes() is None


def test_the_same_bytes_with_and_without_numpy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node without numpy (an HTTP runtime's) writes what a torch runtime's node writes."""
    store = FilesystemPayloadStore(tmp_path)
    answer = _answer(rows=64, width=384)  # 24,576 values: past the 16,384 of the float32 form
    pytest.importorskip("numpy")
    with_numpy = put_output(store, answer)
    monkeypatch.delitem(sys.modules, "numpy")
    without = put_output(store, answer)
    assert with_numpy == without and with_numpy[OUTPUT_REF]["format"] == FLOAT32_FORMAT
    assert get_output(store, without) == answer


@pytest.mark.parametrize("numpy_loaded", [True, False])
def test_values_float32_cannot_hold_exactly_stay_json_and_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, numpy_loaded: bool
) -> None:
    if numpy_loaded:
        pytest.importorskip("numpy")
    else:
        monkeypatch.delitem(sys.modules, "numpy", raising=False)
    store = FilesystemPayloadStore(tmp_path)
    # The simulated runtime's 4-decimal values are doubles float32 would round: never rounded.
    rounded = {"embeddings": [[round(x, 4) for x in row] for row in _vectors(128, 384)]}
    # One value past float32's range in an otherwise float32 answer.
    huge = _answer(rows=64)
    huge["embeddings"] = [list(row) for row in huge["embeddings"]]
    huge["embeddings"][3][7] = 1e300
    for answer in (rounded, huge):
        ref = put_output(store, answer)
        assert "format" not in ref[OUTPUT_REF]
        assert json.loads(_stored(store, ref)) == answer
        assert get_output(store, ref) == answer


def test_small_answers_stay_inline_as_before(tmp_path: Path) -> None:
    store = FilesystemPayloadStore(tmp_path)
    small = _answer(rows=8, width=384)  # 3,072 values: inline, exactly the dict the runtime gave
    assert put_output(store, small) is small
    assert not any(tmp_path.rglob("*"))


def test_an_answer_stored_as_json_before_the_float32_form_still_reads(tmp_path: Path) -> None:
    """A reference in a history written before: `{"sha256", "size"}` naming JSON bytes."""
    store = FilesystemPayloadStore(tmp_path)
    answer = _answer(rows=200)
    data = json.dumps(answer, separators=(",", ":")).encode()
    sha = hashlib.sha256(data).hexdigest()
    store._write(store.path_for(sha), data)
    back = get_output(store, {OUTPUT_REF: {"sha256": sha, "size": len(data)}})
    assert back == answer and not isinstance(back["embeddings"], Float32Vectors)


def test_a_float32_answer_that_does_not_add_up_or_an_unknown_format_fails_typed(tmp_path: Path) -> None:
    store = FilesystemPayloadStore(tmp_path)
    ref = put_output(store, _answer(rows=64))
    data = _stored(store, ref)
    cut = data[:-4]  # a vector short (written by something else, and named by its own digest)
    sha = hashlib.sha256(cut).hexdigest()
    store._write(store.path_for(sha), cut)
    with pytest.raises(PayloadMissing, match="not a readable float32 answer") as short:
        get_output(store, {OUTPUT_REF: {"sha256": sha, "size": len(cut), "format": FLOAT32_FORMAT}})
    assert short.value.type == "CAPABILITY_UNAVAILABLE"
    with pytest.raises(PayloadMissing, match="format 'bfloat16'"):
        get_output(store, {OUTPUT_REF: {**ref[OUTPUT_REF], "format": "bfloat16"}})
