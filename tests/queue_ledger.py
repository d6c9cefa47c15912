"""The ledger of queue slots, read from the log itself (shared by the queue tests).

Each task's events, in seq order, say when it held a slot: an event that moves it into a
leased status (RUNNING, CHECKPOINTED) from another one takes a slot, one that moves it out
gives it back. The claim's events are written by the database at the time of writing
(``clock_timestamp()``, after any wait for the queue's lock) and the releases by the worker
before they commit, so two intervals that overlap in this ledger overlapped for real.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from wal_engine.events import EVENT_TYPES
from wal_engine.state_machine import Status

LEASED = {Status.RUNNING, Status.CHECKPOINTED}

LEDGER_SQL = """
SELECT e.task_id, t.queue, t.partition_key, t.created_at, t.priority, e.seq, e.type,
       e.recorded_at, wal_payload_json(e.payload) ->> 'worker_id' AS worker_id
  FROM wal_events e
  JOIN wal_tasks t ON t.tenant = e.tenant AND t.task_id = e.task_id
 WHERE e.tenant = current_setting('wal.tenant', true)
 ORDER BY e.task_id, e.seq
"""


@dataclass
class Slot:
    """One holding of a slot: a task of a queue, by a worker, from ``start`` to ``end``."""

    task_id: str
    queue: str
    worker_id: str | None
    start: dt.datetime
    end: dt.datetime | None


@dataclass
class Ledger:
    """Every slot held, and each task's queue, partition key and submission time."""

    slots: list[Slot] = field(default_factory=list)
    tasks: dict[str, tuple[str, str | None, dt.datetime]] = field(default_factory=dict)

    def peak(self, queue: str, *, worker_id: str | None = None,
             by_worker: bool = False) -> int:
        """The most slots of ``queue`` held at one instant (of one worker when given; the
        largest of any worker when ``by_worker``)."""
        if by_worker:
            workers = {s.worker_id for s in self.slots if s.queue == queue}
            return max((self.peak(queue, worker_id=w) for w in workers), default=0)
        moves: list[tuple[dt.datetime, int]] = []
        for slot in self.slots:
            if slot.queue != queue or (worker_id is not None and slot.worker_id != worker_id):
                continue
            moves.append((slot.start, 1))
            if slot.end is not None:
                moves.append((slot.end, -1))
        # At equal times a release counts before a claim (-1 sorts first).
        held = peak = 0
        for _, move in sorted(moves):
            held += move
            peak = max(peak, held)
        return peak

    def claims_past_limit(self, queue: str,
                          limits: list[tuple[dt.datetime, int | None]]) -> list[str]:
        """Claims of ``queue`` made while it already held its limit in effect at that
        instant (``limits``: when each limit took effect, oldest first; None for none).
        Lowering a limit below the tasks running lets them finish; no claim may follow."""
        slots = [s for s in self.slots if s.queue == queue]
        problems = []
        for slot in slots:
            in_effect = [limit for since, limit in limits if since <= slot.start]
            limit = in_effect[-1] if in_effect else None
            held = sum(1 for other in slots if other is not slot and other.start < slot.start
                       and (other.end is None or other.end > slot.start))
            if limit is not None and held >= limit:
                problems.append(f"{queue}: {slot.task_id} claimed with {held} held, "
                                f"limit {limit}")
        return problems

    def partition_violations(self) -> list[str]:
        """Partition rule breaches: two tasks of one key holding slots at once, or a task
        first claimed before an older one of its key was first claimed."""
        by_key: dict[tuple[str, str], list[Slot]] = defaultdict(list)
        for slot in self.slots:
            queue, key, _ = self.tasks[slot.task_id]
            if key is not None:
                by_key[(queue, key)].append(slot)
        problems = []
        for (queue, key), slots in by_key.items():
            ordered = sorted(slots, key=lambda s: s.start)
            for before, after in itertools.pairwise(ordered):
                if before.task_id != after.task_id and (before.end is None
                                                        or before.end > after.start):
                    problems.append(f"{queue}/{key}: {before.task_id} and {after.task_id} "
                                    "overlap")
            first: dict[str, dt.datetime] = {}
            for slot in ordered:
                first.setdefault(slot.task_id, slot.start)
            by_claim = sorted(first, key=lambda task: first[task])
            by_submission = sorted(first, key=lambda task: (self.tasks[task][2], task))
            if by_claim != by_submission:
                problems.append(f"{queue}/{key}: claimed {by_claim}, submitted "
                                f"{by_submission}")
        return problems


def ledger_of(rows: list[Any]) -> Ledger:
    """The ledger of the rows of ``LEDGER_SQL``."""
    ledger = Ledger()
    open_slot: dict[str, Slot] = {}
    status: dict[str, Status] = {}
    for row in rows:
        task = row["task_id"]
        ledger.tasks[task] = (row["queue"], row["partition_key"], row["created_at"])
        target = EVENT_TYPES[row["type"]].TARGET_STATUS
        if target is None:
            continue
        was_leased = status.get(task) in LEASED
        status[task] = target
        if target in LEASED and not was_leased:
            slot = Slot(task, row["queue"], row["worker_id"], row["recorded_at"], None)
            open_slot[task] = slot
            ledger.slots.append(slot)
        elif target not in LEASED and was_leased:
            open_slot.pop(task).end = row["recorded_at"]
    return ledger


async def read_ledger(connection: Any) -> Ledger:
    """The ledger of the connection's tenant (``connection.fetch`` as asyncpg's)."""
    return ledger_of(list(await connection.fetch(LEDGER_SQL)))
