"""Semantic verification of a task's history (pure): the chain, and what the events mean.

A chain that hashes correctly proves only that nobody changed the rows after they were
written; whoever holds the runtime credential can append correctly hashed events. So
``verify`` also folds the history with the replayer's strict rules (:mod:`replay.fold`):
every payload must decode into its event type, every event must be possible where it
stands (legal status moves, observations only while running, nothing after a terminal
event, calls answered once, ...). On top of :class:`~wal_engine.chain.ChainVerifier`'s
checks it adds what the task row and the clock say:

* no event may carry an epoch beyond the task row's lease epoch (the runtime role cannot
  raise that column; only the database's own claims, orphanings and cancellations do);
* ``recorded_at`` of a row must not go back more than ``limits.recorded_at_skew_max_s``
  behind its predecessor's (writers' clocks differ a little, never by days).
"""

from __future__ import annotations

import datetime as dt

from replay.fold import StateBuilder
from wal_engine import limits
from wal_engine.chain import ChainRow, ChainVerifier, VerifyReport, Violation
from wal_engine.errors import WalError

_skew: dt.timedelta = dt.timedelta(seconds=limits.recorded_at_skew_max_s)


class HistoryVerifier(ChainVerifier):
    """The chain verifier plus the semantic checks (see the module docstring)."""

    def __init__(self, task_id: str, *, lease_epoch: int | None = None) -> None:
        super().__init__(task_id)
        self.lease_epoch = lease_epoch
        """The task row's lease epoch, when known: no event may carry a higher one."""
        self._builder = StateBuilder(task_id=task_id)
        self._last_recorded_at: dt.datetime | None = None

    def _check(self, row: ChainRow) -> Violation | None:
        found = super()._check(row)
        if found is not None:
            return found
        if self.lease_epoch is not None and row.epoch > self.lease_epoch:
            return Violation(seq=row.seq, kind="epoch",
                             detail=f"epoch {row.epoch} beyond the task's lease epoch "
                                    f"{self.lease_epoch}")
        found = self._check_time(row)
        if found is not None:
            return found
        try:
            self._builder.extend([row])
        except WalError as error:  # ReplayError, UndecodableEvent, UnknownEventVersion
            return Violation(seq=row.seq, kind="semantics", detail=str(error))
        return None

    def _check_time(self, row: ChainRow) -> Violation | None:
        stamp = getattr(row, "recorded_at", None)
        if stamp is None:
            return None
        previous, self._last_recorded_at = self._last_recorded_at, stamp
        if previous is not None and stamp < previous - _skew:
            return Violation(seq=row.seq, kind="time",
                             detail=f"recorded at {stamp.isoformat()}, {previous - stamp} "
                                    f"before its predecessor")
        return None


def verify_history(task_id: str, rows: list[ChainRow] | tuple[ChainRow, ...]) -> VerifyReport:
    """Verify a whole history held in memory, chain and semantics."""
    verifier = HistoryVerifier(task_id)
    for row in rows:
        if not verifier.feed(row):
            break
    return verifier.report()
