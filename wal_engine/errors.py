"""The exception tree of wal-engine.

Every error the engine raises on purpose is a subclass of :class:`WalError`. Operating
errors (a lost lease, a conflicting append, bad input) carry the fields a caller needs to
react without parsing a message. Broken invariants (a corrupt chain, a row that cannot be
decoded) are :class:`CorruptionError` and are never swallowed.

The mapping from PostgreSQL SQLSTATE codes to these classes lives in exactly one place:
``wal_engine.store.sqlstate``.
"""

from __future__ import annotations


class WalError(Exception):
    """Root of every error wal-engine raises on purpose."""


class ConfigurationError(WalError):
    """The engine cannot start with the given configuration."""


class EmbeddedServerUnavailable(ConfigurationError):
    """No DSN was given and no embedded PostgreSQL server can be started."""


class DatabaseUnavailable(WalError):
    """The database cannot be reached (refused, timed out, or shut down)."""

    def __init__(self, dsn_redacted: str, reason: str) -> None:
        super().__init__(f"database unreachable at {dsn_redacted}: {reason}")
        self.dsn_redacted = dsn_redacted
        self.reason = reason


class SchemaMismatch(WalError):
    """The database has no wal-engine schema, or one of another version."""

    def __init__(self, found: int | None, expected: int) -> None:
        found_text = "no wal-engine schema" if found is None else f"schema version {found}"
        super().__init__(f"{found_text} found; this wal-engine needs schema version {expected}")
        self.found = found
        self.expected = expected


# ---------------------------------------------------------------------------------------
# Bad input: raised before anything is written, so the log is unchanged.


class InvalidInput(WalError):
    """Input rejected at the boundary; nothing was written."""


class InvalidTaskId(InvalidInput):
    """A task id that is empty, too long, or outside the allowed alphabet."""

    def __init__(self, task_id: object, reason: str) -> None:
        shown = repr(task_id)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid task id {shown}: {reason}")
        self.task_id = task_id
        self.reason = reason


class InvalidTenant(InvalidInput):
    """A tenant id that is empty, too long, or outside the allowed alphabet."""

    def __init__(self, tenant: object, reason: str) -> None:
        shown = repr(tenant)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid tenant {shown}: {reason}")
        self.tenant = tenant
        self.reason = reason


class CapExceeded(InvalidInput):
    """A write the database refused for one of its caps (payload bytes, events per task,
    signals per task or tenant, cancellation texts); nothing was written."""

    def __init__(self, cap: str, detail: str) -> None:
        super().__init__(f"{cap}: {detail}")
        self.cap = cap
        """Which cap: ``signals_per_task``, ``signals_per_tenant``, ``signal_payload_bytes``,
        ``cancel_text_bytes`` or ``event_bounds`` (seq, epoch or payload size of an event)."""


class InvalidPayload(InvalidInput):
    """A payload that cannot be stored: not plain JSON, NaN, NUL, surrogate, too big, too deep."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"invalid payload at {path}: {reason}")
        self.path = path
        self.reason = reason


class PayloadTooLarge(InvalidPayload):
    """An encoded payload over the configured size limit."""

    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        super().__init__("$", f"{size_bytes} bytes encoded, limit is {limit_bytes} bytes")
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes


# ---------------------------------------------------------------------------------------
# Operating errors of the log.


class UnknownTask(WalError):
    """No task with this id exists."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"unknown task {task_id!r}")
        self.task_id = task_id


class TaskAlreadyExists(WalError):
    """A task with this id exists with a different definition."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"task {task_id!r} already exists with a different agent or input")
        self.task_id = task_id


class TaskQuotaExceeded(WalError):
    """The tenant reached its cap on the number of tasks; the task was not created."""

    def __init__(self, tenant: str | None, tasks_max: int | None) -> None:
        cap = "its cap" if tasks_max is None else f"its cap of {tasks_max}"
        super().__init__(f"tenant {tenant or '?'!r} has reached {cap} tasks")
        self.tenant = tenant
        self.tasks_max = tasks_max


class LeaseLost(WalError):
    """The writer's lease epoch is no longer current: another worker owns the task (fenced)."""

    def __init__(self, task_id: str, epoch: int, current_epoch: int | None = None) -> None:
        detail = "" if current_epoch is None else f" (current epoch {current_epoch})"
        super().__init__(f"lease lost on task {task_id!r} at epoch {epoch}{detail}")
        self.task_id = task_id
        self.epoch = epoch
        self.current_epoch = current_epoch


class ReconcileRefused(InvalidInput):
    """A call cannot be reconciled: it is not escalated and waiting, or too early."""

    def __init__(self, task_id: str, call_id: str, why: str,
                 not_before_ms: int | None = None) -> None:
        super().__init__(f"call {call_id!r} of task {task_id!r} cannot be reconciled: {why}")
        self.task_id = task_id
        self.call_id = call_id
        self.not_before_ms = not_before_ms


class ConcurrencyConflict(WalError):
    """The append expected a head seq that is no longer the head (another append won)."""

    def __init__(self, task_id: str, expected_seq: int, actual_seq: int) -> None:
        super().__init__(
            f"concurrency conflict on task {task_id!r}: expected head seq {expected_seq}, "
            f"found {actual_seq}"
        )
        self.task_id = task_id
        self.expected_seq = expected_seq
        self.actual_seq = actual_seq


class IllegalTransition(WalError):
    """A status move that the task state machine does not allow."""

    def __init__(self, task_id: str | None, from_status: str, to_status: str) -> None:
        who = "" if task_id is None else f" on task {task_id!r}"
        super().__init__(f"illegal transition{who}: {from_status} -> {to_status}")
        self.task_id = task_id
        self.from_status = from_status
        self.to_status = to_status


class AppendOnlyViolation(WalError):
    """An UPDATE, DELETE or TRUNCATE on the append-only events table was refused."""


class AmbiguousCommit(WalError):
    """The commit of an append may or may not have happened, and reading back could not tell."""

    def __init__(self, task_id: str, first_seq: int) -> None:
        super().__init__(f"outcome of the append at seq {first_seq} of task {task_id!r} is unknown")
        self.task_id = task_id
        self.first_seq = first_seq


# ---------------------------------------------------------------------------------------
# Decoding and corruption: stored data that is not what the code can read.


class CorruptionError(WalError):
    """Stored data breaks an invariant; never swallowed."""


class UnknownEventType(CorruptionError):
    """A stored event of a type this code does not know."""

    def __init__(self, event_type: str, seq: int | None = None) -> None:
        where = "" if seq is None else f" at seq {seq}"
        super().__init__(f"unknown event type {event_type!r}{where}")
        self.event_type = event_type
        self.seq = seq


class UnknownEventVersion(CorruptionError):
    """A stored event whose schema version this code cannot read (no upcaster path)."""

    def __init__(
        self, event_type: str, version: int, supported: int, seq: int | None = None
    ) -> None:
        where = "" if seq is None else f" at seq {seq}"
        super().__init__(
            f"event {event_type!r} version {version}{where} cannot be read; "
            f"this code reads version {supported} and has no upcaster from {version}"
        )
        self.event_type = event_type
        self.version = version
        self.supported = supported
        self.seq = seq


class UndecodableEvent(CorruptionError):
    """A stored payload that does not decode into its event type."""

    def __init__(self, event_type: str, seq: int | None, reason: str) -> None:
        where = "" if seq is None else f" at seq {seq}"
        super().__init__(f"event {event_type!r}{where} does not decode: {reason}")
        self.event_type = event_type
        self.seq = seq
        self.reason = reason


# ---------------------------------------------------------------------------------------
# Replay, snapshots and forks.


class ReplayError(CorruptionError):
    """An event that is impossible in the state folded so far (the log breaks the rules)."""

    def __init__(self, seq: int, reason: str, task_id: str | None = None) -> None:
        who = "" if not task_id else f" of task {task_id!r}"
        super().__init__(f"replay failed at seq {seq}{who}: {reason}")
        self.seq = seq
        self.reason = reason
        self.task_id = task_id


class SnapshotCorrupt(CorruptionError):
    """A stored snapshot that does not decode or does not match the log it claims to fold."""

    def __init__(self, task_id: str | None, seq: int | None, reason: str) -> None:
        who = "" if task_id is None else f" of task {task_id!r}"
        where = "" if seq is None else f" at seq {seq}"
        super().__init__(f"snapshot{who}{where} is unusable: {reason}")
        self.task_id = task_id
        self.seq = seq
        self.reason = reason


class ForkPointInvalid(InvalidInput):
    """A fork requested at a seq that does not exist or ends the history (terminal event)."""

    def __init__(self, task_id: str, at_seq: int, reason: str) -> None:
        super().__init__(f"cannot fork task {task_id!r} at seq {at_seq}: {reason}")
        self.task_id = task_id
        self.at_seq = at_seq
        self.reason = reason


class TenantRoleRefused(ConfigurationError):
    """The role the engine logged in as cannot serve the tenant asked for: it is no
    tenant's role (row security would show it nothing), its tenant is disabled, or it is
    the role of another tenant (``docs/security.md``, tenant roles)."""

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(reason)
        self.role = role


class ResultTypeError(WalError):
    """A tool's result or an LLM's response does not convert to the ``result_type`` the
    call asked for (``ctx.tool(..., result_type=Charge)``). Live, the mismatch is recorded
    as the call's failure (``error_type`` ``ResultTypeError``, not retried); a re-run or a
    replay raises it again from the log, and raises it too if a recorded result does not
    convert to the type today's code asks for.

    Attributes:
        call_id: The call whose result did not convert.
        error_type: ``"ResultTypeError"`` (as in the recorded failure).
        error: What msgspec said was wrong.
    """

    def __init__(self, call_id: str, error: str) -> None:
        super().__init__(f"call {call_id} failed: ResultTypeError: {error}")
        self.call_id = call_id
        self.error_type = "ResultTypeError"
        self.error = error
