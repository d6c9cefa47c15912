"""One claimed task running on a worker: re-run the agent against its journal, append ahead.

A task run loads the task's state (latest snapshot plus the tail of the log), then runs the
agent function from the top. Every command the code issues goes through the
:class:`~wal_engine.runtime.context.AgentContext`: commands already in the log are answered from it
(the journal cursor for external calls, ordinals for messages and checkpoints), new ones are
appended **before** they act. The run ends when the agent returns (``task_completed``),
fails (``task_failed`` with a diagnostic), waits (the task is WAITING and the lease is
dropped), is handed back (``task_released``), or is fenced (another worker owns the task:
nothing more is written or done).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import math
from collections.abc import Sequence
from concurrent.futures import Executor
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final

import msgspec
import structlog

from replay.divergence import NonDeterminismError
from replay.fold import StateBuilder
from replay.journal import Journal
from replay.snapshot import SnapshotSegments
from replay.state import AgentState, ChildSpend, budget_usage
from wal_engine import events as ev
from wal_engine import limits
from wal_engine.budgets import BudgetTrip, Usage, first_trip
from wal_engine.errors import (
    AmbiguousCommit,
    ConcurrencyConflict,
    CorruptionError,
    DatabaseUnavailable,
    InvalidPayload,
    LeaseLost,
    SnapshotCorrupt,
    UnknownTask,
    WalError,
)
from wal_engine.observability import metrics
from wal_engine.observability.logs import get_logger
from wal_engine.retries import RUN_RECONNECT_RETRY, retrying
from wal_engine.runtime.control import (
    INTERNAL_PREFIX,
    Fenced,
    Finished,
    StoppedDuringCall,
    Suspended,
)
from wal_engine.runtime.hooks import HookEvent, call_hook
from wal_engine.runtime.ports import AgentSpec, RunHost, RunServices
from wal_engine.security.redaction import (
    NameForms,
    Redactor,
    no_redaction,
    redact_bounded,
    redact_event,
    redact_text,
    user_bytes,
)
from wal_engine.state_machine import LEASED, TERMINAL, Status
from wal_engine.store import PendingAppend, queries
from wal_engine.store.connection import CONNECTION_ERRORS
from wal_engine.store.store import check_history_bound

if TYPE_CHECKING:
    from wal_engine.runtime.resume import ResumedState

log = get_logger(__name__)

TENANT_SPEND_BUDGET: Final = "tenant_llm_spend_usd"
"""The name a tripped per-tenant LLM spend cap has in ``budget_exceeded``."""

_no_budget: Final = ev.Budget()
diagnostic_events_max: Final = 10
interruptions_max: Final = 20
"""Lost connections one run goes on after (each recorded as ``run_interrupted``)."""
DISCONNECTS: Final = (*CONNECTION_ERRORS, DatabaseUnavailable, AmbiguousCommit)
"""What a lost connection looks like to a run: a disconnect, or an append left in doubt."""
release_timeout_s: Final = 5.0
"""How long a cancelled run may take to hand its task back before the worker exits."""
error_text_max: Final = 2000


class TaskRun:
    """The execution of one claimed task on one worker.

    Built by the worker from the engine's ``services``, the worker itself as its ``host``
    (lease keeper, thread pool), the claimed ``row`` and the agent's registration
    (``definition``: None if this worker does not serve the agent; the task is then handed
    back).
    """

    def __init__(self, services: RunServices, host: RunHost, row: Any,
                 definition: AgentSpec | None) -> None:
        self.services = services
        self.host = host
        self.worker_id = host.worker_id
        self.task_id: str = row["task_id"]
        self.agent: str = row["agent"]
        self.agent_version: str | None = row["agent_version"]
        """The version of the agent code that started the task, as the claim pinned it."""
        self.epoch: int = row["lease_epoch"]
        self.head_seq: int = row["head_seq"]
        self.head_hash: bytes = row["head_hash"]
        self.clock = services.clock
        self.claimed_at = self.clock.monotonic_s()
        started: dt.datetime | None = row["started_at"]
        now: dt.datetime = row["database_now"]
        self.runtime_before_claim_s = 0.0 if started is None else (now - started).total_seconds()
        self.leased = True
        self.leaving_lease = False
        """An append that gives the lease up (a wait, an ending, a hand-back) is in flight:
        a renewal that no longer finds the lease is then no sign of another owner."""
        self.fenced_reason: str | None = None
        self.suspend_requested = False
        self.stop_forced = False
        """The worker is going away without a drain (cancelled, a forced stop): a
        cancellation of this run is no longer survived to wait for a sync call's thread."""
        self.builder: StateBuilder | None = None
        self.journal: Journal | None = None
        self.log = log.bind(task_id=self.task_id, epoch=self.epoch, worker_id=self.worker_id)
        self._state_cache: AgentState | None = None
        self.redactor: Redactor = services.redactor
        self.redact_name = NameForms(self.redactor)
        """A name (a tool's, a signal's...) as the log records it, remembered per name."""
        self.payload_bytes_max = int(services.store.payload_bytes_max)
        self.last_appended: list[ev.Event] = []
        """The events of the last append as recorded (redacted)."""
        self.last_snapshot_seq = 0
        self.snapshot_segments: SnapshotSegments = SnapshotSegments()
        """The segments this run's snapshots stored (or its resume read): not re-sent."""
        self._snapshot_writer: asyncio.Task[None] | None = None
        """The snapshot being written in the background (:meth:`maybe_snapshot`)."""
        self._snapshot_next: AgentState | None = None
        """The latest checkpoint's state the writer has yet to write."""
        self.definition = definition
        self._unsettled: list[ev.Event] = []
        """Outcome events of the last append, while it is in doubt (its connection broke):
        after the log is read back, recorded again if they did not land."""
        self.refused_append: WalError | None = None
        """The first write of this run that the database refused (not another owner, not a
        lost connection): the run's outcome is then not recorded; the task is handed back."""

    # ------------------------------------------------------------------ control

    def fence(self, reason: str) -> None:
        """Stop the run at its next command: another worker owns the task."""
        if self.fenced_reason is None:
            self.log.warning("lease_lost", reason=reason)
        self.fenced_reason = reason
        self.leased = False

    def request_suspend(self) -> None:
        """Hand the task back at the next durable point (graceful shutdown)."""
        self.suspend_requested = True

    @property
    def state(self) -> AgentState:
        """The folded state as of the last event written or replayed."""
        if self._state_cache is None:
            assert self.builder is not None
            self._state_cache = self.builder.state()
        return self._state_cache

    @property
    def view(self) -> Any:
        """The live folded state without a copy (read only, do not keep)."""
        assert self.builder is not None
        return self.builder.view

    @property
    def status(self) -> Status | None:
        """The current status (cheap: no state copy)."""
        assert self.builder is not None
        return self.builder.view.status

    def runtime_s(self) -> float:
        """Wall-clock runtime across all workers and restarts (database clock at claim)."""
        return self.runtime_before_claim_s + (self.clock.monotonic_s() - self.claimed_at)

    # ------------------------------------------------------------------ execution

    async def execute(self) -> None:
        """Run the task until it finishes, waits, is handed back or is fenced. A lost
        connection does not end the run while the lease can be trusted: the log is read
        back, the interruption recorded, and the agent code runs again from the top."""
        from wal_engine.runtime.context import AgentContext

        definition = self.definition
        try:
            resumed = await self._first_read()
        except CorruptionError as error:
            await self._quarantine(error)
            return
        if resumed is None or not self._adopt(resumed):
            return
        if definition is None:
            await self._release(f"agent {self.agent!r} is not registered on this worker")
            return
        if self.agent_version is not None and self.agent_version not in definition.runs:
            await self._release(f"version {self.agent_version!r} of agent {self.agent!r} is "
                                "not runnable on this worker")
            return
        await self.run_claim_hooks()
        for interruption in range(interruptions_max + 1):
            try:
                await self._run_agent(AgentContext(self), definition.function,
                                      self.view.input)
                return
            except (Suspended, Finished):
                return
            except Fenced:
                self.log.warning("task_run_fenced", reason=self.fenced_reason)
                return
            except DISCONNECTS as error:
                self.log.warning("task_run_interrupted", error=self.redact_text(repr(error)),
                                 interruption=interruption + 1)
                if interruption == interruptions_max or not await self._continue(error):
                    return
            except asyncio.CancelledError as cancel:
                # A graceful stop ran out of time while the agent was inside a call: hand
                # the task back now rather than leave it to lease expiry. The call in
                # flight stays in doubt in the log and is handled as such by the next owner
                # (a sync call's thread has ended by now, its outcome recorded: steps.py).
                # Stopped again while such a thread ran, the run hands nothing back: the
                # lease lapses as in a crash, and the call is escalated with its grace.
                if isinstance(cancel, StoppedDuringCall):
                    self.log.warning("task_left_to_lease_expiry",
                                     reason="stopped again while a sync call's thread ran")
                elif self.suspend_requested and self.leased and self.fenced_reason is None:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(asyncio.wait_for(
                            self._release("worker stopped during a call"), release_timeout_s))
                raise

    async def _first_read(self) -> ResumedState | None:
        """The state read just after the claim. A lost connection here is retried while
        the lease can be trusted (nothing ran yet, so there is nothing to record); giving
        up left the task to lease expiry, one claim per connection lost at this point."""
        try:
            return await retrying(RUN_RECONNECT_RETRY, self._read_state,
                                  retry_if=self._reconnectable, key=self.task_id)
        except DISCONNECTS as error:
            self.log.warning("task_run_given_up", error=self.redact_text(repr(error)),
                             reason="lease expired while disconnected, before the first read")
            return None

    def _reconnectable(self, error: BaseException) -> bool:
        """Whether to wait for the database once more: a lost connection (or an append in
        doubt) while the lease can still be trusted."""
        return isinstance(error, DISCONNECTS) and self.lease_trusted()

    def _adopt(self, resumed: ResumedState) -> bool:
        """Take ``resumed`` as the run's state; False (fenced) if the log moved past the
        claim."""
        state = resumed.state
        metrics.resumed(resumed.events_folded, resumed.snapshot_seq is not None)
        self.last_snapshot_seq = resumed.snapshot_seq or 0
        self.snapshot_segments = resumed.segments
        if state.last_seq != self.head_seq:
            self.fence(f"log moved past the claim (seq {state.last_seq} != {self.head_seq})")
            return False
        self.builder = StateBuilder(state)
        self._state_cache = None
        self._new_journal()
        return True

    def _new_journal(self) -> None:
        """A journal cursor over the calls of the state as it is now (agent code about to
        run from the top)."""
        state = self.state
        self.journal = Journal(
            [call for call in state.calls.values() if not is_internal(call)],
            end_seq=state.last_seq, closed=state.terminal, task_id=self.task_id,
            name_form=self.redact_name,
        )

    async def _continue(self, error: BaseException) -> bool:
        """After a lost connection: wait for the database while the lease can be trusted,
        read the log back (which settles any append in doubt), check the lease is still
        ours, record what is known and the interruption, and say whether to run again."""
        async def resume_in_place() -> bool:
            head = await self.services.store.read_head(self.task_id)
            if head.lease_epoch != self.epoch or head.status not in LEASED:
                self.fence(f"lease moved while the connection was lost (epoch "
                           f"{head.lease_epoch}, status {head.status.value})")
                return False
            self.head_seq, self.head_hash = head.head_seq, head.head_hash
            if not self._adopt(await self._read_state()):
                return False
            # The code runs again from the top against the log: a write refused before the
            # connection was lost is behind it (the reload dropped it).
            self.refused_append = None
            await self._settle_outcomes()
            await self.append([ev.RunInterrupted(
                error_type=type(error).__name__, error=_interruption_text(error, self),
                worker_id=self.worker_id)])
            self._new_journal()
            return True

        if self.lease_trusted():
            try:
                return await retrying(RUN_RECONNECT_RETRY, resume_in_place,
                                      retry_if=self._reconnectable, key=self.task_id)
            except DISCONNECTS:
                pass
            except WalError:
                if self.refused_append is None:
                    raise
                await self._hand_back_refused()
                return False
            except Fenced:
                # An append here found the lease gone (another worker took the task over
                # while this one was disconnected). Fenced is a BaseException: left to
                # escape, it would end the run's asyncio task with an unretrieved error.
                self.log.warning("task_run_fenced", reason=self.fenced_reason)
                return False
        self.log.warning("task_run_given_up", reason="lease expired while disconnected")
        return False

    async def _settle_outcomes(self) -> None:
        """Record again the outcomes of an append in doubt that did not land: the effect
        happened and this run still holds the lease, so its result is known; without this
        the re-run would find the call in doubt and retry or escalate it."""
        unsettled, self._unsettled = self._unsettled, []
        assert self.builder is not None
        pending = self.builder.view.pending
        outcomes = [e for e in unsettled if getattr(e, "call_id", None) in pending]
        if outcomes:
            await self.append(outcomes, redacted=True)

    # ------------------------------------------------------------------ hooks

    async def run_claim_hooks(self) -> None:
        """``on_claim``; then, unless this is the task's first run, ``on_orphaned`` (after
        an expired lease) and ``on_resume``."""
        reason = self.view.handed_over or "first_run"
        await self.run_hook("on_claim", reason)
        if reason == "first_run":
            return
        if reason == "orphaned":
            await self.run_hook("on_orphaned", reason)
        await self.run_hook("on_resume", reason)

    async def run_hook(self, hook: str, reason: str, detail: Any = None) -> None:
        """Call the agent's ``hook`` if it has one. Its failure is logged and recorded
        (``hook_failed``, while the task is leased) and never stops the task."""
        definition = self.definition
        function = None if definition is None else definition.hooks.get(hook)
        if function is None or definition is None:
            return
        event = HookEvent(
            hook=hook, task_id=self.task_id, agent=self.agent, reason=reason,
            task_version=self.view.agent_version, code_version=definition.version,
            new_version=self.view.agent_version not in (None, definition.version),
            worker_id=self.worker_id, epoch=self.epoch, seq=self.head_seq,
            detail=detail)
        try:
            await call_hook(function, event)
        except Exception as error:
            text = self.redact_text(repr(error))[:error_text_max]
            self.log.error("hook_failed", hook=hook, error=text)
            if self.leased and self.fenced_reason is None and not is_terminal(self.status):
                with contextlib.suppress(Fenced, WalError, *CONNECTION_ERRORS):
                    await self.append([ev.HookFailed(hook=hook, error_type=type(error).__name__,
                                                     error=text)])

    async def _read_state(self) -> ResumedState:
        """The state to continue from. A snapshot is derived data: one that does not decode
        or does not match the log (bit rot, or segments pruned by a fenced writer's racing
        snapshot) is dropped and the log folded instead; only a log that does not fold is
        a corruption of the task."""
        from wal_engine.runtime.resume import delete_snapshots, read_state

        try:
            return await read_state(self.services.store, self.task_id)
        except SnapshotCorrupt as error:
            self.log.warning("snapshot_dropped", reason=str(error))
            await delete_snapshots(self.services.database, self.task_id)
            return await read_state(self.services.store, self.task_id, use_snapshot=False)

    async def _run_agent(self, context: Any, function: Any, agent_input: Any) -> None:
        trip = self.check_budget(at_claim=True)
        if trip is not None:
            await self.fail_budget(trip)
        try:
            try:
                output = await function(context, agent_input)
                assert self.journal is not None
                self.journal.finish()
                context.finish_commands()
            except Exception:
                if self.refused_append is None:
                    raise
                # The code ended on (or after) the database's refusal of one of its writes:
                # no ending of its own. Recorded as agent_error, the deploy gate would take
                # it for the code's ending and replay today's code into a divergence there.
                await self._hand_back_refused()
                return
        except NonDeterminismError as error:
            self.log.error("nondeterminism", seq=error.seq, fork_point=error.fork_point)
            await self.fail("nondeterminism", error, diagnostic_extra={
                "seq": error.seq, "fork_point": error.fork_point})
            return
        except (Suspended, Finished, Fenced):
            raise
        except (LeaseLost, ConcurrencyConflict) as error:
            self.fence(str(error))
            raise Fenced from error
        except DISCONNECTS:
            raise
        except Exception as error:
            self.log.error("agent_failed", error=self.redact_text(repr(error)))
            await self.fail("agent_error", error)
            return
        if self.refused_append is not None:
            await self._hand_back_refused()  # The code caught the refusal and returned.
            return
        try:
            await self.append([ev.TaskCompleted(output=output)])
        except InvalidPayload as error:
            # Nothing was written. Raised out of the run, it crashed every run that claimed
            # the task again: the task stayed RUNNING, re-run at each lease expiry.
            self.log.error("agent_output_unstorable", error=str(error))
            await self.fail("agent_error", error)
            return
        except WalError:
            if self.refused_append is None:
                raise
            await self._hand_back_refused()
            return
        self.log.info("task_completed", seq=self.head_seq)
        await self.run_hook("on_complete", "completed", {"output": self.view.output})

    # ------------------------------------------------------------------ appends

    def check_live(self) -> None:
        """Raise unless the run may issue another command."""
        if self.fenced_reason is not None:
            raise Fenced

    def lease_trusted(self) -> bool:
        """Whether the worker can still trust this run's lease by its own monotonic clock
        (the last renewal plus the TTL less a margin): checked, without a round trip,
        before every effect. Thread-safe (tools call it from their thread)."""
        return self.fenced_reason is None and self.host.lease_valid(self.task_id, self.epoch)

    @property
    def executor(self) -> Executor | None:
        """The worker's thread pool for sync tools and LLM functions."""
        return self.host.executor

    @property
    def lease_ttl_ms(self) -> int:
        """The lease TTL of the worker running this task."""
        return self.host.lease_ttl_ms

    def redact(self, value: Any) -> Any:
        """``value`` as the log will record it (the engine's redactor); PayloadTooLarge,
        before any regex runs, if it cannot fit in an event."""
        return redact_bounded(self.redactor, value, self.payload_bytes_max)

    def redact_text(self, text: str) -> str:
        """Free text (an error message) as the log and the logs may show it."""
        # Cut to what an event can hold first: patterns never look at text that cannot be
        # stored anyway.
        return redact_text(self.redactor, text[:self.payload_bytes_max])

    async def append(self, events: Sequence[ev.Event], *, redacted: bool = False) -> None:
        """Write ahead: redact, validate, fold, then append in one fenced commit
        (group-committed). ``self.last_appended`` is then the events as recorded
        (redacted, a step_started first when one was needed). ``redacted``: the caller
        built the events from values this run's redactor already returned (redactors are
        idempotent, so a second pass would only cost time).

        Raises :class:`Fenced` if another worker owns the task; InvalidPayload if an event
        cannot be stored (nothing is written, the state is unchanged).
        """
        self.check_live()
        events = list(self._with_step_started(events))
        if not redacted:
            events = [await self._redacted(e) for e in events]
        check_history_bound(self.task_id, self.head_seq, events,
                            self.services.store.events_per_task_max)
        encoded = [ev.encode_event(e, payload_bytes_max=self.services.store.payload_bytes_max)
                   for e in events]
        # From here on the run holds the events as the log holds them (decoded from their
        # stored bytes), so that live code sees what a replay or a resume sees: keys in
        # stored (sorted) order, tuples as lists (decision 61).
        events = [ev.decode_event(kind, version, payload) for kind, version, payload in encoded]
        assert self.builder is not None
        for event in events:
            self.builder.apply(event)
        self._state_cache = None
        self.leaving_lease = any(type(e).TARGET_STATUS not in _STAYING for e in events)
        try:
            result = await self.services.committer.append(PendingAppend(
                task_id=self.task_id, epoch=self.epoch, expected_seq=self.head_seq,
                prev_hash=self.head_hash, events=events, encoded=encoded,
            ))
        except (LeaseLost, ConcurrencyConflict, UnknownTask) as error:
            self.leaving_lease = False
            self.fence(str(error))
            raise Fenced from error
        except DISCONNECTS:
            self.leaving_lease = False
            self._unsettled = [e for e in events if isinstance(e, _OUTCOMES)]
            raise
        except WalError as error:
            self.leaving_lease = False
            await self._forget_refused(events, error)
            raise
        except BaseException:
            self.leaving_lease = False
            raise
        self.head_seq, self.head_hash = result.head_seq, result.head_hash
        structlog.contextvars.bind_contextvars(seq=result.head_seq)
        if result.status is not None and result.status not in LEASED:
            self.leased = False
        self.last_appended = events

    async def _forget_refused(self, events: Sequence[ev.Event], error: WalError) -> None:
        """The database refused an append that is neither fenced nor in doubt (a status move
        its trigger refused, a cap): nothing of it landed, but its events were folded into
        the run's state ahead of the commit. Left there, the run would go on from a state the
        log does not hold (a ``ctx.patched`` marker, a call intent that never landed), and
        whatever it wrote next (a ``task_failed`` blaming the agent code for the engine's
        refusal) would describe that state. The state is folded again from the log; if that
        cannot be done, the run stops writing (the lease expires and the next owner reads
        the log)."""
        if self.refused_append is None:
            self.refused_append = error
        self.log.error("append_refused", error=self.redact_text(repr(error)),
                       events=[ev.event_type(e) for e in events], seq=self.head_seq)
        try:
            resumed = await self._read_state()
        except (WalError, *CONNECTION_ERRORS) as failure:
            self.fence(f"state unknown after a refused append ({type(failure).__name__})")
            return
        if resumed.state.last_seq != self.head_seq:
            self.fence(f"log moved past a refused append (seq {resumed.state.last_seq} != "
                       f"{self.head_seq})")
            return
        self.builder = StateBuilder(resumed.state)
        self._state_cache = None

    async def _hand_back_refused(self) -> None:
        """End a run that saw the database refuse one of its writes. Whatever the agent code
        did next (raise the refusal, or catch it and go on) is not its own outcome: the task
        is handed back, and its next run continues from the log, where the refused write is
        absent. A refusal that repeats on every run ends in the recovery-attempts budget,
        never as ``agent_error``."""
        refused = self.refused_append
        assert refused is not None
        if self.fenced_reason is not None or not self.leased:
            return
        reason = self.redact_text(f"a write was refused: {type(refused).__name__}: {refused}")
        try:
            await self._release(reason[:error_text_max])
        except (Fenced, WalError, *CONNECTION_ERRORS) as failure:
            # Left to lease expiry: the next owner reads the log as it is.
            self.log.warning("task_release_failed", error=self.redact_text(repr(failure)))

    async def _redacted(self, event: ev.Event) -> ev.Event:
        """``event`` as the log records it (the engine's redactor). Its patterns scan every
        string; on a large value (over ``limits.blob_threshold_bytes``: a 5 MiB base64
        image took seconds) that runs in the worker's thread pool, off the event loop that
        renews the leases of the worker's other tasks (decision 61)."""
        bytes_max: int | None = self.payload_bytes_max
        if self.redactor is not no_redaction and type(event) in _LARGE_VALUE_EVENTS:
            if user_bytes(event, bytes_max) > limits.blob_threshold_bytes:
                return await asyncio.get_running_loop().run_in_executor(
                    self.executor, functools.partial(
                        redact_event, event, self.redactor, bytes_max=bytes_max,
                        names=self.redact_name))
            # user_bytes has just checked these fields against the bound (redact_event's
            # own check, the same walk): not walked twice.
            bytes_max = None
        return redact_event(event, self.redactor, bytes_max=bytes_max, names=self.redact_name)

    def _with_step_started(self, events: Sequence[ev.Event]) -> Sequence[ev.Event]:
        """Open the next step first when the task rests CHECKPOINTED and an observation
        (which needs RUNNING) follows."""
        if self.status is not Status.CHECKPOINTED:
            return events
        first = events[0]
        if type(first).TARGET_STATUS is not None:
            return events
        assert self.builder is not None
        return [ev.StepStarted(step=self.builder.view.step + 1), *events]

    async def store_result_or_failure(self, success: ev.Event,
                                      failure: ev.Event) -> ev.Event | None:
        """Append ``success``; if its payload cannot be stored, append ``failure`` instead.

        The effect already happened, so something must be recorded: an unstorable result
        (NaN, NUL, too deep, too large) becomes a typed, storable failure, never a loop that
        re-runs the effect (RELIABILITY.md finding 7). Returns ``success`` as recorded
        (redacted: what agent code gets, live and on replay alike), or None if it did not land.
        """
        try:
            await self.append([success])
            return self.last_appended[-1]
        except InvalidPayload as error:
            self.log.warning("unstorable_result", reason=str(error))
            await self.append([failure])
            return None

    # ------------------------------------------------------------------ endings

    def usage(self) -> Usage:
        """Usage as the budget arithmetic sees it (no copy of the state): the task's own
        and what its ``share`` children were charged for."""
        assert self.builder is not None
        return budget_usage(self.builder.view, runtime_s=self.runtime_s())

    def check_budget(self, *, at_claim: bool = False, planned_tool_calls: int = 0,
                     starting_step: bool = False) -> BudgetTrip | None:
        """The budget tripped now, if any (steps only count when a new step would start)."""
        assert self.builder is not None
        budget = self.builder.view.budget
        if not at_claim and budget == _no_budget:
            return None  # The common case, checked before every call: nothing to compute.
        return first_trip(
            budget, self.usage(), planned_tool_calls=planned_tool_calls,
            check_steps=starting_step, check_attempts=at_claim,
            attempts_default=self.services.recovery_attempts_max,
        )

    async def check_tenant_spend(self) -> BudgetTrip | None:
        """The tenant's LLM spend cap, if reached: the smaller of the engine's
        (``connect(llm_spend_max_usd=...)``) and the administrator's
        (``wal_tenants.llm_spend_max_usd``). One read per LLM call, off the append path."""
        row = await self.services.database.fetchrow(queries.TENANT_LLM_SPEND, task_id=self.task_id)
        spent = 0.0 if row is None else float(row["llm_spend_usd"])
        caps = [float(cap) for cap in (self.services.llm_spend_max_usd,
                                       None if row is None else row["llm_spend_max_usd"])
                if cap is not None]
        if caps and spent >= min(caps):
            return BudgetTrip(budget=TENANT_SPEND_BUDGET, limit=min(caps), used=spent)
        return None

    async def add_tenant_spend(self, cost_usd: float) -> None:
        """Add a recorded LLM call's cost to its tenant's spend (after the call is durable:
        a crash in between leaves that one call uncounted, never counted twice)."""
        if cost_usd > 0 and math.isfinite(cost_usd):
            await self.services.database.fetch(queries.ADD_LLM_SPEND, Decimal(repr(cost_usd)),
                                             task_id=self.task_id)

    async def fail_budget(self, trip: BudgetTrip) -> None:
        """Record the tripped budget and fail the task with a diagnostic; unwinds the agent."""
        self.log.warning("budget_exceeded", budget=trip.budget, limit=trip.limit, used=trip.used)
        metrics.budget_tripped(trip.budget)
        await self.append([ev.BudgetExceeded(budget=trip.budget, limit=trip.limit,
                                             used=trip.used)])
        await self.fail("budget_exceeded", None, diagnostic_extra={"tripped": {
            "budget": trip.budget, "limit": trip.limit, "used": trip.used}})
        raise Finished

    async def fail(self, reason: str, error: BaseException | None,
                   diagnostic_extra: dict[str, Any] | None = None) -> None:
        """Record task_failed with the diagnostic report for the human it escalates to."""
        diagnostic = await self._diagnostic(error, diagnostic_extra or {})
        # Redacted before it is cut short: a credential cut in half no longer matches.
        text = None if error is None else self.redact_text(
            f"{type(error).__name__}: {error}")[:error_text_max]
        await self.append([ev.TaskFailed(reason=reason, error=text, diagnostic=diagnostic)])
        self.log.error("task_failed", reason=reason, error=text)
        await self.run_hook("on_complete", "failed", {
            "reason": reason, "error": text, "diagnostic": diagnostic})

    async def _diagnostic(self, error: BaseException | None,
                          extra: dict[str, Any]) -> dict[str, Any]:
        state = self.state
        first = max(1, self.head_seq - diagnostic_events_max + 1)
        last = await self.services.store.read_events(self.task_id, from_seq=first,
                                                   limit=diagnostic_events_max)
        return {
            **extra,
            "error_type": None if error is None else type(error).__name__,
            "attempts": state.attempts,
            "step": state.step,
            "usage": {"input_tokens": state.usage.input_tokens,
                      "output_tokens": state.usage.output_tokens,
                      "cost_usd": state.usage.cost_usd, "tool_calls": state.usage.tool_calls,
                      "llm_calls": state.usage.llm_calls, "runtime_s": round(self.runtime_s(), 3)},
            **({"children_spend": msgspec.to_builtins(state.children_spend)}
               if state.children_spend != ChildSpend() else {}),
            "budget": _budget_fields(state.budget),
            "last_events": [{"seq": r.seq, "type": r.type} for r in last],
        }

    async def _quarantine(self, error: CorruptionError) -> None:
        """The log cannot be folded (unknown type or version, broken rule): fail the task
        with the reason instead of guessing (RELIABILITY.md B3), written without a fold."""
        self.log.error("log_unreadable", error=str(error))
        failed = ev.TaskFailed(reason="unreadable_log", error=str(error)[:error_text_max],
                               diagnostic={"error_type": type(error).__name__})
        try:
            await self.services.store.append_events(
                self.task_id, [failed], epoch=self.epoch, expected_seq=self.head_seq,
                prev_hash=self.head_hash)
        except (LeaseLost, ConcurrencyConflict) as lost:
            self.fence(str(lost))

    async def release_if_requested(self) -> None:
        """At a durable point: if a graceful stop is under way, hand the task back."""
        if self.suspend_requested and self.leased:
            await self._release("worker shutting down")
            raise Suspended

    async def _release(self, reason: str) -> None:
        await self.append([ev.TaskReleased(worker_id=self.worker_id, reason=reason)])
        await self.services.database.fetch(queries.WAKE_WORKERS)
        self.log.info("task_released", reason=reason)

    async def maybe_snapshot(self) -> None:
        """Have a snapshot written when the engine's policy says so (derived data, never
        required), in the background: the step goes on at once (decision 72). One writer
        per run: a checkpoint reached while it writes leaves its state to the writer, which
        writes the latest such state next if the policy still finds it due then."""
        policy = self.services.snapshot_policy
        if self.head_seq - self.last_snapshot_seq < policy.spacing(self.last_snapshot_seq):
            return  # Cheap test first: the policy itself needs a copy of the state.
        state = self.state
        if not policy.due(state, self.last_snapshot_seq):
            return
        self._snapshot_next = state
        if self._snapshot_writer is None or self._snapshot_writer.done():
            self._snapshot_writer = asyncio.create_task(self._write_snapshots(),
                                                        name=f"snapshot:{self.task_id}")

    async def _write_snapshots(self) -> None:
        from wal_engine.runtime.resume import save_snapshot

        policy = self.services.snapshot_policy
        while self._snapshot_next is not None:
            state, self._snapshot_next = self._snapshot_next, None
            if not policy.due(state, self.last_snapshot_seq):
                continue  # Too close to the snapshot just written.
            try:
                await save_snapshot(self.services.database, state,
                                    keep_latest=policy.keep_latest,
                                    segments=self.snapshot_segments, encode_off_loop=True)
            except Exception as error:  # Derived data: a later checkpoint tries again.
                self.log.warning("snapshot_failed", seq=state.last_seq,
                                 error=self.redact_text(repr(error)))
                continue
            self.last_snapshot_seq = max(self.last_snapshot_seq, state.last_seq)

    async def settle_snapshot(self) -> None:
        """Wait for the snapshot being written, if any (a run leaves no writer behind);
        cancel it instead when the worker goes away without a drain."""
        writer, self._snapshot_writer = self._snapshot_writer, None
        if writer is None:
            return
        if self.stop_forced:
            writer.cancel()
        try:
            await asyncio.wait([writer])  # Its failure is its own (logged there).
        except asyncio.CancelledError:
            writer.cancel()
            raise

    def adopt_append(self, event: ev.Event, result: Any) -> None:
        """Take over an append made inside a caller's transaction (exactly-once effects)."""
        assert self.builder is not None
        self.builder.apply(event)
        self._state_cache = None
        self.head_seq, self.head_hash = result.head_seq, result.head_hash
        structlog.contextvars.bind_contextvars(seq=result.head_seq)


_LARGE_VALUE_EVENTS: Final = frozenset({
    ev.ToolCallCompleted, ev.LlmCallCompleted, ev.MessageAppended, ev.TaskCompleted,
    ev.ToolCallIntended, ev.LlmCallIntended, ev.ValueRecorded, ev.StepCheckpointed,
    ev.SignalReceived})
"""Events whose user value may be large (results, responses, messages, outputs): their size
is counted before redaction, to redact a large one off the loop."""

_STAYING: Final = frozenset({None, *LEASED})
"""Target statuses of events after which the run still holds its lease (None: no move)."""

_OUTCOMES: Final = (ev.ToolCallCompleted, ev.ToolCallFailed, ev.LlmCallCompleted,
                    ev.LlmCallFailed)
"""Events that record what an effect did: kept while their append is in doubt."""


def _interruption_text(error: BaseException, run: TaskRun) -> str:
    """What ``run_interrupted`` records of the error: the reason, without the database's
    address (host, port and database name belong in the worker's logs, not in every task's
    durable history)."""
    text = error.reason if isinstance(error, DatabaseUnavailable) else str(error)
    return run.redact_text(text)[:500]


def is_internal(call: Any) -> bool:
    """Whether a call record belongs to the engine's own waits, not to the agent's code."""
    return bool(call.call_id.startswith(INTERNAL_PREFIX) or call.name.startswith(INTERNAL_PREFIX))


def _budget_fields(budget: ev.Budget) -> dict[str, Any]:
    return {name: getattr(budget, name) for name in budget.__struct_fields__}


def is_terminal(status: Status | None) -> bool:
    """Whether ``status`` is COMPLETED or FAILED."""
    return status in TERMINAL
