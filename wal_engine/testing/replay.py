"""Replay checks for tests: today's agent code against recorded histories, and history files.

The check itself is :mod:`wal_engine.runtime.replayer` (the one the CLI's ``replay`` command
runs): the recorded history is folded, the agent function runs from the top against it,
every external call is answered from the log and nothing is called or written; the first
call or command the history does not hold stops it, and a different call, command or
ending is a divergence (with the seq and the fork point). This module adds what tests
need around it:

* :func:`assert_replays`: replay recorded events and fail (:class:`ReplayMismatch`) on a
  divergence or on an output that differs from the recorded one;
* :func:`assert_replay_equivalent`: run an agent crash-free, then replay its history and
  check the fold of the log against the live state, with zero external calls;
* history files as JSON lines (:func:`dump_history`, :func:`load_history`), one object per
  event: ``task_id, seq, type, version, epoch, payload`` (the stored payload text) and
  ``hash`` (hex); :func:`verify_history` recomputes their chain, :func:`insert_history`
  loads one into a database as a task (the golden-history test, RELIABILITY.md L5).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from replay.fold import fold
from replay.state import AgentState
from wal_engine import events as ev
from wal_engine.chain import VerifyReport
from wal_engine.runtime.replayer import ReplayReport, replay_events
from wal_engine.store import EventRecord
from wal_engine.store.store import Chunks, row_payload
from wal_engine.verification import verify_history as verify_semantics

if TYPE_CHECKING:
    from wal_engine.engine import Engine

AgentFunction = Callable[[Any, Any], Awaitable[Any]]


class ReplayMismatch(AssertionError):
    """Today's code does not reproduce a recorded history."""


def mismatch(report: ReplayReport) -> str | None:
    """Why ``report`` fails the check (divergence, timeout, other output), or None."""
    if report.divergence is not None:
        divergence = report.divergence
        return (f"{divergence.kind} divergence at seq {divergence.seq} (fork at "
                f"{divergence.fork_point}): {divergence.detail}")
    if report.outcome == "timed_out":
        return report.error or "the replay timed out"
    if report.output_matches is False:
        return "the code returned another output than the recorded one"
    return None


async def assert_replays(agents: Mapping[str, Any] | AgentFunction,
                         records: Sequence[EventRecord]) -> ReplayReport:
    """Replay ``records`` against today's code; fail unless it reproduces them."""
    report = await replay_events(records, agents, task_id=records[0].task_id if records else "")
    problem = mismatch(report)
    if problem is not None:
        raise ReplayMismatch(f"task {report.task_id}: {problem}")
    return report


async def assert_replay_equivalent(engine: Engine, agent: str, task_input: Any = None, *,
                                   responder: Any = None,
                                   count_effects: Callable[[], Awaitable[int]] | None = None
                                   ) -> ReplayReport:
    """Run ``agent(task_input)`` crash-free on ``engine``, then replay its history.

    Checks (RELIABILITY.md I10, L5): the replay against the same code reproduces the
    recorded end with no divergence; the state folded from the log equals the live state;
    and, when ``count_effects`` is given (e.g. the ledger's delivery count), the replay made
    zero calls.
    """
    from wal_engine.testing.crash import run_crash_free

    live = await run_crash_free(engine, agent, task_input, responder=responder)
    records = await engine.history(live.task_id)
    before = None if count_effects is None else await count_effects()
    report = await assert_replays(engine.agents, records)
    if count_effects is not None and await count_effects() != before:
        raise ReplayMismatch(f"task {live.task_id}: the replay made external calls")
    folded = fold(records, task_id=live.task_id)
    if msgspec.msgpack.encode(folded) != msgspec.msgpack.encode(live):
        raise ReplayMismatch(f"task {live.task_id}: fold(history) differs from the live state")
    return report


# ----------------------------------------------------------------------------- files


def history_rows(records: Iterable[EventRecord]) -> list[dict[str, Any]]:
    """Plain rows of a history: task_id, seq, type, version, epoch, payload text, hash hex;
    rows of chain versions 2 and 3 add what their hash covers besides (``chain_version``,
    ``recorded_at`` in ISO 8601 with microseconds, ``idempotency_key``)."""
    return [_history_row(r) for r in records]


def _history_row(r: EventRecord) -> dict[str, Any]:
    row: dict[str, Any] = {"task_id": r.task_id, "seq": r.seq, "type": r.type,
                           "version": r.version, "epoch": r.epoch,
                           "payload": bytes(r.payload).decode("utf-8"),
                           "hash": bytes(r.hash).hex()}
    if r.chain_version != 1:
        row.update(chain_version=r.chain_version, idempotency_key=r.idempotency_key,
                   recorded_at=None if r.recorded_at is None else r.recorded_at.isoformat())
    return row


def dump_history(records: Iterable[EventRecord], path: Path) -> None:
    """Write a history as JSON lines (see the module docstring)."""
    lines = [json.dumps(row, ensure_ascii=False, sort_keys=True)
             for row in history_rows(records)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def load_history(path: Path) -> list[EventRecord]:
    """Read a history written by :func:`dump_history` (keys of version 1 rows rebuilt)."""
    records: list[EventRecord] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            payload = str(row["payload"]).encode("utf-8")
            digest = bytes.fromhex(str(row["hash"]))
            chain_version = int(row.get("chain_version", 1))
            stamp = row.get("recorded_at")
            # Dumped whole (large values included); the row the hash covers is the split
            # the store made of it (deterministic: docs/architecture.md decision 61).
            stored, _chunks = row_payload(payload)
            record = EventRecord(
                task_id=str(row["task_id"]), seq=int(row["seq"]), type=str(row["type"]),
                version=int(row["version"]), epoch=int(row["epoch"]), payload=payload,
                row_payload=None if stored == payload else stored,
                idempotency_key=row["idempotency_key"] if chain_version != 1
                else _intent_key(str(row["type"]), payload), hash=digest,
                chain_version=chain_version,
                recorded_at=None if stamp is None else dt.datetime.fromisoformat(str(stamp)))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a history row: {error}") from error
        records.append(record)
    return records


def _intent_key(event_type: str, payload: bytes) -> str | None:
    if not event_type.endswith("_call_intended"):
        return None
    key = json.loads(payload).get("idempotency_key")
    return None if key is None else str(key)


def verify_history(records: Sequence[EventRecord]) -> VerifyReport:
    """Recompute the hash chain of a loaded history and check what its events mean."""
    task_id = records[0].task_id if records else ""
    return verify_semantics(task_id, list(records))


INSERT_EVENTS: Final = """
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key, hash,
                        chain_version, recorded_at)
SELECT $1, e.seq, e.type, e.version, e.epoch, e.payload, e.idempotency_key, e.hash,
       e.chain_version, coalesce(e.recorded_at, now())
  FROM unnest($2::int8[], $3::text[], $4::int2[], $5::int8[], $6::bytea[], $7::text[],
              $8::bytea[], $9::int2[], $10::timestamptz[])
       AS e(seq, type, version, epoch, payload, idempotency_key, hash, chain_version,
            recorded_at)
"""
INSERT_BLOBS: Final = """
INSERT INTO wal_blobs (task_id, digest, ordinal, value_bytes, data)
SELECT $1, b.digest, b.ordinal, b.value_bytes, b.data
  FROM unnest($2::bytea[], $3::int4[], $4::int8[], $5::bytea[])
       AS b(digest, ordinal, value_bytes, data)
"""
INSERT_HEAD: Final = """
INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash, lease_epoch)
VALUES ($1, $2, 'QUEUED', 1, $3, 0)
"""
MOVE_HEAD: Final = """
UPDATE wal_tasks SET status = $2, status_path = $3::text[], head_seq = $4, head_hash = $5,
                     lease_epoch = $6, attempts = $7
 WHERE tenant = current_setting('wal.tenant', true) AND task_id = $1
"""


async def insert_history(database: Any, records: Sequence[EventRecord]) -> AgentState:
    """Load a recorded history into a database as a task (head and events), as the engine
    would have left it; returns the folded state. The status moves are checked by the
    schema's trigger like any other."""
    state = fold(records, task_id=records[0].task_id)
    walk = [str(ev.target_status(r.type)) for r in records[1:]
            if ev.target_status(r.type) is not None]
    head = records[-1]
    chunks = Chunks()
    stored: list[bytes] = []
    for record in records:
        row, pieces = row_payload(record.payload)
        stored.append(record.row_payload or row)
        chunks.add(pieces)
    async with database.pool.acquire() as connection, connection.transaction():
        await connection.execute(INSERT_HEAD, head.task_id, state.agent, records[0].hash)
        if chunks:
            await connection.execute(INSERT_BLOBS, head.task_id, *chunks.args())
        await connection.execute(
            INSERT_EVENTS, head.task_id, [r.seq for r in records], [r.type for r in records],
            [r.version for r in records], [r.epoch for r in records],
            stored, [r.idempotency_key for r in records], [r.hash for r in records],
            [r.chain_version for r in records], [r.recorded_at for r in records])
        if walk:
            await connection.execute(MOVE_HEAD, head.task_id, walk[-1], walk, head.seq,
                                     head.hash, max(r.epoch for r in records), state.attempts)
        else:
            await connection.execute(MOVE_HEAD, head.task_id, "QUEUED", None, head.seq,
                                     head.hash, max(r.epoch for r in records), state.attempts)
    return state
