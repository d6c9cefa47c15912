"""Reading large values back (``wal_blobs``, :mod:`wal_engine.blobs`): a page of chunks per
round trip, decompressed as it arrives, every value checked against its digest.

A row that references no large value costs nothing here (its first bytes tell); rows that
do cost one round trip per :data:`limits.blob_read_page_chunks` chunks of the values they
name, whatever the number of rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from wal_engine import blobs, limits
from wal_engine.errors import BlobCorrupt
from wal_engine.store import queries

if TYPE_CHECKING:
    import asyncpg

    from wal_engine.store.connection import Database

_before_all = (b"", -1)


async def read_values(database: Database, task_id: str, wanted: Iterable[blobs.Reference],
                      *, connection: asyncpg.Connection | None = None,
                      seq: int | None = None) -> dict[bytes, bytes]:
    """The values (digest -> canonical encoding) of ``wanted``, streamed a page of chunks at
    a time; raises :class:`BlobCorrupt` for a missing, altered or malformed one."""
    assembler = blobs.Assembler(wanted)
    digests = sorted(assembler.sizes)
    if not digests:
        return {}
    after_digest, after_ordinal = _before_all
    page = limits.blob_read_page_chunks
    try:
        while True:
            rows = await database.fetch(
                queries.READ_BLOB_CHUNKS, task_id, digests, after_digest, after_ordinal, page,
                task_id=task_id, connection=connection)
            for row in rows:
                assembler.add(bytes(row["digest"]), int(row["ordinal"]), row["data"])
            if len(rows) < page:
                break
            after_digest, after_ordinal = bytes(rows[-1]["digest"]), int(rows[-1]["ordinal"])
        return assembler.finish()
    except blobs.BlobError as error:
        raise BlobCorrupt(task_id, seq, str(error)) from error


def references_of(task_id: str, payload: bytes, seq: int | None) -> list[blobs.Reference]:
    """The references of one stored row; BlobCorrupt when they are malformed."""
    try:
        return blobs.references(payload)
    except blobs.BlobError as error:
        raise BlobCorrupt(task_id, seq, str(error)) from error


async def expand_payloads(database: Database, task_id: str, payloads: Sequence[bytes],
                          *, connection: asyncpg.Connection | None = None
                          ) -> dict[bytes, bytes]:
    """Row bytes -> full payload, for those of ``payloads`` that reference large values
    (all of one task). Empty, without a round trip, when none does."""
    wanted: dict[bytes, list[blobs.Reference]] = {}
    for payload in payloads:
        if payload.startswith(blobs.ROW_PREFIX) and payload not in wanted:
            wanted[payload] = references_of(task_id, payload, None)
    if not wanted:
        return {}
    values = await read_values(database, task_id,
                               (ref for refs in wanted.values() for ref in refs),
                               connection=connection)
    return {payload: blobs.expand(payload, values) for payload in wanted}


def expanded(mapping: dict[bytes, bytes], payload: Any) -> Any:
    """``payload`` as its full bytes when ``mapping`` (from :func:`expand_payloads`) has it."""
    return mapping.get(payload, payload) if mapping else payload
