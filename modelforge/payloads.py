"""Large payloads out of Temporal's event history: the SDK's external storage
(`temporalio.converter.ExternalStorage`) with a content-addressed filesystem store.

A request's input and output ride in Temporal payloads, which the server caps (2 MB each by
default: `PayloadsTooLarge`, TMPRL1103) and keeps in every event that carries them. Here a
payload of the request path (the request workflow's own input and result, its activities'
inputs and results, the signals it receives) of `threshold` bytes or more, and any other
payload of LARGE_PAYLOAD_BYTES or more, is written to `<root>/<sha[:2]>/<sha256>` as its
serialized protobuf and replaced in the history by a reference whose `claimData` says what it
is: `{"sha256", "size", "encoding", "store"}` (readable as it is in the Temporal UI). Smaller
payloads stay inline exactly as before, so recorded histories replay unchanged.

Every client and worker must be built with the same converter on the same directory
(`modelforge.temporal.connect` does it from settings): a payload one process stored is read
back by another (the node's invoke result by the control worker running the request
workflow, the workflow's result by the client). On a cluster the directory is a shared
filesystem (MODELFORGE_PAYLOAD_DIR), as the checkpoint store is.

Content addressing: the file's name is the sha256 of its bytes, so a retried activity or a
replayed workflow task that stores the same payload writes nothing new (it refreshes the
file's mtime, which the retention sweep reads), and a read checks the digest (a file changed
on disk is an error, never a wrong answer). Why a filesystem and not Postgres: node workers
and clients (the CLI, the Python API, the gateway) connect to Temporal only; Postgres is the
control worker's. See docs/RUNTIMES.md, "Large payloads".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time
import typing
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.converter import (
    AdvancedJSONEncoder,
    CompositePayloadConverter,
    DataConverter,
    DefaultPayloadConverter,
    EncodingPayloadConverter,
    ExternalStorage,
    JSONTypeConverter,
    StorageDriver,
    StorageDriverClaim,
    StorageDriverRetrieveContext,
    StorageDriverSelectContext,
    StorageDriverStoreContext,
    StorageDriverWorkflowInfo,
    value_to_type,
)
from temporalio.converter import JSONPlainPayloadConverter as _JSONPlain
from temporalio.exceptions import ApplicationError

from modelforge.identifiers import MAX_DURATION_S, MAX_WAIT_S
from modelforge.messages import MAX_INPUT_BYTES
from modelforge.names import REQUEST_WORKFLOW_TYPE, is_request_workflow_id

DRIVER_NAME = "modelforge-payloads"
# Payloads of workflows other than the request workflow (the schedulers, residencies,
# telemetry) leave the history only from this size: theirs stay inline as they always were.
# The SDK's own default threshold; well under the server's 2 MB limit.
LARGE_PAYLOAD_BYTES = 256 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")


class PayloadStoreError(RuntimeError):
    """A stored payload that cannot be read back (missing, or not the bytes its claim names)."""


# A stored payload that cannot be read stands in as this: its decoding raises a typed failure
# where the payload is used (a workflow's input: the workflow fails with it; an activity's: the
# activity does), rather than a workflow task retried forever on a file that will not appear.
MISSING_ENCODING = b"binary/modelforge-missing"


class PayloadMissing(ApplicationError):
    """The stored payload a workflow or activity needs is not in this process's payload store."""

    def __init__(self, message: str) -> None:
        super().__init__(message, type="CAPABILITY_UNAVAILABLE", non_retryable=True)


class PayloadCorrupt(PayloadMissing):
    """A stored payload whose bytes no longer hash to its name (changed on disk): set aside, so
    the next store of the same content writes it again. Its message names no path."""


def _log() -> Any:
    from modelforge.logging import get_logger  # lazily: the converter is imported by everything

    return get_logger("modelforge.payloads")


class _MissingConverter(EncodingPayloadConverter):
    @property
    def encoding(self) -> str:
        return MISSING_ENCODING.decode()

    def to_payload(self, value: Any) -> Payload | None:
        return None  # never chosen to encode: only the store writes these

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        raise PayloadMissing(payload.data.decode(errors="replace"))


class FilesystemPayloadStore(StorageDriver):
    """A storage driver on a directory: one file per distinct payload, named by its sha256."""

    def __init__(self, root: Path, max_bytes: int = 64 * 1024 * 1024) -> None:
        """`max_bytes`: the largest request input a client sends (MODELFORGE_MAX_PAYLOAD_BYTES);
        the store itself takes any size (a model's answer is not refused here)."""
        self.root = Path(root)
        self.max_bytes = max_bytes

    def name(self) -> str:
        return DRIVER_NAME

    def type(self) -> str:
        return "modelforge.filesystem"

    def path_for(self, sha256: str) -> Path:
        if not _SHA256.fullmatch(sha256):
            raise PayloadStoreError(f"not a payload reference: sha256 {sha256[:80]!r}")
        return self.root / sha256[:2] / sha256

    async def store(self, context: StorageDriverStoreContext, payloads: Sequence[Payload]) -> list[StorageDriverClaim]:
        # Off the event loop: a worker's loop also heartbeats leases and answers queries.
        return await asyncio.to_thread(lambda: [self._store_one(payload) for payload in payloads])

    async def retrieve(
        self, context: StorageDriverRetrieveContext, claims: Sequence[StorageDriverClaim]
    ) -> list[Payload]:
        return await asyncio.to_thread(lambda: [self._retrieve_one(claim) for claim in claims])

    def _store_one(self, payload: Payload) -> StorageDriverClaim:
        data = payload.SerializeToString(deterministic=True)
        sha = hashlib.sha256(data).hexdigest()
        self.keep(self.path_for(sha), data)
        encoding = payload.metadata.get("encoding", b"").decode(errors="replace")
        return StorageDriverClaim(
            claim_data={"sha256": sha, "size": str(len(data)), "encoding": encoding, "store": "MODELFORGE_PAYLOAD_DIR"}
        )

    def keep(self, path: Path, data: bytes) -> None:
        """`data` stored at `path` (its sha256's): a file already there is kept (its time
        refreshed for the retention: a retry, a replay) only when it holds exactly `data`, else
        written again. Comparing sizes alone kept a file damaged in place (same size) for good:
        every later store of the same content only refreshed its time, so the sweep never took
        it and every read of it failed."""
        try:
            if path.stat().st_size == len(data) and path.read_bytes() == data:
                os.utime(path)
                return
        except FileNotFoundError:  # not there yet, or swept between the two calls
            pass
        self._write(path, data)

    def read(self, sha256: str) -> bytes | None:
        """The bytes stored under `sha256`, checked against it; None when there is no such file.
        A file whose bytes no longer hash to its name is moved aside (`.corrupt-<sha256>-<ns>`,
        kept for the retention sweep for an operator to look at) and PayloadCorrupt raised, so
        the next store of the same content writes it anew. Messages name the digest, never the
        directory (they reach clients); the path goes to this process's log."""
        path = self.path_for(sha256)
        try:
            with path.open("rb") as handle:
                data = handle.read()
                identity = os.fstat(handle.fileno())
        except FileNotFoundError:
            _log().warning("payload_not_found", sha256=sha256, path=str(path))
            return None
        if hashlib.sha256(data).hexdigest() == sha256:
            return data
        aside = path.with_name(f".corrupt-{sha256}-{time.time_ns()}")
        with contextlib.suppress(OSError):
            now = os.stat(path)
            # Only the file that was read: a writer may have renamed a good copy into place since.
            if (now.st_dev, now.st_ino) == (identity.st_dev, identity.st_ino):
                os.replace(path, aside)
                os.utime(aside)  # kept a whole retention period from now, not from its last write
        _log().error("payload_corrupt", sha256=sha256, path=str(path), moved_to=str(aside), size=len(data))
        raise PayloadCorrupt(
            f"stored payload {sha256} does not match its sha256 (changed on disk): it was set aside, and storing "
            "the same content again writes it anew"
        )

    def _write(self, path: Path, data: bytes) -> None:
        # Payloads hold tenants' inputs and answers: as private as the history they left.
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        # Written aside and renamed into place: a reader sees the whole file or none, and two
        # writers of the same payload write the same bytes.
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _retrieve_one(self, claim: StorageDriverClaim) -> Payload:
        sha = str(claim.claim_data.get("sha256", ""))
        try:
            data = self.read(sha)
        except PayloadCorrupt as error:
            return _missing(error.message)
        if data is None:
            return _missing(
                f"stored payload {sha} ({claim.claim_data.get('size', '?')} bytes) is not in this process's payload "
                "store: every client and worker must see the same MODELFORGE_PAYLOAD_DIR (a shared filesystem on a "
                "cluster), and it is kept for the retention (docs/RUNTIMES.md, Large payloads)"
            )
        return Payload.FromString(data)


@dataclasses.dataclass(frozen=True)
class _Selector:
    store: FilesystemPayloadStore
    threshold: int

    def __call__(self, context: StorageDriverSelectContext, payload: Payload) -> StorageDriver | None:
        # Called only for payloads of min(threshold, LARGE_PAYLOAD_BYTES) or more.
        size = payload.ByteSize()
        if size >= LARGE_PAYLOAD_BYTES:
            return self.store
        target = context.target
        on_request_path = isinstance(target, StorageDriverWorkflowInfo) and (
            target.type == REQUEST_WORKFLOW_TYPE or is_request_workflow_id(target.id or "")
        )
        return self.store if on_request_path and size >= self.threshold else None


class _JSONEncoder(AdvancedJSONEncoder):
    """The SDK's encoder, writing the same bytes about three times faster for a large
    dataclass: a dataclass becomes a shallow dict of its fields (the encoder reaches the nested
    ones itself) instead of `dataclasses.asdict`'s deep copy. A 2,048 x 384 embedding answer
    took 1.7-2.4 s to encode on the CI machine, past the workflow deadlock detector's 2 s in
    the request workflow; 0.6 s this way."""

    def default(self, o: object) -> object:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
        return super().default(o)


class _Dataclasses(JSONTypeConverter):
    """Dataclasses decoded exactly as the SDK's `value_to_type` does, with each class's field
    type hints resolved once. The SDK resolves them on every decode (`typing.get_type_hints`,
    which compiles each string annotation of a module with `from __future__ import annotations`
    anew): a node's delegation reply of 255 slots took about 80 ms of event-loop time to decode,
    and every request's workflow and activity inputs paid the same per field. The resolved hints
    are shared by every instance: the SDK makes a new payload converter for each serialization
    context (several per workflow task), so a cache of one instance's own mostly missed."""

    _fields: ClassVar[dict[type, list[tuple[str, Any, bool]]]] = {}

    def __init__(self) -> None:
        self._converters: list[JSONTypeConverter] = [self]

    def to_typed_value(self, hint: type, value: Any) -> Any:
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return JSONTypeConverter.Unhandled
        if not isinstance(value, dict):
            raise TypeError(f"Cannot convert to dataclass {hint}, value is {type(value)} not dict")
        fields = self._fields.get(hint)
        if fields is None:
            hints = typing.get_type_hints(hint)
            fields = [(field.name, hints[field.name], field.init) for field in dataclasses.fields(hint)]
            self._fields[hint] = fields
        init: dict[str, Any] = {}
        later: dict[str, Any] = {}
        for name, field_hint, in_init in fields:
            if name not in value:
                continue  # the constructor raises for a required field that is missing
            try:
                converted = value_to_type(field_hint, value[name], self._converters)
            except Exception as error:
                raise TypeError(f"Failed converting field {name} on dataclass {hint}") from error
            (init if in_init else later)[name] = converted
        obj = hint(**init)
        for name, converted in later.items():
            object.__setattr__(obj, name, converted)
        return obj


def _missing(message: str) -> Payload:
    return Payload(metadata={"encoding": MISSING_ENCODING}, data=message.encode())


class PayloadConverter(CompositePayloadConverter):
    """The SDK's default payload converter with `_JSONEncoder` for JSON (identical bytes), and
    the stand-in for a stored payload that cannot be read (decoding it raises PayloadMissing)."""

    def __init__(self) -> None:
        super().__init__(
            *(
                _JSONPlain(encoder=_JSONEncoder, custom_type_converters=[_Dataclasses()])
                if isinstance(c, _JSONPlain)
                else c
                for c in DefaultPayloadConverter.default_encoding_payload_converters
            ),
            _MissingConverter(),
        )


def external_storage(store: FilesystemPayloadStore, threshold: int) -> ExternalStorage:
    return ExternalStorage(
        drivers=[store],
        driver_selector=_Selector(store, threshold),
        payload_size_threshold=min(threshold, LARGE_PAYLOAD_BYTES),
    )


def data_converter(root: Path, threshold: int, max_bytes: int) -> DataConverter:
    """The converter every ModelForge client and worker uses: the default one plus the store."""
    store = FilesystemPayloadStore(root, max_bytes)
    return DataConverter(payload_converter_class=PayloadConverter, external_storage=external_storage(store, threshold))


def with_payload_store(client: Client, root: Path, threshold: int, max_bytes: int) -> Client:
    """`client` on the same connection with the store's converter (tests; a client made elsewhere)."""
    config = client.config()
    config["data_converter"] = data_converter(root, threshold, max_bytes)
    return Client(**config)


# A model's answer this large is kept in the store by the node and named in the invoke's result
# (`{OUTPUT_REF: {"sha256", "size"}}`, plus `"format": "float32"` for the binary form below); the
# client that asked reads it back. The request workflow then never decodes and re-encodes it in
# its workflow thread: a 2,048 x 384 answer took 1.3 to 2.6 s there (bench/serving.py), past the
# SDK's 2 s deadlock detector.
LARGE_OUTPUT_BYTES = 256 * 1024
OUTPUT_REF = "modelforge_output_ref"

# An embedding answer goes by reference as little-endian float32 rather than JSON when its vectors
# hold LARGE_OUTPUT_BYTES / 16 values or more (16,384: 64 KiB as float32, over 256 KiB as JSON at
# the 17 to 20 digits a float32 value takes as a double) and every value is a float32 exactly (what
# a model computes in float32 and hands over as doubles: the sentence-transformers runtime, an
# OpenAI-compatible server's JSON). Nothing is rounded: an answer with any value float32 cannot hold
# exactly (the simulated runtime's 4-decimal values) goes as JSON, as every answer did before. JSON
# of a 2,048 x 384 answer took about 0.5 s to write on the node and 0.3 s to read at the client;
# float32 takes about 20 ms (numpy) to 60 ms (array) to write and 30 ms to read.
#
# The container (one file in the store, named by its sha256 as every stored payload):
#   bytes 0-7   FLOAT32_MAGIC, b"MFF32v1\n"
#   bytes 8-11  H, the header's length, uint32 little-endian
#   H bytes     UTF-8 JSON: {"output": <the answer, each array key's value null>,
#                            "arrays": [[key, shape], ...]}, space-padded so the data starts at a
#                            multiple of 4
#   the rest    each array in "arrays" order, row-major, IEEE 754 float32 little-endian
# Array keys: "embeddings" (a list of equal-length vectors, shape [n, width]) and "embedding" (one
# vector, shape [width]). A reader checks the lengths add up.
FLOAT32_FORMAT = "float32"
FLOAT32_MAGIC = b"MFF32v1\n"
_ARRAY_KEYS = ("embeddings", "embedding")


class Float32Vectors(list[list[float]]):
    """An answer's `embeddings` read back from the float32 form: a list of lists of floats like
    any other (JSON, equality, the CLI), that also keeps the bytes they were decoded from,
    `float32` (row-major, little-endian, `width` values a row), so the gateway answers OpenAI's
    `encoding_format="base64"` from them without touching a float. A copy made by iterating
    (`dataclasses.asdict`, `list(...)`) has no bytes (`row_bytes` is then None)."""

    float32: bytes = b""
    width: int = 0

    def row_bytes(self) -> list[bytes] | None:
        """Each vector's float32 bytes; None when this list no longer matches them."""
        size = self.width * 4
        if not self.float32 or size == 0 or len(self.float32) != size * len(self):
            return None
        view = memoryview(self.float32)
        return [bytes(view[n * size : (n + 1) * size]) for n in range(len(self))]


def _float32_array(value: Any, key: str) -> tuple[list[int], bytes] | None:
    """`value`'s shape and float32 bytes, or None when it is not a vector (or a list of
    equal-length vectors) of numbers that float32 holds exactly."""
    if not isinstance(value, list) or not value:
        return None
    if key == "embeddings":
        if not all(isinstance(row, list) for row in value):
            return None
        width = len(value[0])
        if width == 0 or any(len(row) != width for row in value):
            return None
        shape = [len(value), width]
        flat: list[Any] = list(itertools.chain.from_iterable(value))
    else:
        shape, flat = [len(value)], value
    numpy = sys.modules.get("numpy")  # already loaded (a torch runtime's node): about 3x faster
    try:
        if numpy is not None:
            with numpy.errstate(all="ignore"):  # an overflow to inf is caught by the comparison
                doubles = numpy.asarray(flat, dtype=numpy.float64)
                if doubles.ndim != 1:
                    return None
                singles = doubles.astype("<f4")
                if not numpy.array_equal(singles, doubles):
                    return None
            return shape, singles.tobytes()
        packed = array("f", flat)
    except (TypeError, ValueError, OverflowError):  # not numbers
        return None
    if packed.tolist() != flat:  # not exactly float32 (or not finite)
        return None
    if sys.byteorder != "little":
        packed.byteswap()
    return shape, packed.tobytes()


def float32_container(output: dict[str, Any]) -> bytes | None:
    """`output` as the float32 container (above), or None when it has no array key, its vectors
    hold fewer than LARGE_OUTPUT_BYTES / 16 values, or one of their values is not exactly a
    float32."""
    vectors = output.get("embeddings")
    if not isinstance(vectors, list) or not vectors or not isinstance(vectors[0], list):
        return None
    if len(vectors) * len(vectors[0]) * 16 < LARGE_OUTPUT_BYTES:
        return None
    arrays: list[tuple[str, list[int], bytes]] = []
    for key in _ARRAY_KEYS:
        if key not in output:
            continue
        converted = _float32_array(output[key], key)
        if converted is None:
            if key == "embeddings":
                return None
            continue  # an "embedding" that is not a vector stays in the header as it is
        arrays.append((key, *converted))
    named = {key for key, _, _ in arrays}
    header = json.dumps(
        {
            "output": {k: (None if k in named else v) for k, v in output.items()},
            "arrays": [[key, shape] for key, shape, _ in arrays],
        },
        separators=(",", ":"),
    ).encode()
    header += b" " * (-(len(FLOAT32_MAGIC) + 4 + len(header)) % 4)
    return b"".join([FLOAT32_MAGIC, len(header).to_bytes(4, "little"), header, *(data for _, _, data in arrays)])


def read_float32_container(data: bytes) -> dict[str, Any]:
    """The answer a float32 container holds: "embeddings" as Float32Vectors, "embedding" as a
    list. ValueError when `data` is not one."""
    start = len(FLOAT32_MAGIC) + 4
    if len(data) < start or not data.startswith(FLOAT32_MAGIC):
        raise ValueError("not a float32 answer (no MFF32v1 header)")
    end = start + int.from_bytes(data[len(FLOAT32_MAGIC) : start], "little")
    header = json.loads(data[start:end])
    output: dict[str, Any] = header["output"]
    view = memoryview(data)
    at = end
    for key, shape in header["arrays"]:
        if key not in _ARRAY_KEYS or not 1 <= len(shape) <= 2:
            raise ValueError(f"float32 answer: unknown array {key!r} {shape!r}")
        count = math.prod(shape)
        raw = bytes(view[at : at + 4 * count])
        if len(raw) != 4 * count:
            raise ValueError(f"float32 answer: {key} is shorter than its shape {shape}")
        at += 4 * count
        values = array("f", raw)
        if sys.byteorder != "little":
            values.byteswap()
        flat = values.tolist()
        if len(shape) == 1:
            output[key] = flat
            continue
        rows, width = shape
        vectors = Float32Vectors(flat[n * width : (n + 1) * width] for n in range(rows))
        vectors.float32, vectors.width = raw, width
        output[key] = vectors
    if at != len(data):
        raise ValueError("float32 answer: bytes past its arrays")
    return output


def _put(store: FilesystemPayloadStore, data: bytes) -> str:
    """Store `data` under its sha256 (blocking); the digest."""
    sha = hashlib.sha256(data).hexdigest()
    store.keep(store.path_for(sha), data)
    return sha


def put_output(store: FilesystemPayloadStore, output: dict[str, Any]) -> dict[str, Any]:
    """`output` itself when small, else a reference to it in the store: float32 for a large
    embedding answer that float32 holds exactly, JSON otherwise (blocking: call it off the event
    loop)."""
    binary = float32_container(output)
    if binary is not None:
        return {OUTPUT_REF: {"sha256": _put(store, binary), "size": len(binary), "format": FLOAT32_FORMAT}}
    data = json.dumps(output, separators=(",", ":")).encode()
    if len(data) < LARGE_OUTPUT_BYTES:
        return output
    return {OUTPUT_REF: {"sha256": _put(store, data), "size": len(data)}}


def get_output(store: FilesystemPayloadStore | None, output: dict[str, Any]) -> dict[str, Any]:
    """The answer an output names (or the output itself); PayloadMissing when it cannot be read
    (blocking: call it off the event loop). A reference without a "format" is JSON (every answer
    stored before the float32 form, and every answer float32 cannot hold exactly)."""
    ref = output.get(OUTPUT_REF) if isinstance(output, dict) else None
    if not isinstance(ref, dict):
        return output
    sha = str(ref.get("sha256", ""))
    if store is None:
        raise PayloadMissing(
            f"the answer ({ref.get('size', '?')} bytes) is in the payload store, and this client has none: "
            "set MODELFORGE_PAYLOAD_DIR to the workers' shared directory"
        )
    data = store.read(sha)  # PayloadCorrupt (set aside) when changed on disk
    if data is None:
        raise PayloadMissing(
            f"the answer {sha} is not in this process's payload store: every client and worker must see the same "
            "MODELFORGE_PAYLOAD_DIR"
        )
    kind = ref.get("format")
    if kind == FLOAT32_FORMAT:
        try:
            return read_float32_container(data)
        except (ValueError, KeyError, TypeError) as error:
            raise PayloadMissing(f"stored answer {sha} is not a readable float32 answer: {error}") from None
    if kind is not None:
        raise PayloadMissing(f"stored answer {sha} is in format {str(kind)[:40]!r}, which this client cannot read")
    answer: dict[str, Any] = json.loads(data)
    return answer


def payload_store(client: Client | None) -> FilesystemPayloadStore | None:
    """The filesystem store of `client`'s converter; None without one (or without a client: the
    checks that run before anything is sent)."""
    converter = getattr(client, "data_converter", None)
    storage = getattr(converter, "external_storage", None)
    if storage is None:
        return None
    return next((d for d in storage.drivers if isinstance(d, FilesystemPayloadStore)), None)


def input_limit(client: Client | None) -> int:
    """The largest request input `client` may send: the store's maximum
    (MODELFORGE_MAX_PAYLOAD_BYTES) when its converter has one, else MAX_INPUT_BYTES (what fits
    inline under the server's 2 MB payload limit)."""
    store = payload_store(client)
    return store.max_bytes if store is not None else MAX_INPUT_BYTES


def sweep(root: Path, older_than_s: float, now: float | None = None) -> int:
    """Remove stored payloads not written or re-stored for `older_than_s`; the count removed."""
    cutoff = (time.time() if now is None else now) - older_than_s
    removed = 0
    if not root.is_dir():
        return 0
    for directory in root.iterdir():
        if not directory.is_dir() or len(directory.name) != 2:
            continue
        for path in directory.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff and (
                    _SHA256.fullmatch(path.name) or path.name.startswith((".tmp-", ".corrupt-"))
                ):
                    path.unlink()
                    removed += 1
    return removed


# The longest a request workflow runs while it may still read its stored input back (a replay
# after a worker restart reads the workflow's input from the store; nothing re-stores it while
# the workflow runs): the longest wait for admission (deadline_s and lease_timeout_s are at most
# 7 days) plus the longest lease (identifiers.MAX_DURATION_S, 7 days, the one limit of the client,
# the gateway and the scheduler). A retention of the namespace's plus one day lost a long job's
# input on its first replay after a day.
LONGEST_REQUEST_S = MAX_WAIT_S + MAX_DURATION_S
RETENTION_MARGIN_S = 86400.0


def retention_floor_s() -> float:
    """The shortest retention the sweep uses, whatever is configured: a running request's input
    must outlive the request."""
    return LONGEST_REQUEST_S + RETENTION_MARGIN_S


async def retention_s(client: Client, configured_days: float | None) -> float:
    """How long a stored payload is kept: MODELFORGE_PAYLOAD_RETENTION_DAYS, else the
    namespace's workflow retention (a closed workflow's history, which holds the references, is
    kept that long) plus the longest request and a day; never less than `retention_floor_s`."""
    if configured_days is not None:
        if configured_days * 86400.0 < retention_floor_s():
            # Said, not silent: a shorter retention could delete a running request's input.
            _log().warning(
                "payload_retention_raised",
                configured_days=configured_days,
                applied_days=retention_floor_s() / 86400.0,
                why="a stored input must outlive the longest request (waiting plus its lease)",
            )
        return max(configured_days * 86400.0, retention_floor_s())
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

    described = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=client.namespace))
    ttl = described.config.workflow_execution_retention_ttl.ToTimedelta().total_seconds()
    return (ttl if ttl > 0 else 30 * 86400.0) + retention_floor_s()


async def sweep_forever(client: Client, configured_days: float | None, interval_s: float = 3600.0) -> None:
    """The control worker's retention sweep of the payload store, once an hour. A failed sweep
    (Temporal away: the retention is the namespace's) is logged and tried again after the
    back-off (modelforge/retrying.py), not an hour later."""
    from modelforge.logging import get_logger
    from modelforge.retrying import DEFAULT_BACKOFF, describe

    store = payload_store(client)
    if store is None:
        return
    failures = 0
    while True:
        try:
            keep_s = await retention_s(client, configured_days)
            await asyncio.to_thread(sweep, store.root, keep_s)
            failures = 0
        except Exception as error:
            failures += 1
            delay = DEFAULT_BACKOFF.delay_s(failures)
            get_logger("modelforge.payloads").warning(
                "payload_sweep_failed", attempt=failures, retry_in_s=delay, error=describe(error)
            )
            await asyncio.sleep(min(delay, interval_s))
            continue
        await asyncio.sleep(interval_s)
