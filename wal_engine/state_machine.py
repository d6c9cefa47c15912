"""The task state machine (pure): statuses, legal moves, and which event makes which move.

The same table is installed in the database (``wal_transitions`` in ``schema.sql``) and
enforced there by a trigger, so an illegal move fails even when Python is bypassed. A test
checks that the two tables are equal.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final

from wal_engine.errors import IllegalTransition


class Status(enum.StrEnum):
    """Where a task is in its life."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    CHECKPOINTED = "CHECKPOINTED"
    WAITING = "WAITING"
    RESUMING = "RESUMING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


TERMINAL: Final = frozenset({Status.COMPLETED, Status.FAILED})
LEASED: Final = frozenset({Status.RUNNING, Status.CHECKPOINTED})
"""Statuses in which a worker holds the task's lease."""

TRANSITIONS: Final[frozenset[tuple[Status, Status]]] = frozenset(
    {
        (Status.QUEUED, Status.RUNNING),
        (Status.RUNNING, Status.CHECKPOINTED),
        (Status.CHECKPOINTED, Status.RUNNING),
        (Status.RUNNING, Status.WAITING),
        (Status.CHECKPOINTED, Status.WAITING),
        (Status.WAITING, Status.RESUMING),
        (Status.RUNNING, Status.RESUMING),
        (Status.CHECKPOINTED, Status.RESUMING),
        (Status.RESUMING, Status.RUNNING),
        (Status.RUNNING, Status.COMPLETED),
        (Status.CHECKPOINTED, Status.COMPLETED),
        *((status, Status.FAILED) for status in Status if status not in TERMINAL),
    }
)
"""Legal single moves (DESIGN.md section 3; CHECKPOINTED -> COMPLETED is allowed too, see
docs/architecture.md)."""


def is_legal(from_status: Status, to_status: Status) -> bool:
    """Whether one move is allowed."""
    return (from_status, to_status) in TRANSITIONS


def check_path(
    from_status: Status, path: Iterable[Status], task_id: str | None = None
) -> Status:
    """Walk ``path`` from ``from_status``; return the final status or raise IllegalTransition."""
    current = from_status
    for to_status in path:
        if not is_legal(current, to_status):
            raise IllegalTransition(task_id, current, to_status)
        current = to_status
    return current
