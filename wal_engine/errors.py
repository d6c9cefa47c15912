"""The exception tree of wal-engine.

Every error the engine raises on purpose is a subclass of :class:`WalError`. Operating
errors (a lost lease, a conflicting append, bad input) carry the fields a caller needs to
react without parsing a message. Broken invariants (a corrupt chain, a row that cannot be
decoded) are :class:`CorruptionError` and are never swallowed.

The mapping from PostgreSQL SQLSTATE codes to these classes lives in exactly one place:
``wal_engine.store.sqlstate``.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Final

import msgspec

DEVELOPMENT_ENV: Final = "WAL_ENGINE_DEVELOPMENT"
"""Set to 1 to allow a development setup (a superuser, an owner of the log)."""


class WalError(Exception):
    """Root of every error wal-engine raises on purpose."""


class ConfigurationError(WalError):
    """The engine cannot start with the given configuration."""


class EmbeddedServerUnavailable(ConfigurationError):
    """No DSN was given and no embedded PostgreSQL server can be started."""


class InvalidDsn(ConfigurationError):
    """A connection URL that cannot be read without guessing; the message never holds it."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid DSN: {reason}")
        self.reason = reason


class DatabaseUnavailable(WalError):
    """The database cannot be reached (refused, timed out, shut down, failing over).

    The one error of the public API for an outage (its subclasses say more): the driver's
    or the socket's error is the ``__cause__``. ``may_have_applied`` says whether the
    operation may have taken effect: False when nothing reached the database or the
    statement was rolled back whole (a read, a refused connection, a timeout the server
    rolled back), True when a write was in flight when the answer was lost (send it again
    only if repeating it is harmless, or read back what it would have changed).
    Operations that are safe to repeat are retried inside the engine first
    (``connect(unavailable_retry_s=...)``), so a caller sees this only after that."""

    def __init__(self, dsn_redacted: str, reason: str, *,
                 may_have_applied: bool = False) -> None:
        super().__init__(f"database unreachable at {dsn_redacted}: {reason}")
        self.dsn_redacted = dsn_redacted
        self.reason = reason
        self.may_have_applied = may_have_applied


class ConnectionLost(DatabaseUnavailable):
    """A session was lost, refused or left unanswered (the driver's or the socket's error is
    the ``__cause__``). When ``sent``, a statement was in flight and may or may not have
    committed (an append resolves it by reading its events back, RELIABILITY.md R4); when
    not, the connection failed before anything was sent. ``may_have_applied`` is ``sent``
    unless the operation said otherwise (a read applies nothing)."""

    def __init__(self, dsn_redacted: str, reason: str, *, sent: bool = True,
                 may_have_applied: bool | None = None) -> None:
        super().__init__(dsn_redacted, reason,
                         may_have_applied=sent if may_have_applied is None else may_have_applied)
        self.sent = sent


class ReplicaUnavailable(DatabaseUnavailable):
    """The read replica named for an audit (``--replica``) cannot be reached."""

    def __init__(self, dsn_redacted: str, reason: str) -> None:
        WalError.__init__(self, f"replica unreachable at {dsn_redacted}: {reason}")
        self.dsn_redacted = dsn_redacted
        self.reason = reason


class NotAStandby(ConfigurationError):
    """The DSN given as a read replica is a primary (``pg_is_in_recovery()`` is false):
    reading from it would not spare the primary, and "how far behind" means nothing."""

    def __init__(self, dsn_redacted: str) -> None:
        super().__init__(f"{dsn_redacted} is not a standby (pg_is_in_recovery() is false): "
                         "--replica must name a streaming replica; to read the primary, "
                         "use --dsn")
        self.dsn_redacted = dsn_redacted


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


class InvalidSchedule(InvalidInput):
    """A schedule refused at the call that defined it (a cron expression, time zone,
    interval, catch-up policy or name the engine cannot use); nothing was written."""

    def __init__(self, schedule: object, field: str, reason: str) -> None:
        shown = repr(schedule)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid schedule {shown}: {field}: {reason}")
        self.schedule = schedule
        self.field = field
        """Which argument: ``name``, ``agent``, ``cron``, ``every_s``, ``tz``,
        ``catch_up``, ``catch_up_max`` or ``input``."""
        self.reason = reason


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


class UnknownQueue(InvalidInput):
    """A task was submitted to a queue that is neither ``default`` nor configured (``wal-engine
    queue set NAME`` or :meth:`~wal_engine.engine.Engine.set_queue`); nothing was written."""

    def __init__(self, queue: str) -> None:
        super().__init__(f"queue {queue!r} is not configured: create it first "
                         f"(wal-engine queue set {queue})")
        self.queue = queue


class DuplicateDedupId(WalError):
    """A live task of the queue already holds this deduplication id; the second submission
    wrote nothing. ``existing_task_id`` is that task (None if it ended meanwhile)."""

    def __init__(self, queue: str, dedup_id: str, existing_task_id: str | None) -> None:
        holder = "" if existing_task_id is None else f" (task {existing_task_id!r})"
        super().__init__(f"a live task of queue {queue!r} holds dedup id {dedup_id!r}{holder}")
        self.queue = queue
        self.dedup_id = dedup_id
        self.existing_task_id = existing_task_id
class TaskArchived(TaskAlreadyExists):
    """The task id is an archived task's (``wal-engine retention run``): its rows left the
    database, its tombstone keeps the id taken, so it is never created (nor run) again."""

    def __init__(self, task_id: str, status: str, retention_id: int) -> None:
        WalError.__init__(self, f"task {task_id!r} was archived ({status}, retention batch "
                                f"{retention_id}); its id cannot be used again")
        self.task_id = task_id
        self.status = status
        self.retention_id = retention_id


class RetentionRefused(WalError):
    """Retention did not remove a batch: a task is no longer as it was archived (it
    changed, or a child or parent of it runs). Nothing was removed; a new run re-selects."""

    def __init__(self, task_id: str | None, message: str) -> None:
        super().__init__(message)
        self.task_id = task_id


class UnknownSchedule(WalError):
    """No schedule of this name exists (in this engine's tenant)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown schedule {name!r}")
        self.name = name


class ScheduleExists(WalError):
    """A schedule of this name exists with another definition (pass ``replace=True`` to
    change it); nothing was written."""

    def __init__(self, name: str) -> None:
        super().__init__(f"schedule {name!r} already exists with another definition "
                         "(replace=True, or `schedule add --replace`, changes it)")
        self.name = name


class InvalidLimiter(InvalidInput):
    """A limiter refused at the call that defined or used it (a zero or negative limit, a
    period or name the engine cannot use, a bad token estimate); nothing was written."""

    def __init__(self, limiter: object, field: str, reason: str) -> None:
        shown = repr(limiter)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid limiter {shown}: {field}: {reason}")
        self.limiter = limiter
        self.field = field
        """Which argument: ``name``, ``requests_per_period``, ``tokens_per_period``,
        ``period_s``, ``tokens`` or ``estimate_tokens``."""
        self.reason = reason


class UnknownLimiter(WalError):
    """No limiter of this name exists (in this engine's tenant): define it with
    ``engine.limiter`` first. Raised at the call that named it, before its intent."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown limiter {name!r} (define it with engine.limiter)")
        self.name = name


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


class DuplicateRow(WalError):
    """A write refused by a unique index: another writer inserted the same key first
    (SQLSTATE 23505). The store's callers react to it (another writer took the seq, a racer
    committed the idempotency key); it is not a failure of the caller's input."""

    def __init__(self, constraint: str | None, detail: str) -> None:
        super().__init__(f"duplicate key ({constraint or 'unique index'}): {detail}")
        self.constraint = constraint


class DatabaseError(WalError):
    """PostgreSQL refused a statement for a reason wal-engine has no more specific error for
    (a missing privilege, a missing object, a setting the server refuses): the statement did
    nothing. ``sqlstate`` is PostgreSQL's code (``42501`` for a missing privilege), and the
    driver's error is the ``__cause__``."""

    def __init__(self, sqlstate: str, message: str) -> None:
        super().__init__(f"PostgreSQL refused the statement (SQLSTATE {sqlstate}): {message}")
        self.sqlstate = sqlstate


class WaitTimedOut(WalError, TimeoutError):
    """A wait (for a task to finish, for a claimed key to settle) ran out of time; nothing
    was changed. Also a ``TimeoutError``, which the same waits raised before."""

    def __init__(self, what: str, timeout_s: float | None) -> None:
        limit = "" if timeout_s is None else f" within {timeout_s} s"
        super().__init__(f"{what} did not happen{limit}")
        self.what = what
        self.timeout_s = timeout_s


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


class AmbiguousCommit(DatabaseUnavailable):
    """The commit of an append may or may not have happened, and reading back could not
    tell (the database stayed away): a :class:`DatabaseUnavailable` whose
    ``may_have_applied`` is True."""

    def __init__(self, task_id: str, first_seq: int) -> None:
        message = f"outcome of the append at seq {first_seq} of task {task_id!r} is unknown"
        WalError.__init__(self, message)
        self.dsn_redacted = "the database"
        self.reason = message
        self.may_have_applied = True
        self.task_id = task_id
        self.first_seq = first_seq


# ---------------------------------------------------------------------------------------
# Decoding and corruption: stored data that is not what the code can read.


class CorruptionError(WalError):
    """Stored data breaks an invariant; never swallowed."""


class BlobCorrupt(CorruptionError):
    """A large value an event refers to (``wal_blobs``) is missing, altered or malformed."""

    def __init__(self, task_id: str, seq: int | None, detail: str) -> None:
        where = "" if seq is None else f" at seq {seq}"
        super().__init__(f"task {task_id!r}{where}: {detail}")
        self.task_id = task_id
        self.seq = seq
        self.detail = detail


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


# ---------------------------------------------------------------------------------------
# What tool code raises to steer retries (not WalErrors: they are the tool's words, and
# the engine classifies them, wal_engine.retries.classify_failure).


class TransientError(Exception):
    """Raise from a tool to say: this attempt failed, another may succeed."""


class PermanentError(Exception):
    """Raise from a tool to say: the call failed for good, and nothing more will happen.

    The failure is recorded and agent code gets a ``ToolError``; the call is not in doubt,
    so raise it from a non-idempotent tool only when the effect did not and will not happen
    (a declined payment, a validation error answered by the service).
    """


class UnserializableValue(PermanentError):
    """A framework's value (a model response, a tool result) that cannot be reduced to the
    plain JSON the log stores: it cannot be journaled, and a retry would fail the same way,
    so the call fails for good (raised by :mod:`wal_engine.integrations.pydantic_ai`)."""


class DidNotAct(Exception):
    """Raise from a tool to say: this attempt did not act (nothing reached the service).

    The only failure after which a non-idempotent tool is tried again (under the same key,
    within its policy): every other failure of such a tool is in doubt and escalates.
    """


class RateLimited(DidNotAct):
    """Raise from an LLM function or a tool when the service refused the call for its rate
    limit (HTTP 429), with its ``Retry-After`` in seconds if it sent one. The attempt did
    not act and is retried; a call made under a limiter (``limiter=``) blocks that limiter
    for every worker of the tenant until the Retry-After has passed."""

    def __init__(self, retry_after_s: float | None = None, message: str = "") -> None:
        super().__init__(message or f"rate limited (retry after {retry_after_s} s)")
        self.retry_after_s = retry_after_s


class LeaseExpired(DidNotAct):
    """The worker can no longer trust its lease (by its own clock), so the attempt did not
    act: raised by :func:`wal_engine.runtime.context.ensure_lease` inside a tool, right before its
    irreversible part, and recorded by the engine when an attempt was due on such a lease.
    The call is then made by the task's next owner, under the same key."""


# ---------------------------------------------------------------------------------------
# Calls, effects and the side-effect gateway.


class CallTimedOut(TimeoutError):
    """An attempt ran past its ``timeout_s``. For a sync function its thread cannot be
    stopped and may still act: :meth:`still_running` says whether it does."""

    def __init__(self, timeout_s: float, thread: concurrent.futures.Future[Any] | None) -> None:
        super().__init__(f"the call did not return within {timeout_s} s")
        self.timeout_s = timeout_s
        self.thread = thread

    def still_running(self) -> bool:
        """Whether the timed-out call's thread is still running it."""
        return self.thread is not None and not self.thread.done()


class ToolError(WalError):
    """A tool or LLM call failed for good (its attempts are in the log)."""

    def __init__(self, call_id: str, error_type: str, error: str) -> None:
        super().__init__(f"call {call_id} failed: {error_type}: {error}")
        self.call_id = call_id
        self.error_type = error_type
        self.error = error


class ChildTaskFailed(WalError):
    """A child task (``ctx.spawn``) ended FAILED or was cancelled: raised by
    ``handle.result()`` in its parent, the same way live and on replay.

    Attributes:
        task_id: The child's id.
        reason: Why it failed (``task_failed``'s reason, or ``cancelled``).
        error: The child's error text, if any.
        cancelled: Whether it was cancelled rather than failed.
    """

    def __init__(self, task_id: str, reason: str, error: str | None, *,
                 cancelled: bool = False) -> None:
        what = "was cancelled" if cancelled else "failed"
        super().__init__(f"child task {task_id!r} {what}: {reason}"
                         + ("" if error is None else f": {error}"))
        self.task_id = task_id
        self.reason = reason
        self.error = error
        self.cancelled = cancelled


class UnknownAgent(InvalidInput):
    """``ctx.spawn`` named an agent this engine has not registered."""

    def __init__(self, agent: str) -> None:
        super().__init__(f"unknown agent {agent!r}: register it on the engine before spawning")
        self.agent = agent


class TaskCycle(InvalidInput):
    """A task would await itself or one of its ancestors: it would wait for ever."""

    def __init__(self, task_id: str, awaited: str) -> None:
        super().__init__(f"task {task_id!r} cannot await {awaited!r}: it is the task itself "
                         "or one of its ancestors")
        self.task_id = task_id
        self.awaited = awaited


class NotAChild(InvalidInput):
    """A task asked for a handle of a task that is not its own child."""

    def __init__(self, task_id: str, other: str) -> None:
        super().__init__(f"task {other!r} is not a child of {task_id!r}")
        self.task_id = task_id
        self.other = other


class SignalTimeout(WalError):
    """No signal arrived before the wait's timeout."""


class StaleEpoch(WalError):
    """A caller holding an older lease epoch than the key's holder tried to act."""

    def __init__(self, key: str, epoch: int, recorded_epoch: int) -> None:
        super().__init__(
            f"key {key!r}: epoch {epoch} is older than recorded epoch {recorded_epoch}"
        )
        self.key = key
        self.epoch = epoch
        self.recorded_epoch = recorded_epoch


class EffectFailed(WalError):
    """The first execution under this key failed permanently; the failure is the answer."""

    def __init__(self, key: str, error: str) -> None:
        super().__init__(f"effect under key {key!r} failed: {error}")
        self.key = key
        self.error = error


class InvalidKey(InvalidInput):
    """An idempotency key no store accepts (empty, too long, or holding a NUL)."""

    def __init__(self, key: object, reason: str) -> None:
        shown = repr(key)
        super().__init__(f"idempotency key {shown[:80]}: {reason}")
        self.reason = reason


class GatewayStoreUnavailable(WalError):
    """The gateway store (Redis) did not answer; nothing is known to have changed."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"gateway store {where} unavailable: {reason}")
        self.where = where
        self.reason = reason


class HttpToolError(WalError):
    """The API answered with an error status a retry will not change."""

    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        super().__init__(f"{method} {url} answered {status}: {body[:200]}")
        self.method = method
        self.url = url
        self.status = status
        self.body = body


class HttpToolRetry(TransientError):
    """The API answered that it did not act (409 in flight, 429, 503): retry the call."""


class MalformedKey(InvalidInput):
    """An ``Idempotency-Key`` header that is not one key of an acceptable size."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"Idempotency-Key {reason}")
        self.reason = reason


# ---------------------------------------------------------------------------------------
# Security: roles, tenants, secrets, sealed values, anchors.


class InsecureSetup(ConfigurationError):
    """The runtime's role could rewrite the log; it refuses to start (RELIABILITY.md S9)."""

    def __init__(self, role: str, problems: list[str]) -> None:
        super().__init__(
            f"refusing to run as role {role!r}: {'; '.join(problems)}. Connect as the "
            f"application role that `wal-engine setup --dsn ADMIN_DSN` makes (or "
            f"wal_engine.store.setup.apply_security; see docs/security.md), or, for a "
            f"development setup, pass --development on the command line (development=True "
            f"to connect()) or set {DEVELOPMENT_ENV}=1"
        )
        self.role = role
        self.problems = problems


class TenantExists(InvalidInput):
    """The tenant already has a role (rotate its password instead)."""

    def __init__(self, tenant: str, role: str) -> None:
        super().__init__(f"tenant {tenant!r} already has role {role!r}; "
                         "use `wal-engine tenant rotate` for a new password")
        self.tenant = tenant
        self.role = role


class UnknownTenant(InvalidInput):
    """No role is provisioned for the tenant in this database."""

    def __init__(self, tenant: str) -> None:
        super().__init__(f"tenant {tenant!r} has no role in this database "
                         "(`wal-engine tenant create`)")
        self.tenant = tenant


class SecretUnavailable(WalError):
    """A secret reference could not be resolved (no resolver, or the resolver failed)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"secret {name!r} is unavailable: {reason}")
        self.name = name
        self.reason = reason


class KeyShredded(WalError):
    """The tenant key an envelope was sealed with is gone: its content is unrecoverable."""

    def __init__(self, tenant: str, key_version: int) -> None:
        super().__init__(f"the key of tenant {tenant!r} (version {key_version}) was deleted")
        self.tenant = tenant
        self.key_version = key_version


class EnvelopeInvalid(WalError):
    """Not a sealed envelope, or one whose ciphertext does not authenticate."""


class AnchorInvalid(WalError):
    """The anchor file is unreadable, of another format, or its signature does not hold."""


# ---------------------------------------------------------------------------------------
# Non-determinism: today's code asks for other calls than the log recorded (raised by the
# pure replayer, replay.journal).


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


class ResultTypeError(ToolError):
    """A tool's result or an LLM's response does not convert to the ``result_type`` the
    call asked for (``ctx.tool(..., result_type=Charge)``). Live, the mismatch is recorded
    as the call's failure (``error_type`` ``ResultTypeError``, not retried); a re-run or a
    replay raises it again from the log, and raises it too if a recorded result does not
    convert to the type today's code asks for. A :class:`ToolError`, so ``except
    ToolError`` catches it like any failed call.

    Attributes:
        call_id: The call whose result did not convert.
        error_type: ``"ResultTypeError"`` (as in the recorded failure).
        error: What msgspec said was wrong.
    """

    def __init__(self, call_id: str, error: str) -> None:
        super().__init__(call_id, "ResultTypeError", error)
