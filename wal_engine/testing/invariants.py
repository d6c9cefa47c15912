"""Invariant checks over a test database: what must hold after any fault (RELIABILITY.md).

Every check reads the database and returns a list of :class:`Violation` (empty when the
invariant holds), so a harness can count violations, print them, and fail on the first.
The checks name the invariant they guard (``I1`` ... ``I14``):

* :func:`check_log`: per task, seqs exactly ``1..head_seq`` (I2), the hash chain and the
  head (I13), epochs never decreasing along seq and every claim, orphaning or cancellation
  bumping the epoch (I3, I7), nothing after the terminal event and exactly one of them (I9),
  and the log folds under the replay rules (I9, I10).
* :class:`AckRecorder` / :func:`check_acknowledged`: every append that returned success is
  still there with the same hash (I1).
* :func:`check_effects` (in :mod:`wal_engine.testing.ledger`): side effects at most once per
  key, and only for durable intents (I4, I5, I7).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Final

import msgspec

from replay.fold import fold
from wal_engine.chain import ChainVerifier
from wal_engine.errors import WalError
from wal_engine.store import AppendResult, Database, EventRecord, PendingAppend
from wal_engine.store.connection import CONNECTION_ERRORS
from wal_engine.store.store import record_from_row

TERMINAL_TYPES: Final = frozenset({"task_completed", "task_failed", "task_cancelled"})
EPOCH_BUMPS: Final = frozenset({"task_claimed", "task_resumed", "task_orphaned",
                                "task_cancelled"})
"""Events the database writes at a new lease epoch: each must carry a higher epoch than
every earlier event of its task (one writer per epoch, RELIABILITY.md I3)."""

events_read_max: Final = 1_000_000
snapshot_attempts_max: Final = 3
"""Bound on the rows one check reads (test databases are small)."""

READ_ALL_EVENTS: Final = """
SELECT task_id, seq, type, version, epoch, payload, idempotency_key, hash, recorded_at,
       chain_version
  FROM wal_events
 WHERE tenant = current_setting('wal.tenant', true)
    AND ($1::text[] IS NULL OR task_id = ANY($1::text[]))
 ORDER BY task_id, seq
 LIMIT $2
"""
READ_HEADS: Final = """
SELECT task_id, head_seq, head_hash, status FROM wal_tasks
 WHERE tenant = current_setting('wal.tenant', true)
    AND ($1::text[] IS NULL OR task_id = ANY($1::text[]))
 ORDER BY task_id
 LIMIT $2
"""
READ_HASHES: Final = """
SELECT e.task_id, e.seq, e.hash
  FROM wal_events e JOIN unnest($1::text[], $2::int8[]) AS a(task_id, seq)
       ON e.tenant = current_setting('wal.tenant', true) AND e.task_id = a.task_id AND e.seq = a.seq
"""


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """One broken invariant: which, where, and what was seen."""

    invariant: str
    """The RELIABILITY.md id, e.g. ``I2``."""
    detail: str
    task_id: str | None = None
    seq: int | None = None

    def __str__(self) -> str:
        where = "" if self.task_id is None else f" task {self.task_id}"
        at = "" if self.seq is None else f" seq {self.seq}"
        return f"{self.invariant}{where}{at}: {self.detail}"


class InvariantViolation(AssertionError):
    """Raised by :func:`assert_no_violations`; carries every violation found."""

    def __init__(self, violations: Sequence[Violation], context: str = "") -> None:
        self.violations = list(violations)
        head = f"{len(self.violations)} invariant violation(s)"
        if context:
            head += f" ({context})"
        lines = [head, *(f"  {v}" for v in self.violations[:20])]
        if len(self.violations) > 20:
            lines.append(f"  ... and {len(self.violations) - 20} more")
        super().__init__("\n".join(lines))


def assert_no_violations(violations: Sequence[Violation], context: str = "") -> None:
    """Fail (``InvariantViolation``, an AssertionError) on a single violation."""
    if violations:
        raise InvariantViolation(violations, context)


async def read_events(database: Database,
                      task_ids: Sequence[str] | None = None) -> dict[str, list[EventRecord]]:
    """Every stored event (of ``task_ids`` when given), grouped by task, in seq order."""
    rows = await database.fetch(READ_ALL_EVENTS, None if task_ids is None else list(task_ids),
                                events_read_max)
    return _group(rows)


def _group(rows: Iterable[Any]) -> dict[str, list[EventRecord]]:
    grouped: dict[str, list[EventRecord]] = {}
    for task_id, group in itertools.groupby(rows, key=lambda row: str(row["task_id"])):
        grouped[task_id] = [record_from_row(row) for row in group]
    return grouped


class Snapshot(msgspec.Struct, kw_only=True):
    """The log, the heads and any extra rows, read in one REPEATABLE READ transaction so
    that checks never see half of a concurrent append."""

    events: dict[str, list[EventRecord]]
    heads: list[Any]
    extra: dict[str, list[Any]] = {}


async def read_snapshot(database: Database, task_ids: Sequence[str] | None = None, *,
                        extra: dict[str, str] | None = None) -> Snapshot:
    """Read events and heads (and each ``extra`` name -> query) as of one moment.

    A read that meets a session the test itself ended (a lost-connection fault) is read
    again on another one: reading changes nothing.
    """
    wanted = None if task_ids is None else list(task_ids)
    for attempt in range(1, snapshot_attempts_max + 1):
        try:
            async with database.pool.acquire() as connection, connection.transaction(
                    isolation="repeatable_read", readonly=True):
                rows = await connection.fetch(READ_ALL_EVENTS, wanted, events_read_max)
                heads = await connection.fetch(READ_HEADS, wanted, events_read_max)
                more = {name: list(await connection.fetch(query))
                        for name, query in (extra or {}).items()}
            return Snapshot(events=_group(rows), heads=list(heads), extra=more)
        except CONNECTION_ERRORS:
            if attempt == snapshot_attempts_max:
                raise
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


async def check_log(database: Database,
                    task_ids: Sequence[str] | None = None) -> list[Violation]:
    """I2, I3, I7, I9, I10, I13 for every task (or for ``task_ids``)."""
    return check_snapshot(await read_snapshot(database, task_ids))


_LastCheck = tuple[tuple[EventRecord, ...], int, bytes, str, list[Violation]]
_last_checks: dict[str, _LastCheck] = {}
"""The last inputs and result of :func:`check_task_log` per task id, for
:func:`check_snapshot`."""
last_checks_max: Final = 4096


def check_snapshot(snapshot: Snapshot) -> list[Violation]:
    """The checks of :func:`check_log` over rows already read (pure).

    A crash machine checks every task after every rule, and most tasks did not move since
    the last check: a task whose rows and head are equal, field by field, to those of its
    last check gets that check's result again (the checks are a pure function of them)
    instead of having its chain rehashed and its log folded again.
    """
    violations: list[Violation] = []
    seen: set[str] = set()
    for head in snapshot.heads:
        task_id = str(head["task_id"])
        seen.add(task_id)
        records = tuple(snapshot.events.get(task_id, ()))
        head_seq, head_hash = int(head["head_seq"]), bytes(head["head_hash"])
        head_status = str(head["status"])
        last = _last_checks.get(task_id)
        if last is not None and last[:4] == (records, head_seq, head_hash, head_status):
            violations += last[4]
            continue
        found = check_task_log(task_id, records, head_seq=head_seq, head_hash=head_hash,
                               head_status=head_status)
        if len(_last_checks) >= last_checks_max:
            _last_checks.clear()
        _last_checks[task_id] = (records, head_seq, head_hash, head_status, found)
        violations += found
    for task_id in sorted(snapshot.events.keys() - seen):
        violations.append(Violation(invariant="I2", task_id=task_id,
                                    detail="events stored for a task without a head row"))
    return violations


def check_task_log(task_id: str, records: Sequence[EventRecord], *, head_seq: int,
                   head_hash: bytes, head_status: str | None = None) -> list[Violation]:
    """The per-task checks of :func:`check_log` on rows already read (pure).

    ``head_seq``/``head_hash`` are the head the task row records (as of its last status
    move); the log must reach it with the same hash and may go on past it (observations
    append to the log only).
    """
    violations = _check_seqs(task_id, records, head_seq)
    violations += _check_epochs(task_id, records)
    violations += _check_terminal(task_id, records, head_status)
    if not any(v.invariant == "I2" for v in violations):
        violations += _check_chain(task_id, records, head_seq, head_hash)
        violations += _check_fold(task_id, records, head_status)
    return violations


def _check_seqs(task_id: str, records: Sequence[EventRecord], head_seq: int) -> list[Violation]:
    seqs = [record.seq for record in records]
    if seqs == list(range(1, len(seqs) + 1)) and head_seq <= len(seqs):
        return []
    duplicates = sorted({seq for seq in seqs if seqs.count(seq) > 1})
    if duplicates:
        return [Violation(invariant="I2", task_id=task_id, seq=duplicates[0],
                          detail=f"seq stored more than once: {duplicates[:5]}")]
    missing = sorted(set(range(1, max([head_seq, *seqs]) + 1)) - set(seqs))
    return [Violation(invariant="I2", task_id=task_id, seq=missing[0] if missing else None,
                      detail=f"seqs are not 1..n reaching the recorded head {head_seq}: "
                             f"{len(seqs)} stored, missing {missing[:5]}, highest "
                             f"{max(seqs, default=0)}")]


def _check_epochs(task_id: str, records: Sequence[EventRecord]) -> list[Violation]:
    violations: list[Violation] = []
    highest = -1
    for record in records:
        if record.epoch < highest:
            violations.append(Violation(
                invariant="I7", task_id=task_id, seq=record.seq,
                detail=f"{record.type} accepted at stale epoch {record.epoch} after epoch "
                       f"{highest}"))
        elif record.type in EPOCH_BUMPS and record.epoch <= highest:
            violations.append(Violation(
                invariant="I3", task_id=task_id, seq=record.seq,
                detail=f"{record.type} did not bump the epoch ({record.epoch} after "
                       f"{highest}): two owners share one epoch"))
        highest = max(highest, record.epoch)
    return violations


def _check_terminal(task_id: str, records: Sequence[EventRecord],
                    head_status: str | None) -> list[Violation]:
    terminal = [index for index, record in enumerate(records) if record.type in TERMINAL_TYPES]
    if not terminal:
        if head_status in ("COMPLETED", "FAILED"):
            return [Violation(invariant="I9", task_id=task_id,
                              detail=f"head says {head_status} but no terminal event")]
        return []
    violations: list[Violation] = []
    if len(terminal) > 1:
        violations.append(Violation(invariant="I9", task_id=task_id,
                                    seq=records[terminal[1]].seq,
                                    detail=f"{len(terminal)} terminal events"))
    if terminal[0] != len(records) - 1:
        after = records[terminal[0] + 1]
        violations.append(Violation(invariant="I9", task_id=task_id, seq=after.seq,
                                    detail=f"{after.type} after the terminal "
                                           f"{records[terminal[0]].type}"))
    return violations


def _check_chain(task_id: str, records: Sequence[EventRecord], head_seq: int,
                 head_hash: bytes) -> list[Violation]:
    verifier = ChainVerifier(task_id)
    at_head: bytes | None = None
    for record in records:
        if not verifier.feed(record):
            break
        if record.seq == head_seq:
            at_head = record.hash
    report = verifier.report()
    if report.violation is None:
        if at_head != head_hash:
            return [Violation(invariant="I13", task_id=task_id, seq=head_seq,
                              detail="the log does not reach the task row's recorded head "
                                     "with its hash")]
        return []
    kind = report.violation.kind
    invariant = {"gap": "I2", "epoch": "I7", "transition": "I9"}.get(kind, "I13")
    return [Violation(invariant=invariant, task_id=task_id, seq=report.violation.seq,
                      detail=f"chain verify: {kind}: {report.violation.detail}")]


def _check_fold(task_id: str, records: Sequence[EventRecord],
                head_status: str | None) -> list[Violation]:
    try:
        state = fold(records, task_id=task_id)
    except WalError as error:
        return [Violation(invariant="I9", task_id=task_id,
                          detail=f"the log does not fold: {type(error).__name__}: {error}")]
    if head_status is not None and state.status is not None and str(state.status) != head_status:
        return [Violation(invariant="I10", task_id=task_id,
                          detail=f"the log folds to {state.status}, the head says "
                                 f"{head_status}")]
    return []


# ----------------------------------------------------------------------------- I1


class AckRecorder:
    """Records every append the engine saw acknowledged, to check none is lost later (I1).

    Install on an engine with :meth:`install`: it wraps the engine's group committer, the
    path every task run's append takes. An append whose outcome was ambiguous and resolved
    as committed by reading back counts as acknowledged too (the engine acted on it).
    """

    def __init__(self) -> None:
        self.acknowledged: dict[tuple[str, int], bytes] = {}
        self.appends = 0

    def install(self, engine: Any) -> None:
        """Wrap ``engine.committer.append`` (idempotent per engine)."""
        committer = engine.committer
        if getattr(committer, "_wal_ack_recorder", None) is self:
            return
        original: Callable[[PendingAppend], Awaitable[AppendResult]] = committer.append

        async def append(pending: PendingAppend) -> AppendResult:
            result = await original(pending)
            self.record(result)
            return result

        committer.append = append
        committer._wal_ack_recorder = self

    def record(self, result: AppendResult) -> None:
        """Note one acknowledged append (its last event's seq and hash)."""
        self.acknowledged[(result.task_id, result.head_seq)] = result.head_hash
        self.appends += 1


async def check_acknowledged(database: Database,
                             acknowledged: dict[tuple[str, int], bytes]) -> list[Violation]:
    """I1: every acknowledged (task, seq) is stored with the acknowledged hash.

    The chain makes the last event of each acknowledged append stand for the whole batch
    and for everything before it.
    """
    # Copied first: appends acknowledged while the query runs are checked next time.
    expected = dict(acknowledged)
    if not expected:
        return []
    keys = list(expected)
    rows = await database.fetch(READ_HASHES, [k[0] for k in keys], [k[1] for k in keys])
    stored = {(str(r["task_id"]), int(r["seq"])): bytes(r["hash"]) for r in rows}
    violations = []
    for (task_id, seq), digest in sorted(expected.items()):
        found = stored.get((task_id, seq))
        if found is None:
            violations.append(Violation(invariant="I1", task_id=task_id, seq=seq,
                                        detail="acknowledged append is missing"))
        elif found != digest:
            violations.append(Violation(invariant="I1", task_id=task_id, seq=seq,
                                        detail="acknowledged append was replaced by another "
                                               "event"))
    return violations


def summarise(violations: Iterable[Violation]) -> dict[str, int]:
    """Count violations per invariant id."""
    counts: dict[str, int] = {}
    for violation in violations:
        counts[violation.invariant] = counts.get(violation.invariant, 0) + 1
    return counts
