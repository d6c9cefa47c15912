"""Snapshots: ``AgentState`` to compact bytes and back, with msgpack (pure).

The encoding is deterministic: equal folds give byte-identical snapshots. Dicts are
encoded in insertion order, and the fold inserts in event order, so the same events always
produce the same bytes; decoding keeps the order, so a snapshot round trip changes nothing
(the journal relies on the order of ``calls``). Payload values are plain JSON values, which
msgpack carries exactly (floats as float64).

**Segmented snapshots** (format 3). The collections that grow with the history
(``SEGMENTED_FIELDS``: ``messages``, ``calls``, ``signal_ids``, ``plan_completed``,
``approvals``) are cut into immutable segments of ``segment_items`` items, each stored once
per task under a digest of its bytes (``wal_snapshot_segments``); a snapshot row holds the
state with those collections cut to their unsegmented tail (fewer than ``segment_items``
items), plus the references (field, ordinal, digest) of its segments. Consecutive snapshots
share every segment that did not change, so a snapshot costs the items added since the
previous one plus one tail, whatever the length of the history. A segment whose items can
still change (a call record still pending, an approval not yet decided) simply gets a new
digest when it changes; the old one is pruned once no kept snapshot refers to it.
:class:`SnapshotSegments` is one writer's memory of the segments it encoded and stored, so
that a segment already stored is neither sent nor re-encoded. The digest covers the field
and the ordinal as well as the bytes, so a digest alone names a segment within a task.

**Segments are compressed** (format 4) with zstd (level ``segment_zstd_level``), and the
digest covers the compressed bytes, the bytes stored. PostgreSQL stores them as sent
(``STORAGE EXTERNAL``: no pglz on top). A resume then receives a third of the bytes, hashes
a third of them, and decompresses on the client at zstd's speed instead of the server's
pglz: on the 10,000-step benchmark state (12.3 MB of msgpack in 78 segments) reading,
checking and decompressing went from 36 ms to 20 ms, and the segments take 3.1 MB instead
of 4.0 MB on disk (docs/architecture.md, decision 29).

:func:`encode_state` / :func:`decode_state` remain: the whole state in one msgpack blob
(the benchmarks' floor, "one row holding the whole state", and tests).

``STATE_FORMAT`` is stored beside each snapshot (``wal_snapshots.state_format``). Any
change to ``AgentState`` or to what the fold computes bumps it, including a new field with a
default: an old snapshot would decode with the default where a fold of the same events now
computes something else. Snapshots of another format are ignored (resume folds the log and
the next snapshot is written in the new format), which is what derived data is for.

Format history: 1, the first; 2, ``commands`` (counts of agent commands by kind);
3, segmented snapshots (the row holds the tails and segment references); 4, segments
compressed with zstd.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import operator
from collections.abc import Iterable, Iterator
from typing import Any, Final

import msgspec
import zstandard

from replay.state import AgentState, Approval, CallRecord
from wal_engine.errors import SnapshotCorrupt
from wal_engine.events import MessageAppended

STATE_FORMAT: Final = 6
"""Version of the snapshot encoding (msgpack of ``AgentState``, segmented, zstd segments).
5 added the agent version, patch markers, hand-over reason and interruptions; 6 the spend
charged from children (``children_spend``)."""

segment_items: Final = 128
"""Items per segment (see docs/architecture.md for the measurements behind it)."""

segment_zstd_level: Final = 3
"""zstd level of segments. Measured on the benchmark's state: level 1 stores 8% more and
decompresses no faster; level 9 compresses 8x slower for the same size."""

gc_pause_bytes_min: Final = 256 * 1024
"""States with segments (``segment_items`` items each), or whose row is at least this
large, are decoded with the cyclic garbage collector paused."""

SEGMENTED_FIELDS: Final[dict[str, Any]] = {
    "messages": list[MessageAppended],
    "calls": dict[str, CallRecord],
    "signal_ids": list[int],
    "plan_completed": list[str],
    "approvals": dict[str, Approval],
}
"""The growing collections of ``AgentState`` stored in segments, with their types."""

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(AgentState)
_dict_fields: Final = frozenset(
    name for name, kind in SEGMENTED_FIELDS.items() if getattr(kind, "__origin__", None) is dict
)
_segment_decoders: Final = {
    name: msgspec.msgpack.Decoder(kind) for name, kind in SEGMENTED_FIELDS.items()
}


def encode_state(state: AgentState) -> bytes:
    """Encode a whole state as one msgpack blob (deterministic for equal folds)."""
    return _encoder.encode(state)


def decode_state(data: bytes, *, task_id: str | None = None, seq: int | None = None) -> AgentState:
    """Decode a whole state encoded by :func:`encode_state`; ``task_id``, ``seq`` label errors.

    Raises:
        SnapshotCorrupt: the bytes are not an encoded ``AgentState``.
    """
    try:
        if len(data) < gc_pause_bytes_min:
            return _decoder.decode(data)
        with gc_paused():
            return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise SnapshotCorrupt(task_id, seq, str(error)) from error


# ----------------------------------------------------------------------------- segments


class SegmentRef(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A snapshot's reference to one stored segment."""

    field: str
    ordinal: int
    """Position of the segment in its field: items ``ordinal * segment_items`` onwards."""
    digest: bytes


class Segment(msgspec.Struct, frozen=True, gc=False):
    """One segment as stored (``wal_snapshot_segments``)."""

    field: str
    ordinal: int
    digest: bytes
    data: bytes
    """zstd of the msgpack of a list (or an insertion-ordered dict) of ``segment_items``
    items."""


class EncodedSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A state ready to store: the row, its references, and the segments still to write."""

    head: bytes
    """``wal_snapshots.state``: the state with its segmented fields cut to their tails, and
    the segment references."""
    refs: list[SegmentRef]
    new: list[Segment]
    """The referenced segments the writer does not know to be stored."""

    @property
    def digests(self) -> list[bytes]:
        """The digests of every referenced segment (``wal_snapshots.segments``)."""
        return [ref.digest for ref in self.refs]


class _SnapshotHead(msgspec.Struct, frozen=True, array_like=True):
    state: AgentState
    segments: list[SegmentRef]


_head_decoder: Final = msgspec.msgpack.Decoder(_SnapshotHead)


class _Known(msgspec.Struct, gc=False):
    keys: list[str] | None
    values: list[Any]
    digest: bytes


def segment_digest(field: str, ordinal: int, data: bytes) -> bytes:
    """sha256 of a segment's field, ordinal and bytes (32 bytes)."""
    hasher = hashlib.sha256(f"{field}\n{ordinal}\n".encode())
    hasher.update(data)
    return hasher.digest()


class SnapshotSegments:
    """One writer's memory of a task's segments (per task run; never shared).

    For each (field, ordinal) it keeps the items last encoded there (references to the
    state's own frozen objects) and their digest: a segment whose items are the very same
    objects is not encoded again. ``stored`` holds the digests referenced by the latest
    snapshot this writer wrote or resumed from: the statement that wrote it kept them, so
    they are not sent again. Losing this memory costs only bytes sent, never correctness:
    the store ignores a segment it already holds, and refuses a snapshot row whose
    segments it does not hold (the writer then sends them all).
    """

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], _Known] = {}
        self.stored: frozenset[bytes] = frozenset()

    def remember(self, field: str, ordinal: int, keys: list[str] | None, values: list[Any],
                 digest: bytes) -> None:
        """Record that these items, at this place, encode to a segment of that digest."""
        self._known[field, ordinal] = _Known(keys=keys, values=values, digest=digest)

    def stored_as(self, encoded: EncodedSnapshot) -> None:
        """The snapshot ``encoded`` was written: its segments are all in the store."""
        self.stored = frozenset(encoded.digests)

    def forget_stored(self) -> None:
        """The store lacks a segment this writer thought it held: send them all next time."""
        self.stored = frozenset()

    def encode(self, state: AgentState) -> EncodedSnapshot:
        """Encode ``state`` as a snapshot row plus segments (deterministic for equal folds)."""
        tails: dict[str, Any] = {}
        refs: list[SegmentRef] = []
        new: list[Segment] = []
        for field in SEGMENTED_FIELDS:
            container = getattr(state, field)
            is_dict = field in _dict_fields
            keys: list[str] | None = list(container) if is_dict else None
            values: list[Any] = list(container.values()) if is_dict else container
            full = len(values) // segment_items
            for ordinal in range(full):
                start, end = ordinal * segment_items, (ordinal + 1) * segment_items
                chunk_keys = None if keys is None else keys[start:end]
                chunk = values[start:end]
                known = self._known.get((field, ordinal))
                data: bytes | None = None
                if known is not None and known.keys == chunk_keys and _same(known.values, chunk):
                    digest = known.digest
                else:
                    data = _encode_segment(chunk_keys, chunk)
                    digest = segment_digest(field, ordinal, data)
                    self.remember(field, ordinal, chunk_keys, chunk, digest)
                if digest not in self.stored:
                    new.append(Segment(field=field, ordinal=ordinal, digest=digest,
                                       data=data or _encode_segment(chunk_keys, chunk)))
                refs.append(SegmentRef(field, ordinal, digest))
            rest = full * segment_items
            tails[field] = (values[rest:] if keys is None
                            else dict(zip(keys[rest:], values[rest:], strict=True)))
        head = _encoder.encode(_SnapshotHead(msgspec.structs.replace(state, **tails), refs))
        return EncodedSnapshot(head=head, refs=refs, new=new)


def _same(known: list[Any], items: list[Any]) -> bool:
    return len(known) == len(items) and all(map(operator.is_, known, items))


def _encode_segment(keys: list[str] | None, values: list[Any]) -> bytes:
    packed = _encoder.encode(values if keys is None else dict(zip(keys, values, strict=True)))
    # A compressor per segment (10 us, once per segment_items steps): instances are not
    # thread-safe, and this function is called from whichever thread snapshots.
    return zstandard.ZstdCompressor(level=segment_zstd_level).compress(packed)


def encode_snapshot(state: AgentState) -> EncodedSnapshot:
    """Encode ``state`` as a snapshot row plus all its segments (a writer with no memory)."""
    return SnapshotSegments().encode(state)


def decode_snapshot(
    head: bytes,
    segments: Iterable[Segment],
    *,
    task_id: str | None = None,
    seq: int | None = None,
    known: SnapshotSegments | None = None,
) -> AgentState:
    """Assemble a state from its snapshot row and its segments (any order, extras ignored).

    ``known``, when given, learns the segments (their decoded items and digests) and that
    they are stored, so that the next snapshot of the same run neither re-encodes nor
    re-sends them. ``task_id`` and ``seq`` only label the error.

    Raises:
        SnapshotCorrupt: the row or a segment does not decode, a referenced segment is
            missing, its bytes do not match its digest, it does not decompress, or it holds
            the wrong item count.
    """
    by_digest = {segment.digest: segment for segment in segments}
    try:
        if not by_digest and len(head) < gc_pause_bytes_min:
            return _assemble(head, by_digest, task_id, seq, known)
        with gc_paused():
            return _assemble(head, by_digest, task_id, seq, known)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise SnapshotCorrupt(task_id, seq, str(error)) from error


def _assemble(head: bytes, by_digest: dict[bytes, Segment], task_id: str | None,
              seq: int | None, known: SnapshotSegments | None) -> AgentState:
    decoded = _head_decoder.decode(head)
    parts: dict[str, list[Any]] = {field: [] for field in SEGMENTED_FIELDS}
    decompressor = zstandard.ZstdDecompressor()  # One per call: not thread-safe.
    for ref in decoded.segments:
        segment = by_digest.get(ref.digest)
        where = f"segment {ref.field}/{ref.ordinal}"
        if segment is None:
            raise SnapshotCorrupt(task_id, seq, f"{where} is missing")
        if (segment.field, segment.ordinal) != (ref.field, ref.ordinal) \
                or ref.field not in parts or ref.ordinal != len(parts[ref.field]):
            raise SnapshotCorrupt(task_id, seq, f"{where} is out of place")
        if segment_digest(ref.field, ref.ordinal, segment.data) != ref.digest:
            raise SnapshotCorrupt(task_id, seq, f"{where} does not match its digest")
        try:
            # The frame states its size (the writer always writes it): one allocation.
            packed = decompressor.decompress(segment.data)
        except zstandard.ZstdError as error:
            raise SnapshotCorrupt(task_id, seq, f"{where} does not decompress: {error}") \
                from error
        items = _segment_decoders[ref.field].decode(packed)
        if len(items) != segment_items:
            raise SnapshotCorrupt(task_id, seq, f"{where} holds {len(items)} items")
        parts[ref.field].append(items)
    state = decoded.state
    fields: dict[str, Any] = {}
    for field, chunks in parts.items():
        if not chunks:
            continue
        tail = getattr(state, field)
        if field in _dict_fields:
            merged: dict[str, Any] = {}
            for chunk in chunks:
                merged.update(chunk)
            merged.update(tail)
            if len(merged) != len(chunks) * segment_items + len(tail):
                raise SnapshotCorrupt(task_id, seq, f"{field} has keys in two segments")
            fields[field] = merged
        else:
            fields[field] = [item for chunk in chunks for item in chunk] + tail
    if known is not None:
        for ref in decoded.segments:
            chunk = parts[ref.field][ref.ordinal]
            is_dict = ref.field in _dict_fields
            known.remember(ref.field, ref.ordinal, list(chunk) if is_dict else None,
                           list(chunk.values()) if is_dict else chunk, ref.digest)
        known.stored = frozenset(ref.digest for ref in decoded.segments)
    return msgspec.structs.replace(state, **fields) if fields else state


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a large state is built.

    Building a state allocates hundreds of thousands of containers, none of them in a
    reference cycle; every collection the allocations trigger walks the whole growing state,
    which made decoding a 36 MB snapshot 1.3x to 4x slower (measured: 67-245 ms against
    51 ms paused). Reference counting still frees everything at once; only the cycle
    collector waits, and it is re-enabled by whoever paused it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
