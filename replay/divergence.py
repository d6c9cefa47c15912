"""Non-determinism: today's agent code asks for other external calls than the log recorded.

Re-running agent code against its history is only sound if the code makes the same calls in
the same order. When it does not, the journal cursor raises :class:`NonDeterminismError`
with the seq where the histories part, both sides, and the fork point: the last seq before
the divergence. Forking the task there (``wal_engine.runtime.resume.fork``) keeps everything up to
the divergence and lets today's code continue from it.
"""

from __future__ import annotations

import msgspec

from wal_engine.errors import WalError


class CallSignature(msgspec.Struct, frozen=True, kw_only=True):
    """What identifies one external call for matching: kind, name and args hash."""

    kind: str
    name: str
    args_hash: str = ""

    def __str__(self) -> str:
        args = f" with args {self.args_hash[:16]}" if self.args_hash else ""
        return f"{self.kind} {self.name!r}{args}"


class NonDeterminismError(WalError):
    """The code's k-th external call differs from the k-th recorded one, or their counts do.

    Attributes:
        seq: Seq of the recorded event where code and history part (the recorded intent, or
            the event that ended the history when the code asks for more calls).
        recorded: The recorded call, or None when the history has no further call.
        requested: The call the code asked for, or None when the code finished.
        fork_point: The last seq before the divergence; fork there to let today's code run.
        call_index: Position (from 0) of the call in the task's sequence of external calls.
        task_id: The task, when known.
    """

    def __init__(
        self,
        *,
        seq: int,
        recorded: CallSignature | None,
        requested: CallSignature | None,
        fork_point: int,
        call_index: int,
        task_id: str | None = None,
    ) -> None:
        self.seq = seq
        self.recorded = recorded
        self.requested = requested
        self.fork_point = fork_point
        self.call_index = call_index
        self.task_id = task_id
        super().__init__(self._describe())

    def _describe(self) -> str:
        who = f" in task {self.task_id!r}" if self.task_id else ""
        recorded = "no further call" if self.recorded is None else str(self.recorded)
        requested = "no further call (it finished)" if self.requested is None else str(
            self.requested
        )
        return (
            f"non-determinism{who} at seq {self.seq}, external call #{self.call_index}: "
            f"the history recorded {recorded}, the code asked for {requested}; "
            f"fork at seq {self.fork_point} to continue with today's code"
        )
