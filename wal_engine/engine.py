"""The object applications own: register agents, submit and steer tasks, run workers."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import math
import time
import typing
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypedDict, TypeVar

import asyncpg
import msgspec

from replay.state import CallStatus
from wal_engine import limits
from wal_engine.clock import SYSTEM_CLOCK, SYSTEM_RANDOM, Clock, RandomSource
from wal_engine.effects.gateway import IdempotencyGateway
from wal_engine.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    DuplicateRow,
    InvalidInput,
    ReconcileRefused,
    TaskAlreadyExists,
    WaitTimedOut,
    WalError,
)
from wal_engine.events import Budget, TaskCancelled, ToolCallUncertain
from wal_engine.ids import TaskId, new_task_id, validate_task_id, validate_text
from wal_engine.observability import metrics
from wal_engine.observability.logs import get_logger
from wal_engine.payloads import encode_payload
from wal_engine.retries import (
    EMIT_RETRY,
    READ_RETRY,
    UNAVAILABLE_RETRY_S_DEFAULT,
    api_policy,
    connect_wait_policy,
    retrying,
)
from wal_engine.runtime.control import INTERNAL_PREFIX as _INTERNAL_SIGNAL_PREFIX
from wal_engine.runtime.control import approval_signal, reconcile_signal
from wal_engine.runtime.hooks import NO_HOOKS, AgentHooks
from wal_engine.runtime.limiters import (
    LimiterInfo,
    TokenKind,
    define_limiter,
    delete_limiter,
    list_limiters,
    read_limiter,
)
from wal_engine.runtime.ports import RunServices
from wal_engine.runtime.registry import runnable_versions
from wal_engine.runtime.resume import SnapshotPolicy
from wal_engine.runtime.schedules import (
    ScheduleInfo,
    add_schedule,
    delete_schedule,
    encode_input,
    list_schedules,
    pause_schedule,
    read_schedule,
    resume_schedule,
)
from wal_engine.runtime.ticks import (
    CatchUp,
    catch_up_default,
    catch_up_max_default,
    validate_spec,
)
from wal_engine.runtime.worker import Worker, WorkerConfig
from wal_engine.security.redaction import (
    Redactor,
    SecretResolver,
    default_redactor,
    no_redaction,
    redact_bounded,
    redact_text,
)
from wal_engine.state_machine import TERMINAL
from wal_engine.store import Database, EventRecord, Store, TaskHead, queries
from wal_engine.store.connection import is_outage, is_unavailable
from wal_engine.store.group_commit import GroupCommitter
from wal_engine.store.queues import (
    DEFAULT_QUEUE,
    UNCHANGED,
    QueueChange,
    QueueSettings,
    QueueStats,
    Unchanged,
    placement,
    read_queue_changes,
    read_queues,
    set_queue,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from replay.state import AgentState
    from wal_engine.runtime.context import AgentContext

log = get_logger(__name__)

AgentFunction = Callable[["AgentContext", Any], Awaitable[Any]]
F = TypeVar("F", bound=AgentFunction)
"""An agent function: ``@engine.agent`` hands it back with its own type unchanged."""
ConfigT = TypeVar("ConfigT", bound=msgspec.Struct)
T = TypeVar("T")

wait_poll_s_default: Final = 0.05
recovery_attempts_max_default: Final = 20
"""Claims of one task before it is failed as dead-lettered, when its budget sets no
``max_attempts`` (RELIABILITY.md R11): a task that crashes every worker stops."""

DEFAULT_SNAPSHOT_POLICY: Final = SnapshotPolicy(on_checkpoint=True, min_events=1000,
                                                every_events=2000, spacing_fraction=0.0)
"""Snapshot at the first checkpoint 1,000 events after the last snapshot (at any status after
2,000): a resume folds at most a few thousand events, and since a segmented snapshot writes
only what was added since the previous one (plus one tail of under 128 items per growing
collection), snapshots cost a constant per event however long the history."""


def wake_token(tenant: str) -> str:
    """The NOTIFY payload of ``tenant``'s wake-ups: the same value as ``wal_wake_token()``
    in ``schema.sql`` (an opaque token, never a task id)."""
    return hashlib.sha256(f"wal-engine/wake/{tenant}".encode()).hexdigest()[:32]


DEFAULT_AGENT_VERSION: Final = "1"
"""The version of an agent registered without one."""
agent_version_length_max: Final = 64
code_version_hex_digits: Final = 16
"""Length of :func:`code_version`'s digest (64 bits: a collision between two versions of one
agent is not a practical concern)."""


def code_version(*sources: object, salt: str = "") -> str:
    """A version label derived from the source text of ``sources``: it changes exactly when
    that text (or ``salt``) changes, so tasks started by other code are never claimed by
    this code unless it declares their version ``compatible``.

    ``sources`` are what the user chooses to pin: functions, classes, methods or whole
    modules (``inspect.getsource``; decorated functions are unwrapped), in order. Line
    endings are normalised, so a checkout on another platform gives the same version;
    anything else (a comment, whitespace) is a change. Code they call but that is not
    listed (a helper module, a library) is not hashed: list it, or bump ``salt``.

    ``@engine.agent("x", version=code_version(...))`` is evaluated before the decorated
    function exists: hash its module (``sys.modules[__name__]``) or the tools it calls
    there, or register afterwards with ``engine.register("x", fn, version=code_version(fn,
    tools))``.

    Returns:
        ``16`` lowercase hex digits (a valid agent version).

    Raises:
        InvalidInput: No source given, ``salt`` is not a string, or the source text of an
            object cannot be read (a builtin, an instance, code typed at a REPL).
    """
    if not sources:
        raise InvalidInput("code_version needs at least one function, class or module")
    if not isinstance(salt, str):
        raise InvalidInput(f"code_version's salt must be a string, not {type(salt).__name__}")
    digest = hashlib.sha256(b"wal-engine/code-version/1\0")
    digest.update(_length_prefixed(salt))
    for source in sources:
        try:
            text = inspect.getsource(source)  # type: ignore[arg-type]
        except (OSError, TypeError) as error:
            raise InvalidInput(f"code_version cannot read the source of {source!r}: "
                               f"{error}") from None
        digest.update(_length_prefixed(text.replace("\r\n", "\n").replace("\r", "\n")))
    return digest.hexdigest()[:code_version_hex_digits]


def _length_prefixed(text: str) -> bytes:
    """``text`` as UTF-8 behind its length, so no two lists of texts hash alike."""
    data = text.encode("utf-8", "surrogatepass")
    return len(data).to_bytes(8, "big") + data


class AgentDefinition(msgspec.Struct, frozen=True, kw_only=True):
    """A registered agent: its name, its function, the type its input must have, the version
    of its code and the older versions whose tasks it can continue, and its hooks."""

    name: str
    function: Any
    input_type: Any = None
    version: str = DEFAULT_AGENT_VERSION
    compatible: tuple[str, ...] = ()
    hooks: AgentHooks = NO_HOOKS

    @property
    def runs(self) -> tuple[str, ...]:
        """The versions whose tasks this code may run: its own first."""
        return (self.version, *(v for v in self.compatible if v != self.version))


class Engine:
    """Connects agents to the log. Create with :func:`connect`."""

    def __init__(self, database: Database, *, payload_bytes_max: int,
                 snapshot_policy: SnapshotPolicy | None = None,
                 recovery_attempts_max: int = recovery_attempts_max_default,
                 redactor: Redactor | None = default_redactor,
                 secrets: SecretResolver | None = None,
                 events_per_task_max: int = limits.history_events_max,
                 llm_spend_max_usd: float | None = None,
                 unavailable_retry_s: float = UNAVAILABLE_RETRY_S_DEFAULT) -> None:
        self.database = database
        self.unavailable_retry_s = unavailable_retry_s
        """How long a call of this API that is safe to repeat is retried while the
        database is away (:class:`EngineConfig`)."""
        self.llm_spend_max_usd = llm_spend_max_usd
        """This engine's cap on its tenant's LLM spend (USD) across tasks (None: none)."""
        self.tenant = database.tenant
        """The one tenant this engine serves: every connection is bound to it."""
        self.wake_token = wake_token(self.tenant)
        self.recovery_attempts_max = recovery_attempts_max
        self.snapshot_policy = snapshot_policy or DEFAULT_SNAPSHOT_POLICY
        self.redactor: Redactor = no_redaction if redactor is None else redactor
        """Applied to every value from outside before it is hashed and written."""
        self.secrets = secrets
        """Resolves secret references (``redaction.secret_ref``) at call time."""
        self.store = Store(database, payload_bytes_max=payload_bytes_max,
                           redactor=self.redactor, events_per_task_max=events_per_task_max)
        self.committer = GroupCommitter(self.store)
        self.gateway = IdempotencyGateway(database, redactor=self.redactor)
        self.agents: dict[str, AgentDefinition] = {}
        self.clock: Clock = SYSTEM_CLOCK
        """The clock of the runs of workers built from now on (``ctx.now()``, retry due
        times and in-memory backoff, runtime budgets): a test may put a
        :class:`wal_engine.testing.ManualClock` here before :meth:`worker`. Leases and
        durable timers are timed by the database's clock, never by this one."""
        self.random: RandomSource = SYSTEM_RANDOM
        """The source of ``ctx.random()`` for runs of workers built from now on."""

    # ------------------------------------------------------------------ agents

    def agent(self, name: str, *, input_type: Any = None,
              version: str = DEFAULT_AGENT_VERSION, compatible: tuple[str, ...] = (),
              hooks: AgentHooks | None = None) -> Callable[[F], F]:
        """Register ``async def agent(ctx, input)`` under ``name``; the function is returned
        unchanged (its type too).

        Args:
            name: The agent's stable name, stored with every task.
            input_type: A msgspec Struct (or any type msgspec can convert to); submissions
                are validated against it before anything is written. Not given, it is the
                annotation of the function's input parameter (none, ``Any`` or ``object``:
                any JSON value, as before). When that parameter is annotated, the function
                receives the stored input converted to its annotation (a Struct, a
                dataclass, a TypedDict's dict), not the plain JSON value.
            version: The version of this code. A task records the version that started it,
                and a worker claims only tasks of the versions it can run: during a rolling
                deploy old workers drain old tasks while new ones start on the new code.
            compatible: Older versions whose tasks this code continues correctly (their
                changes are behind ``ctx.patched``); ``wal-engine replay --all`` checks it.
            hooks: Recovery hooks (:class:`~wal_engine.runtime.hooks.AgentHooks`).
        """
        _check_agent_labels(name, version, compatible)

        def register(function: F) -> F:
            annotation = _input_annotation(name, function, explicit=input_type is not None)
            self.agents[name] = AgentDefinition(
                name=name, function=_typed_entry(function, annotation),
                input_type=annotation if input_type is None else input_type,
                version=version, compatible=tuple(compatible), hooks=hooks or NO_HOOKS)
            return function

        return register

    def register(self, name: str, function: AgentFunction, *, input_type: Any = None,
                 version: str = DEFAULT_AGENT_VERSION, compatible: tuple[str, ...] = (),
                 hooks: AgentHooks | None = None) -> None:
        """Register an agent without the decorator."""
        self.agent(name, input_type=input_type, version=version, compatible=compatible,
                   hooks=hooks)(function)

    def runnable_versions(self) -> tuple[list[str], list[str]]:
        """``(agents, versions)``: every agent and version this engine's code can run, as
        the claim statement takes them (each agent's own version first)."""
        return runnable_versions(self.agents)

    # ------------------------------------------------------------------ tasks

    async def submit(
        self,
        agent: str,
        input: Any = None,
        *,
        budget: Budget | None = None,
        task_id: str | None = None,
        queue: str = DEFAULT_QUEUE,
        priority: int = 0,
        partition_key: str | None = None,
        dedup_id: str | None = None,
    ) -> TaskId:
        """Queue a task; idempotent on a caller-given ``task_id``.

        The input is validated against the agent's declared input type and must be plain
        JSON once converted; a bad input raises :class:`InvalidInput` and never reaches the log.
        Through a database outage the submission is made again (it is idempotent on the
        task id, chosen before the first attempt) for up to ``unavailable_retry_s``, then
        raises :class:`~wal_engine.errors.DatabaseUnavailable`.

        Args:
            queue: The queue it waits in: ``default`` or one made by :meth:`set_queue`
                (else :class:`~wal_engine.errors.UnknownQueue`); its limits hold its claim.
            priority: Higher is claimed first; equal priorities oldest first.
            partition_key: Tasks of one key in one queue run one at a time, in submission
                order (one customer's tasks, say).
            dedup_id: Refused (:class:`~wal_engine.errors.DuplicateDedupId`) while a live
                task of the queue holds the same id.
        """
        where = placement(queue, priority, partition_key, dedup_id)
        definition = self.agents.get(agent)
        plain_input = self._plain_input(agent, input)
        chosen = new_task_id() if task_id is None else validate_task_id(task_id)
        # Idempotent on the task id, chosen before the first attempt: safe to repeat.
        await self._riding("submit", lambda: self.store.create_task(
            chosen, agent, input=plain_input, budget=budget,
            agent_version=None if definition is None else definition.version,
            placement=where), repeat_safe=True, key=chosen)
        return chosen

    def _plain_input(self, agent: str, input: Any) -> Any:
        """``input`` checked against ``agent``'s input type when this engine registered it,
        as plain JSON values (:class:`InvalidInput` otherwise)."""
        definition = self.agents.get(agent)
        if definition is None or definition.input_type is None:
            return input
        try:
            typed = msgspec.convert(input, definition.input_type)
        except msgspec.ValidationError as error:
            raise InvalidInput(f"input for agent {agent!r} is invalid: {error}") from error
        return msgspec.to_builtins(typed)

    # ------------------------------------------------------------------ queues

    async def set_queue(self, queue: str, *,
                        concurrency_max: int | Unchanged | None = UNCHANGED,
                        worker_concurrency_max: int | Unchanged | None = UNCHANGED,
                        requested_by: str | None = None) -> QueueSettings:
        """Create ``queue`` or change its limits at run time (the next claims apply them).

        ``concurrency_max`` bounds the queue's running tasks across every worker and host,
        ``worker_concurrency_max`` those of one worker; an int (at least 1) sets a limit,
        None removes it, and a limit not given is left as it is. Every change is audited
        (:meth:`queue_changes`): the database role, ``requested_by``, the limits before and
        after. Bad input raises :class:`InvalidInput` and changes nothing. Made again
        through a database outage: setting the same limits twice changes (and audits)
        nothing the second time.
        """
        return await self._riding("set_queue", lambda: set_queue(
            self.database, queue, concurrency_max=concurrency_max,
            worker_concurrency_max=worker_concurrency_max, requested_by=requested_by),
            repeat_safe=True, key=str(queue))

    async def queues(self) -> list[QueueStats]:
        """Every queue that is configured or holds live tasks: depth, running, waiting,
        limits and the oldest claimable task's wait (also into the queue metrics)."""
        stats = await self._reading("queues", lambda: read_queues(self.database))
        metrics.queues_read(self.database.tenant, stats)
        return stats

    async def queue_changes(self, queue: str | None = None, *,
                            limit: int = 100) -> list[QueueChange]:
        """The audited changes of ``queue``'s limits (every queue's when None), newest first."""
        return await self._reading("queue_changes", lambda: read_queue_changes(
            self.database, queue, limit=limit))

    async def signal(self, task_id: str, name: str, payload: Any = None, *,
                     dedup_key: str | None = None) -> int:
        """Put a signal in a task's inbox; a task waiting for it becomes RESUMING at once.

        Signals sent before the task waits are kept and delivered when it does. With
        ``dedup_key``, a repeated delivery (a webhook sent twice) is stored once.

        Names starting with ``~`` are the engine's own (approvals and reconciliations) and
        raise :class:`~wal_engine.errors.InvalidInput`: use :meth:`approve` and
        :meth:`reconcile`, which check what a raw signal would skip.

        Through an outage a signal with a ``dedup_key`` is sent again until it lands (up to
        ``unavailable_retry_s``); one without is sent again only when nothing reached the
        database, else :class:`~wal_engine.errors.DatabaseUnavailable` says
        ``may_have_applied``.
        """
        if isinstance(name, str) and name.startswith(_INTERNAL_SIGNAL_PREFIX):
            raise InvalidInput(f"signal names starting with {_INTERNAL_SIGNAL_PREFIX!r} are "
                               "reserved: use engine.approve or engine.reconcile")
        return await self._signal(task_id, name, payload, dedup_key)

    async def _signal(self, task_id: str, name: str, payload: Any,
                      dedup_key: str | None = None) -> int:
        """Send a signal, reserved names included (the checks of :meth:`signal`)."""
        validate_task_id(task_id)
        validate_text(name, "a signal name", bytes_max=4 * limits.name_length_max,
                      chars_max=limits.name_length_max, empty_ok=False)
        if dedup_key is not None:
            validate_text(dedup_key, "a dedup key", bytes_max=limits.dedup_key_bytes_max,
                          empty_ok=False)
        encoded = self._encode_signal(payload)
        name = redact_text(self.redactor, name)
        dedup_key = None if dedup_key is None else redact_text(self.redactor, dedup_key)
        row = await self._riding(
            "signal", lambda: self._emitting(queries.SEND_SIGNAL, task_id, name, encoded,
                                             dedup_key),
            repeat_safe=dedup_key is not None, key=task_id)
        return int(row["signal_id"])

    def _encode_signal(self, payload: Any) -> bytes:
        """A signal's payload as stored (redacted, bounded, encoded)."""
        return encode_payload(redact_bounded(self.redactor, payload,
                                             limits.signal_payload_bytes_max),
                              payload_bytes_max=limits.signal_payload_bytes_max)

    async def approve(self, task_id: str, call_id: str, *, approver: str, approved: bool = True,
                      args_hash: str | None = None, comment: str | None = None) -> int:
        """Answer a pending approval request; an audited record, not a bare boolean.

        ``args_hash`` defaults to the hash of the call awaiting approval (as recorded in the
        request); passing another hash (approving a different call) is rejected by the task.
        """
        if args_hash is None:
            request = (await self.state(task_id)).approvals.get(call_id)
            if request is None:
                raise InvalidInput(f"task {task_id!r} has no approval request for {call_id!r}")
            args_hash = request.args_hash
        payload = {"approved": approved, "approver": approver, "args_hash": args_hash,
                   "comment": comment}
        return await self._signal(task_id, approval_signal(call_id), payload)

    async def reconcile(self, task_id: str, call_id: str, *, result: Any = None,
                        error: str | None = None, force: bool = False) -> int:
        """Tell a task what an escalated (uncertain) call really did: its result or error.

        Refused (:class:`~wal_engine.errors.ReconcileRefused`) unless the call is escalated
        and its task waits for the answer, and, without ``force``, before the call's
        ``not_before_ms``: until then the worker that made the attempt (a stopped process
        continued) may still act, and a human doing the effect by hand would make it twice
        (a timed-out sync call is escalated only once its thread has ended). Pass
        ``force=True`` once you know that worker is gone (you stopped its process or its
        host).
        """
        await self._reading("reconcile", lambda: self._reconcilable(task_id, call_id, force),
                            key=task_id)
        payload = {"error": error} if error is not None else {"result": result}
        name = reconcile_signal(call_id)
        # One answer per call (the dedup key): a second reconciliation sent before the
        # task took the first used to be accepted too, and silently never read.
        signal_id = await self._signal(task_id, name, payload, dedup_key=name)
        rows = await self._reading("reconcile", lambda: self.database.fetch(
            queries.READ_SIGNALS, task_id, name, [], 1, task_id=task_id), key=task_id)
        if rows and bytes(rows[0]["payload"]) != self._encode_signal(payload):
            raise ReconcileRefused(task_id, call_id, f"another answer (signal "
                                   f"{rows[0]['signal_id']}) was recorded for it first")
        return signal_id

    async def _reconcilable(self, task_id: str, call_id: str, force: bool) -> None:
        """Raise ReconcileRefused unless ``call_id`` may be reconciled now."""
        state = await self._state(task_id)
        record = state.calls.get(call_id)
        if record is None or record.status is not CallStatus.UNCERTAIN:
            raise ReconcileRefused(task_id, call_id, "it is not an escalated (uncertain) call")
        if state.status in TERMINAL:
            raise ReconcileRefused(task_id, call_id, f"the task is {state.status.value}")
        if force or record.outcome_seq is None:
            return
        rows = await self.store.read_events(task_id, from_seq=record.outcome_seq,
                                            to_seq=record.outcome_seq, limit=1)
        event = rows[0].decode() if rows else None
        not_before = event.not_before_ms if isinstance(event, ToolCallUncertain) else None
        if not_before is None:
            return
        row = await self.database.fetchrow(queries.DATABASE_NOW_MS, task_id=task_id)
        now = int(row["now_ms"])
        if now < not_before:
            raise ReconcileRefused(
                task_id, call_id, f"the attempt may still act for {(not_before - now) / 1000:.1f}"
                " s more (its worker's grace period); pass force=True if that worker is gone",
                not_before_ms=not_before)

    async def cancel(self, task_id: str, *, reason: str = "cancelled",
                     requested_by: str | None = None) -> bool:
        """Cancel a task: it becomes FAILED and its current worker is fenced.

        Returns False if the task had already finished. Made again through a database
        outage; when an attempt's answer was lost, a "finished already" is read back from
        the task's last event (True when it is this cancellation).
        """
        validate_task_id(task_id)
        validate_text(reason, "a cancellation reason", bytes_max=limits.cancel_text_bytes_max)
        if requested_by is not None:
            validate_text(requested_by, "a cancellation requester",
                          bytes_max=limits.cancel_text_bytes_max)
        reason = redact_text(self.redactor, reason)
        if requested_by is not None:
            requested_by = redact_text(self.redactor, requested_by)
        in_doubt = False

        def note(error: BaseException) -> None:
            nonlocal in_doubt
            in_doubt = in_doubt or _may_have_applied(error)

        # Safe to repeat (a cancelled task stays cancelled); after an attempt in doubt, a
        # "no" is read back: the task's last event is the cancellation this call sent.
        row = await self._riding(
            "cancel", lambda: self._emitting(queries.CANCEL_TASK, task_id, reason,
                                             requested_by),
            repeat_safe=True, key=task_id, on_outage=note)
        if row["cancelled"] or not in_doubt:
            return bool(row["cancelled"])
        return await self._reading("cancel", lambda: self._cancelled_by(
            task_id, reason, requested_by), key=task_id)

    async def _cancelled_by(self, task_id: str, reason: str, requested_by: str | None
                            ) -> bool:
        """Whether ``task_id`` ended with a cancellation saying ``reason`` and
        ``requested_by`` (a cancel whose answer was lost, read back)."""
        rows = await self.store.read_events(task_id, from_seq=(await self.store.read_head(
            task_id)).head_seq, limit=1)
        event = rows[0].decode() if rows else None
        return (isinstance(event, TaskCancelled) and event.reason == reason
                and event.requested_by == requested_by)

    async def _emitting(self, statement: str, task_id: str, *args: Any) -> Any:
        """Run a statement that appends an event of the database's own (wal_emit).

        Its event takes the next seq; if the task's owner appended that very seq at the same
        moment, the primary key refuses ours and the statement is simply run again.
        """
        return await retrying(
            EMIT_RETRY,
            lambda: self.database.fetchrow(statement, task_id, *args, task_id=task_id),
            retry_if=_lost_seq_race, key=task_id)

    async def fork(self, task_id: str, at_seq: int) -> TaskId:
        """A new task continuing a prefix of ``task_id``'s history up to ``at_seq``."""
        from wal_engine.runtime.resume import fork

        child = new_task_id()  # Chosen once: an attempt in doubt is read back by its id.
        in_doubt = False

        async def attempt() -> str:
            nonlocal in_doubt
            try:
                return await fork(self.store, task_id, at_seq, child_task_id=child)
            except TaskAlreadyExists:
                if in_doubt:  # Nobody else chose this random id: our attempt landed.
                    return child
                raise
            except WalError as error:
                in_doubt = in_doubt or _may_have_applied(error)
                raise

        return TaskId(await self._riding("fork", attempt, repeat_safe=True, key=task_id))

    async def state(self, task_id: str) -> AgentState:
        """The task's folded state (latest snapshot plus the tail of the log)."""
        return await self._reading("state", lambda: self._state(task_id), key=task_id)

    async def _state(self, task_id: str) -> AgentState:
        from wal_engine.runtime.resume import resume

        return await resume(self.store, task_id)

    async def head(self, task_id: str) -> TaskHead:
        """The task's head row (status, seq, lease)."""
        return await self._reading("head", lambda: self.store.read_head(task_id), key=task_id)

    async def history(self, task_id: str) -> list[EventRecord]:
        """Every event of the task, in seq order."""
        return await self._reading("history", lambda: self.store.history(task_id),
                                   key=task_id)

    # ------------------------------------------------------------------ outages

    async def _reading(self, operation: str, call: Callable[[], Awaitable[T]], *,
                       key: str = "") -> T:
        """A read through an outage: made again until ``unavailable_retry_s``."""
        return await self._riding(operation, call, repeat_safe=True, writes=False, key=key)

    async def _riding(self, operation: str, call: Callable[[], Awaitable[T]], *,
                      repeat_safe: bool, writes: bool = True, key: str = "",
                      on_outage: Callable[[BaseException], None] | None = None) -> T:
        """Run ``call`` (one operation of the public API) through a database outage.

        While the database is away (:func:`~wal_engine.store.connection.is_outage`), the
        call is made again after a bounded, jittered backoff until ``unavailable_retry_s``
        has passed, when it is ``repeat_safe`` or when nothing of the failed attempt
        reached the database. Then, or at once for a write that may have applied and is
        not safe to repeat, it raises :class:`~wal_engine.errors.DatabaseUnavailable` (or
        its subclass), whose ``may_have_applied`` says whether any attempt of a write may
        have taken effect (never for a read). No driver or socket error escapes.
        """
        applied = False
        retries = 0
        started = time.monotonic()

        def retry_if(error: BaseException) -> bool:
            nonlocal applied
            if not is_outage(error):
                return False
            if on_outage is not None:
                on_outage(error)
            in_doubt = writes and _may_have_applied(error)
            applied = applied or in_doubt
            return repeat_safe or not in_doubt

        def retried(error: BaseException, attempt: int, delay_s: float) -> None:
            nonlocal retries
            retries = attempt
            log.warning("database_unavailable_retrying", operation=operation,
                        error=_error_text(error), attempt=attempt, delay_s=round(delay_s, 3))

        try:
            result = await retrying(api_policy(self.unavailable_retry_s),
                                    lambda: self._typed(call, key), retry_if=retry_if,
                                    key=f"{key}:{uuid.uuid4().hex[:8]}", on_retry=retried)
        except DatabaseUnavailable as error:
            error.may_have_applied = writes and (applied or _may_have_applied(error))
            log.warning("database_unavailable", operation=operation,
                        error=_error_text(error), may_have_applied=error.may_have_applied,
                        waited_s=round(time.monotonic() - started, 3))
            raise
        if retries:
            log.info("database_outage_ridden", operation=operation, attempts=retries + 1,
                     waited_s=round(time.monotonic() - started, 3))
        return result

    async def _typed(self, call: Callable[[], Awaitable[T]], key: str) -> T:
        """``call``, with any driver or socket error that escaped the store's translation
        made the engine's own (the public API raises only WalErrors)."""
        try:
            return await call()
        except WalError:
            raise
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as error:
            translated = self.database.translate(error, key or None)
            if isinstance(translated, WalError):
                raise translated from error
            raise DatabaseUnavailable(self.database.dsn_redacted, _error_text(error),
                                      may_have_applied=True) from error

    async def wait(self, task_id: str, *, timeout_s: float | None = None,
                   poll_s: float = wait_poll_s_default) -> AgentState:
        """Wait until the task is COMPLETED or FAILED; return its final state. A poll
        that loses its connection is simply made again (it is a read) until the timeout."""
        async def finished() -> None:
            while (await retrying(READ_RETRY, lambda: self.store.read_head(task_id),
                                  retry_if=is_unavailable, key=task_id)
                   ).status not in TERMINAL:
                await asyncio.sleep(poll_s)

        try:
            await asyncio.wait_for(finished(), timeout_s)
        except TimeoutError as error:
            raise WaitTimedOut(f"task {task_id!r} to finish", timeout_s) from error
        return await self.state(task_id)

    # ------------------------------------------------------------------ schedules

    async def schedule(self, name: str, agent: str, *, cron: str | None = None,
                       every_s: int | None = None, input: Any = None, tz: str | None = None,
                       catch_up: CatchUp = catch_up_default,
                       catch_up_max: int = catch_up_max_default,
                       replace: bool = False) -> ScheduleInfo:
        """Submit a task for ``agent`` at every tick of a schedule, exactly once per tick
        however many workers run (their loops fire the ticks; ``docs/schedules.md``).

        Args:
            name: The schedule's name: 1..100 letters, digits, ``_ . -``. Each tick's task
                id is ``sched:<name>:<tick in UTC, e.g. 20250301T020000Z>``.
            agent: The agent each task runs. When this engine registered it, ``input`` is
                checked against its input type now.
            cron: A cron expression (five fields, or six with leading seconds; or
                ``@daily`` and the like) read in ``tz``. Give exactly one of ``cron`` and
                ``every_s``.
            every_s: Tick every this many seconds (1 s to 366 days), at the whole multiples
                of it since 1970-01-01 UTC.
            input: Each task's input (plain JSON; redacted and stored once, here).
            tz: An IANA time zone for ``cron`` (default UTC). DST follows Debian cron: a
                fixed time the spring-forward skips runs at the first minute after the gap,
                one the fall-back repeats runs once.
            catch_up: Ticks that came while no worker ran: ``"skip"`` fires none of them
                (only on-time ticks), ``"one"`` one task for the latest, ``"all"`` one per
                tick, the latest ``catch_up_max`` of them (a warning names what was
                dropped).
            catch_up_max: 1..1,000.
            replace: Rewrite an existing schedule of this name with another definition
                (otherwise :class:`~wal_engine.errors.ScheduleExists`); the same
                definition again is always a no-op.

        Raises:
            InvalidSchedule: A bad name, agent, cron expression, time zone, interval or
                catch-up option; nothing is written.
            InvalidInput: The input does not fit the agent's type or cannot be stored.
        """
        spec = validate_spec(name, agent, cron=cron, every_s=every_s, tz=tz,
                             catch_up=catch_up, catch_up_max=catch_up_max)
        stored = encode_input(spec, self._plain_input(agent, input), redactor=self.redactor,
                              payload_bytes_max=self.store.payload_bytes_max)
        return await add_schedule(self.database, spec, stored, replace=replace)

    async def schedules(self) -> list[ScheduleInfo]:
        """This tenant's schedules, by name (at most 10,000)."""
        return await list_schedules(self.database)

    async def schedule_info(self, name: str) -> ScheduleInfo:
        """One schedule (:class:`~wal_engine.errors.UnknownSchedule` if there is none)."""
        return await read_schedule(self.database, name)

    async def pause_schedule(self, name: str) -> ScheduleInfo:
        """Stop firing a schedule until :meth:`resume_schedule` (idempotent)."""
        return await pause_schedule(self.database, name)

    async def resume_schedule(self, name: str) -> ScheduleInfo:
        """Fire a paused schedule again from its next tick after now (the ticks of the
        pause are never fired); a schedule that is not paused is left as it is."""
        return await resume_schedule(self.database, name)

    async def delete_schedule(self, name: str) -> None:
        """Delete a schedule (its tasks stay); :class:`~wal_engine.errors.UnknownSchedule`
        if there is none."""
        await delete_schedule(self.database, name)

    # ------------------------------------------------------------------ limiters

    async def limiter(self, name: str, *, requests_per_period: int | None = None,
                      tokens_per_period: int | None = None, period_s: float = 60.0,
                      tokens: TokenKind = "both") -> LimiterInfo:
        """Define (or change) a rate limiter shared by every worker of this tenant, for
        ``ctx.llm(..., limiter=name)`` and ``ctx.tool(..., limiter=name)``: at most
        ``requests_per_period`` calls and ``tokens_per_period`` tokens in any sliding window
        of ``period_s`` seconds (``docs/limiters.md``).

        Args:
            name: 1..100 letters, digits, ``_ . : / -`` (``openai:gpt-4o``).
            requests_per_period: Calls per period (None: not limited by count).
            tokens_per_period: Tokens per period (None: not limited by tokens).
            period_s: The window, in seconds (0 < period_s <= 86400).
            tokens: Which recorded tokens count: ``input``, ``output`` or ``both``.

        Returns:
            The limiter and its state.

        Raises:
            InvalidLimiter: a zero, negative or missing limit, a bad period, kind or name;
                nothing was written.
        """
        return await define_limiter(self.database, name, requests_per_period=requests_per_period,
                                    tokens_per_period=tokens_per_period, period_s=period_s,
                                    tokens=tokens)

    async def limiters(self) -> list[LimiterInfo]:
        """This tenant's limiters and what their windows hold now, by name."""
        return await list_limiters(self.database)

    async def limiter_info(self, name: str) -> LimiterInfo:
        """One limiter and its state (:class:`~wal_engine.errors.UnknownLimiter` if none)."""
        return await read_limiter(self.database, name)

    async def delete_limiter(self, name: str) -> None:
        """Delete a limiter and its grants; calls naming it then fail with
        :class:`~wal_engine.errors.UnknownLimiter`."""
        await delete_limiter(self.database, name)

    # ------------------------------------------------------------------ workers

    def worker(self, config: WorkerConfig | None = None, *, worker_id: str | None = None,
               **options: Unpack[WorkerOptions]) -> Worker:
        """A worker for this engine's agents, configured by ``config`` or, as a shortcut, by
        keyword arguments naming :class:`~wal_engine.runtime.worker.WorkerConfig` fields
        (not both: :class:`~wal_engine.errors.ConfigurationError`)."""
        if not self.agents:
            raise ConfigurationError("register at least one agent before starting a worker")
        return Worker(self.run_services(), self.agents, _worker_config(config, options),
                      worker_id)

    def run_services(self) -> RunServices:
        """What the runs of a worker use of this engine (its store, group commit, gateway,
        redactor, secrets, snapshot policy, caps, clock and random source), as of now."""
        return RunServices(
            database=self.database, store=self.store, committer=self.committer,
            gateway=self.gateway, redactor=self.redactor, secrets=self.secrets,
            snapshot_policy=self.snapshot_policy,
            recovery_attempts_max=self.recovery_attempts_max,
            llm_spend_max_usd=self.llm_spend_max_usd, wake_token=self.wake_token,
            clock=self.clock, random=self.random, agents=self.agents)

    async def close(self) -> None:
        """Flush pending appends and close the pool."""
        await self.committer.close()
        await self.database.close()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


def _lost_seq_race(error: BaseException) -> bool:
    """The task's owner appended the seq our database-written event wanted: run it again."""
    return isinstance(error, DuplicateRow)


async def connect(dsn: str | None = None, *, config: EngineConfig | None = None,
                  **options: Unpack[EngineOptions]) -> Engine:
    """Open an engine on ``dsn``, else ``WAL_ENGINE_DSN``, else an embedded PostgreSQL.

    The schema is applied on first connect (``migrate=False`` only checks its version).
    The options are an :class:`EngineConfig` (its fields say what each does) or, as a
    shortcut, keyword arguments naming its fields; giving both, or a keyword that is not a
    field, raises :class:`~wal_engine.errors.ConfigurationError`.
    """
    chosen = _engine_config(config, options)

    async def open_database() -> Database:
        return await Database.open(
            dsn, max_size=chosen.pool_size_max, migrate=chosen.migrate,
            require_synchronous_commit=chosen.require_synchronous_commit,
            development=chosen.development, tenant=chosen.tenant, tasks_max=chosen.tasks_max,
            statement_timeout_ms=chosen.statement_timeout_ms, pooler=chosen.pooler,
            listen_dsn=chosen.listen_dsn,
        )

    database = await (_waiting_for_database(open_database, chosen.connect_wait_s)
                      if chosen.connect_wait_s > 0 else open_database())
    return Engine(database, payload_bytes_max=chosen.payload_bytes_max,
                  snapshot_policy=chosen.snapshot_policy, redactor=chosen.redactor,
                  secrets=chosen.secrets, events_per_task_max=chosen.events_per_task_max,
                  llm_spend_max_usd=chosen.llm_spend_max_usd,
                  recovery_attempts_max=chosen.recovery_attempts_max,
                  unavailable_retry_s=chosen.unavailable_retry_s)


async def _waiting_for_database(open_database: Callable[[], Awaitable[Database]],
                                wait_s: float) -> Database:
    """``open_database()``, made again through an outage (bounded, jittered backoff, a
    ``database_waiting`` warning per attempt) for at most ``wait_s``; ``database_ready``
    is logged once it answers after a wait. The last error is raised after that (a wrong
    password or database name at once: waiting does not end those)."""
    started = time.monotonic()
    attempts = 1

    def waiting(error: BaseException, attempt: int, delay_s: float) -> None:
        nonlocal attempts
        attempts = attempt + 1
        log.warning("database_waiting", error=_error_text(error), attempt=attempt,
                    delay_s=round(delay_s, 3),
                    waited_s=round(time.monotonic() - started, 3), wait_s=wait_s)

    database = await retrying(connect_wait_policy(wait_s), open_database, retry_if=is_outage,
                              key=uuid.uuid4().hex[:8], on_retry=waiting)
    if attempts > 1:
        log.info("database_ready", dsn=database.dsn_redacted, attempts=attempts,
                 waited_s=round(time.monotonic() - started, 3))
    return database


def _may_have_applied(error: BaseException) -> bool:
    """Whether the attempt that raised ``error`` may have taken effect."""
    return bool(getattr(error, "may_have_applied", False))


def _error_text(error: BaseException) -> str:
    """``error`` as one line: its type and message (its cause's too, for a typed one)."""
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__
    if cause is not None and type(cause).__name__ not in text:
        text += f" (from {type(cause).__name__}: {cause})"
    return " ".join(text.split())


# ------------------------------------------------------------------ agent registration


def _check_agent_labels(name: str, version: str, compatible: tuple[str, ...]) -> None:
    """Refuse an agent name or version label the log cannot store (InvalidInput)."""
    if not name or len(name) > limits.name_length_max:
        raise InvalidInput(f"agent name must be 1..{limits.name_length_max} characters")
    # Text PostgreSQL cannot store (NUL, a lone surrogate) is refused here: later, a
    # worker's claim statement would fail on every poll and claim nothing.
    validate_text(name, "an agent name", bytes_max=4 * limits.name_length_max)
    for label in (version, *compatible):
        if not isinstance(label, str) or not 1 <= len(label) <= agent_version_length_max:
            raise InvalidInput(
                f"agent versions must be 1..{agent_version_length_max} characters")
        validate_text(label, "an agent version", bytes_max=4 * agent_version_length_max)


def _input_annotation(name: str, function: Callable[..., Any], *, explicit: bool) -> Any:
    """The type the input parameter of ``function`` (its second) is annotated with, or None
    (no annotation, ``Any`` or ``object``). An annotation that cannot be resolved (a name
    defined only under ``TYPE_CHECKING`` or inside a function) is ignored when an explicit
    ``input_type`` was given, and otherwise refused: the function would get another type
    than it declares."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if len(parameters) < 2 or parameters[1].annotation is inspect.Parameter.empty:
        return None
    annotation = parameters[1].annotation
    if isinstance(annotation, str):
        try:
            annotation = _resolve(annotation, function)
        except Exception as error:  # get_type_hints raises whatever evaluating it raises
            if explicit:
                return None
            raise ConfigurationError(
                f"the input annotation {annotation!r} of agent {name!r} cannot be resolved "
                f"({type(error).__name__}: {error}); define the type at module level or "
                "pass input_type=") from error
    return None if annotation in (Any, object) else annotation


def _resolve(annotation: str, function: Callable[..., Any]) -> Any:
    """Evaluate one string annotation in the namespace of ``function``'s module (and the
    names its body takes from enclosing functions), as ``typing.get_type_hints`` does."""
    target = inspect.unwrap(function)

    def holder() -> None:
        """Carries the one annotation to resolve."""

    holder.__annotations__ = {"value": annotation}
    namespace = dict(getattr(target, "__globals__", {}))
    local = inspect.getclosurevars(target).nonlocals if inspect.isfunction(target) else {}
    return typing.get_type_hints(holder, globalns=namespace, localns=dict(local))["value"]


def _typed_entry(function: F, annotation: Any) -> AgentFunction:
    """What a run calls: ``function`` itself, or (its input annotated) a function that
    converts the stored JSON input to the annotated type first. A stored input that does not
    convert (a task submitted without this agent's check) fails the task with InvalidInput."""
    if annotation is None:
        return function

    @functools.wraps(function)
    async def entry(context: AgentContext, stored: Any) -> Any:
        try:
            typed = msgspec.convert(stored, annotation)
        except msgspec.ValidationError as error:
            raise InvalidInput(f"the task's input does not match {annotation!r}, the input "
                               f"type of its agent: {error}") from error
        return await function(context, typed)

    return entry


# ------------------------------------------------------------------ configuration


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The options of :func:`connect` (``connect(dsn, config=EngineConfig(...))``, or the
    same names as keyword arguments). Validated when made
    (:class:`~wal_engine.errors.ConfigurationError`).

    Attributes:
        payload_bytes_max: The cap on one event's encoded payload; at most the database's
            own ceiling (``limits.payload_bytes_ceiling``, a CHECK on the log).
        pool_size_max: The most connections of the engine's pool.
        migrate: Apply the schema on first connect (False only checks its version).
        require_synchronous_commit: Refuse a server that acknowledges commits before they
            are durable.
        snapshot_policy: When workers write snapshots (None: the engine's default).
        redactor: Applied to every input, intent, result, message and signal before it is
            hashed and written (:mod:`wal_engine.security.redaction`); None stores values
            as given.
        secrets: Resolves secret references (``redaction.secret_ref``) in tool arguments
            and LLM requests just before each attempt; the values are never stored.
        development: Whether a refusal of the start-up security self-test
            (:mod:`wal_engine.security.roles`: superuser, BYPASSRLS, owner of the log) is
            only logged. None decides from the setup: the embedded server and
            ``WAL_ENGINE_DEVELOPMENT=1`` are development setups.
        tenant: The one tenant this engine serves (default ``WAL_ENGINE_TENANT``, else
            ``"default"``): every connection is bound to it, and row-level security and
            every statement keep it to that tenant's tasks. Letters, digits and
            ``_ . : -``, at most 64; anything else raises
            :class:`~wal_engine.errors.InvalidTenant`. Serve several tenants with one
            engine each (see ``docs/security.md``).
        tasks_max: A cap on the tenant's tasks, checked in the database as each task is
            created (:class:`~wal_engine.errors.TaskQuotaExceeded`); an administrator's
            cap in ``wal_tenants.tasks_max`` applies as well.
        events_per_task_max: Appends that would take a task past this many events are
            refused (:class:`InvalidInput`), except the one that ends it; at most the
            database's own ceiling (``limits.events_per_task_ceiling``), which a CHECK on
            the log enforces for every writer.
        llm_spend_max_usd: A cap on the LLM spend of all the tenant's tasks together:
            checked before each LLM call, a task that finds it reached fails with
            ``budget_exceeded`` (``tenant_llm_spend_usd``); an administrator's cap in
            ``wal_tenants.llm_spend_max_usd`` applies as well.
        statement_timeout_ms: The ``statement_timeout`` every engine session sends at its
            start (it wins over role and database defaults, decision 35).
        recovery_attempts_max: How many times a task may be claimed again after its
            runs were lost (crashes, expired leases) before it is dead-lettered.
        unavailable_retry_s: How long a call of the engine's API that is safe to repeat
            (``submit``, a signal with a ``dedup_key``, ``cancel``, ``reconcile``,
            ``fork``, the reads, and any call whose attempt never reached the database)
            is made again while the database is away (a failover, a restart), with a
            bounded, jittered backoff, before it raises
            :class:`~wal_engine.errors.DatabaseUnavailable`; default 30 s (a Patroni
            failover takes 10-30 s). 0: never retried. One attempt already under way may
            end after it (a connect attempt waits at most 10 s).
        connect_wait_s: How long ``connect()`` waits for a database that is away (refused,
            unanswered, starting up, in recovery) before it raises
            :class:`~wal_engine.errors.DatabaseUnavailable`; logs ``database_waiting`` per
            attempt and ``database_ready`` once connected. 0 (the default): no wait. A
            wrong password or database name is raised at once.
        pooler: What sits between the engine and PostgreSQL: ``"transaction"`` or
            ``"session"`` (a PgBouncer 1.18+ pool mode), or None, a direct connection
            (default ``WAL_ENGINE_POOLER``). Through a pooler the engine sends only the
            startup parameters it keeps and carries its settings per session or per
            transaction (``docs/pgbouncer.md``).
        listen_dsn: A direct DSN (no transaction pooler) for the workers' LISTEN session
            (default ``WAL_ENGINE_LISTEN_DSN``); through a transaction pooler without one,
            workers find new work by polling (``poll_ms``).
    """

    payload_bytes_max: int = limits.payload_bytes_max
    pool_size_max: int = limits.pool_size_max
    migrate: bool = True
    require_synchronous_commit: bool = True
    snapshot_policy: SnapshotPolicy | None = None
    redactor: Redactor | None = default_redactor
    secrets: SecretResolver | None = None
    development: bool | None = None
    tenant: str | None = None
    tasks_max: int | None = limits.tasks_max
    events_per_task_max: int = limits.history_events_max
    llm_spend_max_usd: float | None = None
    statement_timeout_ms: int = limits.statement_timeout_ms
    recovery_attempts_max: int = recovery_attempts_max_default
    unavailable_retry_s: float = UNAVAILABLE_RETRY_S_DEFAULT
    connect_wait_s: float = 0.0
    pooler: str | None = None
    listen_dsn: str | None = None

    def __post_init__(self) -> None:
        for name in ("unavailable_retry_s", "connect_wait_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigurationError(f"{name} must be a finite number of seconds >= 0")
        if not 1 <= self.events_per_task_max <= limits.events_per_task_ceiling:
            raise ConfigurationError(f"events_per_task_max must be 1.."
                                     f"{limits.events_per_task_ceiling} (the database's ceiling)")
        if not 1 <= self.payload_bytes_max <= limits.payload_bytes_ceiling:
            raise ConfigurationError(f"payload_bytes_max must be 1.."
                                     f"{limits.payload_bytes_ceiling} (the database's ceiling)")
        spend = self.llm_spend_max_usd
        if spend is not None and not (math.isfinite(spend) and spend >= 0):
            raise ConfigurationError("llm_spend_max_usd must be a finite amount of at least 0")
        if self.recovery_attempts_max < 1:
            raise ConfigurationError("recovery_attempts_max must be at least 1")


class EngineOptions(TypedDict, total=False):
    """:class:`EngineConfig`'s fields as keyword arguments of :func:`connect` (a test keeps
    the two the same)."""

    payload_bytes_max: int
    pool_size_max: int
    migrate: bool
    require_synchronous_commit: bool
    snapshot_policy: SnapshotPolicy | None
    redactor: Redactor | None
    secrets: SecretResolver | None
    development: bool | None
    tenant: str | None
    tasks_max: int | None
    events_per_task_max: int
    llm_spend_max_usd: float | None
    statement_timeout_ms: int
    recovery_attempts_max: int
    unavailable_retry_s: float
    connect_wait_s: float
    pooler: str | None
    listen_dsn: str | None


class WorkerOptions(TypedDict, total=False):
    """:class:`~wal_engine.runtime.worker.WorkerConfig`'s fields as keyword arguments of
    :meth:`Engine.worker` (a test keeps the two the same)."""

    concurrency: int
    lease_ttl_ms: int
    heartbeat_ms: int
    poll_ms: int
    sweep_ms: int
    drain_timeout_s: float
    sync_threads: int
    stall_warn_ms: int
    stall_abandon_ms: int


def _options_config(kind: type[ConfigT], config: ConfigT | None, options: Mapping[str, Any],
                    where: str) -> ConfigT:
    """``config``, or one made from the keyword ``options``; both given, a keyword that is
    not a field or a value the config refuses: ConfigurationError."""
    if config is not None:
        if options:
            raise ConfigurationError(f"{where}: pass config= or keyword options, not both "
                                     f"(got config= and {', '.join(sorted(options))})")
        if not isinstance(config, kind):
            raise ConfigurationError(f"{where}: config= must be a {kind.__name__}, "
                                     f"not {type(config).__name__}")
        return config
    unknown = sorted(set(options) - set(kind.__struct_fields__))
    if unknown:
        raise ConfigurationError(f"{where}: unknown option(s) {', '.join(unknown)}; the "
                                 f"options are {kind.__name__}'s fields")
    try:
        return kind(**options)
    except (TypeError, ValueError) as error:  # WorkerConfig's checks raise ValueError
        raise ConfigurationError(f"{where}: {error}") from error


def _engine_config(config: EngineConfig | None, options: Mapping[str, Any]) -> EngineConfig:
    return _options_config(EngineConfig, config, options, "connect()")


def _worker_config(config: WorkerConfig | None, options: Mapping[str, Any]) -> WorkerConfig:
    return _options_config(WorkerConfig, config, options, "engine.worker()")
