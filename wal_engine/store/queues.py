"""Queues (issue 24): where a task waits, and the limits its claim is held to.

A task is submitted to a named queue (``default`` unless given) with a priority (higher
first, then oldest first), an optional partition key (the tasks of one key in one queue run
one at a time, in submission order) and an optional deduplication id (refused while a live
task of the queue holds it). A queue has a global concurrency limit (leased tasks across
every worker and host) and a per-worker one; both are enforced by the claim statement
(``wal_claim_tasks`` in ``schema.sql``), stored in ``wal_queues``, changed at run time by
:func:`set_queue` (one statement that also writes the audit row in ``wal_queue_changes``).

Placement values are checked here, before anything is sent, with the bounds of the
``wal_tasks_queue_bounds`` check of ``schema.sql`` (which refuses them again for a writer
that bypasses this module).
"""

from __future__ import annotations

import datetime as dt
import enum
import re
from collections.abc import Iterable
from typing import Any, Final

import msgspec
import orjson

from wal_engine.errors import InvalidInput
from wal_engine.ids import validate_text
from wal_engine.store import queries
from wal_engine.store.connection import Database

DEFAULT_QUEUE: Final = "default"
queue_name_length_max: Final = 64
priority_min: Final = -1_000_000
priority_max: Final = 1_000_000
partition_key_bytes_max: Final = 256
dedup_id_bytes_max: Final = 256
queue_limit_max: Final = 1_000_000
requested_by_bytes_max: Final = 256
queue_rows_max: Final = 10_000
"""At most this many queues are listed (a tenant's queues are few; the bound is a bound)."""
queue_changes_max: Final = 10_000

_queue_name: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class Unchanged(enum.Enum):
    """The type of :data:`UNCHANGED`."""

    UNCHANGED = "unchanged"


UNCHANGED: Final = Unchanged.UNCHANGED
"""Marks a limit :func:`set_queue` leaves as it is (None removes it)."""


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a submitted task waits: its queue, priority, partition key and dedup id."""

    queue: str = DEFAULT_QUEUE
    priority: int = 0
    partition_key: str | None = None
    dedup_id: str | None = None


class QueueStats(msgspec.Struct, frozen=True, kw_only=True):
    """One queue as ``wal-engine queues`` shows it.

    Attributes:
        queue: Its name.
        configured: Whether it has a row in ``wal_queues`` (``default`` may have none).
        depth: Tasks claimable now (QUEUED, RESUMING, WAITING whose time has come).
        running: Tasks leased by a worker (RUNNING, CHECKPOINTED): the slots in use.
        waiting: Tasks WAITING for a timer or signal not yet due (they hold no slot).
        concurrency_max: The global limit, None for none.
        worker_concurrency_max: The per-worker limit, None for none.
        oldest_wait_s: How long the oldest claimable task has waited, None when none is.
        updated_at: When its limits last changed (None without a row).
    """

    queue: str
    configured: bool
    depth: int
    running: int
    waiting: int
    concurrency_max: int | None
    worker_concurrency_max: int | None
    oldest_wait_s: float | None
    updated_at: dt.datetime | None


class QueueChange(msgspec.Struct, frozen=True, kw_only=True):
    """One audited change of a queue's limits (``wal_queue_changes``)."""

    change_id: int
    queue: str
    changed_at: dt.datetime
    changed_by: str
    """The database login role of the session that made the change."""
    requested_by: str | None
    """The caller's own label (the CLI sends the operating-system user)."""
    before: dict[str, Any] | None
    """The limits before, None when the change created the queue."""
    after: dict[str, Any]


class QueueSettings(msgspec.Struct, frozen=True, kw_only=True):
    """A queue's limits after :func:`set_queue`, and whether that call changed them."""

    queue: str
    concurrency_max: int | None
    worker_concurrency_max: int | None
    created: bool
    changed: bool


def validate_queue_name(queue: object) -> str:
    """Return ``queue`` if it is a queue name (1..64 of letters, digits, ``_ . : -``)."""
    if not isinstance(queue, str):
        raise InvalidInput(f"a queue name must be a str, not {type(queue).__name__}")
    if _queue_name.fullmatch(queue) is None:
        raise InvalidInput(f"queue name {queue!r} must be 1..{queue_name_length_max} of "
                           "letters, digits and _ . : -")
    return queue


def validate_limit(value: object, what: str) -> int:
    """Return ``value`` if it is a limit: an int of 1..``queue_limit_max`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{what} must be an int, not {type(value).__name__}")
    if not 1 <= value <= queue_limit_max:
        raise InvalidInput(f"{what} must be 1..{queue_limit_max}, not {value}")
    return value


def placement(queue: object = DEFAULT_QUEUE, priority: object = 0,
              partition_key: object = None, dedup_id: object = None) -> Placement:
    """A checked :class:`Placement`, or :class:`~wal_engine.errors.InvalidInput`."""
    name = validate_queue_name(queue)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInput(f"a priority must be an int, not {type(priority).__name__}")
    if not priority_min <= priority <= priority_max:
        raise InvalidInput(f"a priority must be {priority_min}..{priority_max}, not {priority}")
    key = None if partition_key is None else validate_text(
        partition_key, "a partition key", bytes_max=partition_key_bytes_max, empty_ok=False)
    dedup = None if dedup_id is None else validate_text(
        dedup_id, "a dedup id", bytes_max=dedup_id_bytes_max, empty_ok=False)
    return Placement(queue=name, priority=priority, partition_key=key, dedup_id=dedup)


async def set_queue(database: Database, queue: str, *,
                    concurrency_max: int | Unchanged | None = UNCHANGED,
                    worker_concurrency_max: int | Unchanged | None = UNCHANGED,
                    requested_by: str | None = None) -> QueueSettings:
    """Create ``queue`` or change its limits, and audit the change; one statement.

    A limit given as an int (at least 1) is set, None removes it, :data:`UNCHANGED` (the
    default) leaves it. Bad input raises :class:`~wal_engine.errors.InvalidInput` before
    anything is sent.
    """
    name = validate_queue_name(queue)
    values: dict[str, int | None] = {}
    clear: list[str] = []
    for field, value in (("concurrency_max", concurrency_max),
                         ("worker_concurrency_max", worker_concurrency_max)):
        if value is None:
            clear.append(field)
        elif value is not UNCHANGED:
            values[field] = validate_limit(value, field)
    if requested_by is not None:
        validate_text(requested_by, "requested_by", bytes_max=requested_by_bytes_max)
    row = await database.fetchrow(queries.SET_QUEUE, name, values.get("concurrency_max"),
                                  values.get("worker_concurrency_max"), clear, requested_by)
    return QueueSettings(queue=row["queue"], concurrency_max=row["concurrency_max"],
                         worker_concurrency_max=row["worker_concurrency_max"],
                         created=row["created"], changed=row["changed"])


async def read_queues(database: Database) -> list[QueueStats]:
    """Every queue of the tenant that is configured or holds live tasks (one statement)."""
    return queue_stats(await database.fetch(queries.QUEUE_STATS, queue_rows_max))


def queue_stats(rows: Iterable[Any]) -> list[QueueStats]:
    """:class:`QueueStats` of the rows of ``QUEUE_STATS``."""
    return [QueueStats(queue=row["queue"], configured=row["configured"], depth=row["depth"],
                       running=row["running"], waiting=row["waiting"],
                       concurrency_max=row["concurrency_max"],
                       worker_concurrency_max=row["worker_concurrency_max"],
                       oldest_wait_s=row["oldest_wait_s"], updated_at=row["updated_at"])
            for row in rows]


async def read_queue_changes(database: Database, queue: str | None = None, *,
                             limit: int = 100) -> list[QueueChange]:
    """The audited changes of ``queue`` (all queues when None), newest first."""
    if queue is not None:
        validate_queue_name(queue)
    limit = max(1, min(limit, queue_changes_max))
    rows = await database.fetch(queries.QUEUE_CHANGES, queue, limit)
    return [QueueChange(change_id=row["change_id"], queue=row["queue"],
                        changed_at=row["changed_at"], changed_by=row["changed_by"],
                        requested_by=row["requested_by"],
                        before=None if row["before"] is None else orjson.loads(row["before"]),
                        after=orjson.loads(row["after"]))
            for row in rows]


async def dedup_holder(database: Database, queue: str, dedup_id: str) -> str | None:
    """The live task of ``queue`` holding ``dedup_id``, if any (a refused submission's rival)."""
    row = await database.fetchrow(queries.DEDUP_HOLDER, queue, dedup_id)
    return None if row is None else str(row["task_id"])


def running_by_queue(queues: dict[str, str], running: set[str]) -> tuple[list[str], list[int]]:
    """The claim's per-worker arguments: this worker's running tasks (``running``, by task
    id), counted by their queue (``queues``: task id -> queue, as the claims returned it)."""
    counts: dict[str, int] = {}
    for task_id in running:
        queue = queues.get(task_id)
        if queue is not None:
            counts[queue] = counts.get(queue, 0) + 1
    names = sorted(counts)
    return names, [counts[name] for name in names]
