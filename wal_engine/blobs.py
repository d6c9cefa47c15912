"""Large values in the log: split out of an event's row, content-addressed, compressed, in
chunks (pure; the statements that move them are the store's). Decision 60 of
docs/architecture.md.

An event's payload is the canonical JSON of its fields (:mod:`wal_engine.payloads`). When
that encoding is longer than :data:`limits.blob_threshold_bytes`, each user-value field of
the event (a tool result, an LLM response, a message's content, a task's input or output,
a LangGraph checkpoint's channel values...) whose own canonical encoding is longer than the
threshold leaves the row: the row holds the rest of the fields plus one more key,
``"$blobs"``, mapping each field that left to ``{"bytes": n, "sha256": hex}``, the length
and sha256 of that field's canonical encoding. The value itself is stored once per task in
``wal_blobs`` under its digest, in chunks of :data:`limits.blob_chunk_bytes` uncompressed
bytes, each one zstd frame.

* **The chain covers it.** The row's bytes, digest included, are what the event's hash
  covers; ``verify`` recomputes each referenced value's sha256 from its chunks.
* **Nothing ambiguous.** Field names of events are snake_case, so ``"$blobs"`` is never a
  field; with sorted keys it is the row's first key, so a row that has none is recognized by
  its first bytes without being parsed (:func:`references`).
* **Expansion is exact.** The full payload is the row's JSON with ``"$blobs"`` removed and
  each field put back as its stored encoding (:func:`expand`): the canonical bytes the writer
  encoded, so decoding, idempotent resubmission and upcasting see what they always saw.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Final, NamedTuple

import orjson
import zstandard

from wal_engine import limits

BLOB_KEY: Final = "$blobs"
ROW_PREFIX: Final = b'{"$blobs":'
"""How a row that references large values begins (sorted keys: ``$`` sorts first)."""

zstd_level: Final = 3
"""zstd level of chunks (the snapshot segments' level: fast, and as good as level 9 on
base64 and JSON text within a few percent)."""

INLINE_FIELDS: Final = frozenset({"metadata", "checkpoint", "refs", "big_ints"})
"""Fields never moved out of the row: a LangGraph checkpoint's skeleton. Its metadata is
filtered by SQL (``convert_from(payload)::jsonb -> 'metadata'``), and rebuilding the
saver's index reads the skeleton alone (:func:`skeleton`)."""

_sort: Final = orjson.OPT_SORT_KEYS

ROW_MARK: Final = b"\x01"
"""How a compressed row begins: this byte, then one zstd frame without its magic number
(decision 71; 3 bytes less a row than the magic). A plain row is JSON: it begins with
``{``."""

ROW_DICTIONARY: Final = (
    b'{"agent":"","agent_version":null,"budget":{},"input":{},"parent_seq":null,'
    b'"parent_task_id":null}{"content":"","name":null,"role":"assistant"}'
    b'{"content":"","name":null,"role":"user"}{"call_id":"","kind":"","value":null}'
    b'{"attempt":1,"call_id":"","error":"","error_type":"","retry_at_ms":null,'
    b'"retryable":false}{"attempt":1,"call_id":"","idempotency_key":"idem:","model":"",'
    b'"request":{"messages":[{"content":"","role":"user"}]},"request_hash":""}'
    b'{"call_id":"","cost_usd":0.0,"input_tokens":0,"output_tokens":0,"response":{"content":""}}'
    b'{"args":{},"args_hash":"","attempt":1,"call_id":"tool-","idempotency_key":"idem:",'
    b'"idempotent":true,"tool":""}{"call_id":"tool-","result":{"result":""}}'
)
"""The start of the zstd dictionary of compressed rows (raw content: the engine's own field
names, as its events encode them); the task's id ends it (:func:`row_dictionary`). A row
of a few hundred bytes has too little text of its own for its keys, or the task id in an
intent's key, to repeat; with them here, each costs a back-reference (a tool step's two
rows store 95 bytes fewer, decision 71). **Never changed**: every compressed row was
written with it; another dictionary would need another :data:`ROW_MARK`."""

ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
"""The 4 bytes a zstd frame begins with, which a stored row leaves out."""

row_codecs_cached_max: Final = 256
"""Tasks whose row codecs a thread keeps (making a task's costs about 20 µs)."""

row_zstd_level: Final = 1
"""zstd level of compressed rows. Measured on the suite's tool steps (a ~700-byte intent, a
~1 KB result): levels 1, 3 and 6 store within 2% of each other, level 1 compresses a
result in 7 µs against 10 µs at level 3 (decision 71)."""


class Chunk(NamedTuple):
    """One row of ``wal_blobs``: a piece of one value."""

    digest: bytes
    ordinal: int
    value_bytes: int
    """Length of the whole value (uncompressed), the same on every chunk of it."""
    data: bytes
    """One zstd frame of at most ``limits.blob_chunk_bytes`` uncompressed bytes."""


class Reference(NamedTuple):
    """A field of a row stored as a blob."""

    field: str
    digest: bytes
    value_bytes: int


class BlobError(ValueError):
    """A row's blob reference or a stored value is malformed (the callers raise their own
    typed errors, or report a violation)."""


def split(payload: bytes, chunk_bytes: int = limits.blob_chunk_bytes,
          threshold: int = limits.blob_threshold_bytes) -> tuple[bytes, list[Chunk]]:
    """The row bytes of ``payload`` (an event's full canonical encoding) and the chunks of
    the values that leave it. A payload at or under ``threshold`` is returned as it is."""
    if len(payload) <= threshold:
        return payload, []
    fields = orjson.loads(payload)
    if not isinstance(fields, dict) or BLOB_KEY in fields:
        return payload, []
    refs: dict[str, dict[str, object]] = {}
    chunks: list[Chunk] = []
    for name in sorted(fields):
        if name in INLINE_FIELDS:
            continue
        value = fields[name]
        if value is None or type(value) in (bool, int, float):
            continue
        if type(value) is str and len(value) < threshold // 6:
            continue  # Cannot encode to more than threshold bytes (6 bytes per char at most).
        encoded = orjson.dumps(value, option=_sort)
        if len(encoded) <= threshold:
            continue
        digest = hashlib.sha256(encoded).digest()
        refs[name] = {"bytes": len(encoded), "sha256": digest.hex()}
        del fields[name]
        chunks.extend(chunked(digest, encoded, chunk_bytes))
    if not refs:
        return payload, []
    fields[BLOB_KEY] = refs
    return orjson.dumps(fields, option=_sort), chunks


def row_dictionary(task_id: str) -> bytes:
    """The dictionary of a task's compressed rows: :data:`ROW_DICTIONARY` then the start of
    an intent's key, ``"idem:<task_id>:``."""
    return ROW_DICTIONARY + b'"idem:' + task_id.encode() + b":"


class _RowCodec(NamedTuple):
    compressor: zstandard.ZstdCompressor
    decompressor: zstandard.ZstdDecompressor


class _Codecs(threading.local):
    """Row codecs per thread (neither half may be used by two threads at once), per task,
    the most recently used :data:`row_codecs_cached_max` kept."""

    def __init__(self) -> None:
        self.by_task: OrderedDict[str, _RowCodec] = OrderedDict()

    def of(self, task_id: str) -> _RowCodec:
        codec = self.by_task.get(task_id)
        if codec is not None:
            self.by_task.move_to_end(task_id)
            return codec
        dictionary = zstandard.ZstdCompressionDict(row_dictionary(task_id),
                                                   dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        # A level, not explicit parameters: given parameters, zstd no longer tunes them to
        # the dictionary and the input's size (measured: a result row stored 15% more).
        codec = _RowCodec(
            zstandard.ZstdCompressor(level=row_zstd_level, dict_data=dictionary,
                                     write_dict_id=False, write_content_size=True),
            zstandard.ZstdDecompressor(dict_data=dictionary,
                                       format=zstandard.FORMAT_ZSTD1_MAGICLESS))
        self.by_task[task_id] = codec
        if len(self.by_task) > row_codecs_cached_max:
            self.by_task.popitem(last=False)
        return codec


_codecs: Final = _Codecs()


def compress_row(row: bytes, task_id: str) -> bytes:
    """The bytes stored for an event's row of task ``task_id`` (decision 71):
    :data:`ROW_MARK` and a zstd frame of ``row`` (with the task's :func:`row_dictionary`)
    when ``row`` is at least :data:`limits.row_compress_bytes_min` long, references no
    large value (those rows stay readable by SQL, :func:`skeleton`) and that is shorter;
    else ``row`` itself. The chain hash covers ``row``, the content."""
    if len(row) < limits.row_compress_bytes_min or row.startswith(ROW_PREFIX):
        return row
    frame = _codecs.of(task_id).compressor.compress(row)
    stored = ROW_MARK + frame[len(ZSTD_MAGIC):]  # The same frame without its magic number.
    return stored if len(stored) < len(row) else row


def decompress_row(stored: bytes, task_id: str) -> bytes:
    """The row a stored value of task ``task_id`` holds: a compressed row's content, else
    the bytes as stored. Raises BlobError for a frame that does not decompress, or that
    declares more than a row may hold (``limits.row_payload_bytes_ceiling``)."""
    if not stored.startswith(ROW_MARK):
        return stored
    frame = stored[1:]
    try:
        declared = zstandard.get_frame_parameters(
            frame, format=zstandard.FORMAT_ZSTD1_MAGICLESS).content_size
        if not 0 <= declared <= limits.row_payload_bytes_ceiling:
            raise BlobError(f"a compressed row declares {declared} bytes")
        return _codecs.of(task_id).decompressor.decompress(frame)
    except zstandard.ZstdError as error:
        raise BlobError(f"a compressed row does not decompress ({error})") from error


def readable_row(stored: bytes, task_id: str) -> bytes:
    """The row a stored value holds, or the stored bytes themselves when a frame does not
    decompress: their decoding then fails as any malformed row's does, and ``verify``
    reports the row (its hash covers the content, which these bytes are not)."""
    try:
        return decompress_row(stored, task_id)
    except BlobError:
        return stored


def chunked(digest: bytes, encoded: bytes, chunk_bytes: int = limits.blob_chunk_bytes
            ) -> list[Chunk]:
    """``encoded`` as compressed chunks, in order."""
    compressor = zstandard.ZstdCompressor(level=zstd_level)
    view = memoryview(encoded)
    return [Chunk(digest, ordinal, len(encoded),
                  compressor.compress(view[start:start + chunk_bytes]))
            for ordinal, start in enumerate(range(0, len(encoded), chunk_bytes))]


def references(row_payload: bytes) -> list[Reference]:
    """The blob references of a row (empty for a row without any); raises BlobError."""
    if not row_payload.startswith(ROW_PREFIX):
        return []
    try:
        refs = orjson.loads(row_payload)[BLOB_KEY]
        return [Reference(name, bytes.fromhex(ref["sha256"]), int(ref["bytes"]))
                for name, ref in refs.items()]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise BlobError(f"malformed blob reference: {error}") from error


def expand(row_payload: bytes, values: Mapping[bytes, bytes]) -> bytes:
    """The full payload of a row: its referenced values (digest -> encoding) put back."""
    fields = orjson.loads(row_payload)
    refs = fields.pop(BLOB_KEY)
    for name, ref in refs.items():
        fields[name] = orjson.Fragment(values[bytes.fromhex(ref["sha256"])])
    return orjson.dumps(fields, option=_sort)


def skeleton(row_payload: bytes) -> bytes:
    """The row without its blob references: the fields that left it are absent (decoding
    gives them their defaults). For readers that need only the inline fields."""
    if not row_payload.startswith(ROW_PREFIX):
        return row_payload
    fields = orjson.loads(row_payload)
    fields.pop(BLOB_KEY, None)
    return orjson.dumps(fields, option=_sort)


class Assembler:
    """Reassembles values from their chunks as they stream in, and checks them.

    Chunks of one value arrive in ordinal order (the read statements order them); each is
    decompressed as it arrives, so only the values being assembled are held, never the
    compressed pages. :meth:`finish` checks every value's length and sha256.
    """

    def __init__(self, wanted: Iterable[Reference]) -> None:
        self.sizes = {ref.digest: ref.value_bytes for ref in wanted}
        self.parts: dict[bytes, bytearray] = {}
        self.next_ordinal: dict[bytes, int] = {}
        self.decompressor = zstandard.ZstdDecompressor()

    def add(self, digest: bytes, ordinal: int, data: bytes) -> None:
        size = self.sizes.get(digest)
        if size is None:
            return
        expected = self.next_ordinal.get(digest, 0)
        if ordinal != expected:
            raise BlobError(f"value {digest.hex()[:16]}: chunk {ordinal} where {expected} "
                            f"was due")
        part = self.parts.setdefault(digest, bytearray())
        try:
            # A frame states its size: refuse one that claims more than a chunk holds
            # before anything is allocated for it.
            declared = zstandard.frame_content_size(data)
            if not 0 <= declared <= limits.blob_chunk_bytes:
                raise BlobError(f"value {digest.hex()[:16]}: chunk {ordinal} declares "
                                f"{declared} bytes")
            part += self.decompressor.decompress(data)
        except zstandard.ZstdError as error:
            raise BlobError(f"value {digest.hex()[:16]}: chunk {ordinal} does not "
                            f"decompress ({error})") from error
        if len(part) > size:
            raise BlobError(f"value {digest.hex()[:16]} is longer than its {size} bytes")
        self.next_ordinal[digest] = ordinal + 1

    def finish(self) -> dict[bytes, bytes]:
        """Every wanted value, checked; raises BlobError on a missing or altered one."""
        values: dict[bytes, bytes] = {}
        for digest, size in self.sizes.items():
            part = self.parts.get(digest)
            if part is None:
                raise BlobError(f"value {digest.hex()[:16]} ({size} bytes) is not stored")
            if len(part) != size:
                raise BlobError(f"value {digest.hex()[:16]} holds {len(part)} bytes, its "
                                f"reference says {size}")
            if hashlib.sha256(part).digest() != digest:
                raise BlobError(f"value {digest.hex()[:16]} does not hash to its digest")
            values[digest] = bytes(part)
        return values
