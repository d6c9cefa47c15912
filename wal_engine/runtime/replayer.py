"""Check today's agent code against a recorded history, with no side effect and no write.

The agent function runs from the top, as a worker would run it after a resume, but with a
replay-only task run: every external call it makes is answered from the history by the
journal cursor (nothing is called), every command already recorded is matched by its
ordinal, and the first thing the code asks for that the history does not hold (a new call,
an in-doubt call that a worker would retry, a new message or checkpoint) stops the run with
:class:`ReplayFinished` instead of acting or writing. Nothing here reaches the database once
the history is read: the replay's run (a :class:`~wal_engine.runtime.ports.Run` of its own,
not a worker's task run) has no services, and stops the code if it asks for them.

The outcome is a :class:`ReplayReport`: the first non-determinism (a different call or
command, fewer calls than recorded, calls past a history whose code had ended, or another
ending than the recorded one), or how far today's code went.

Three entry points, from the most to the least I/O:

* :func:`check_history` reads a task's log (no snapshot: the log itself is checked) and
  replays it against an engine's agents or any registry;
* :func:`replay_events` replays recorded events (a golden history kept as a test fixture);
* :func:`replay_state` replays a folded :class:`~replay.state.AgentState`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import msgspec
import orjson

from replay.divergence import CallSignature, NonDeterminismError
from replay.fold import FoldItem, StateBuilder, fold
from replay.journal import Fresh, InDoubt, Journal, Outcome, Recorded, Retry
from replay.state import AgentState, CallKind, budget_usage
from wal_engine import events as ev
from wal_engine import limits
from wal_engine.budgets import BudgetTrip, Usage
from wal_engine.errors import ConfigurationError, InvalidPayload
from wal_engine.observability.logs import get_logger
from wal_engine.runtime.ports import RunServices
from wal_engine.runtime.run import error_text_max, is_internal
from wal_engine.runtime.worker import WorkerConfig
from wal_engine.security.redaction import (
    NameForms,
    Redactor,
    default_redactor,
    redact_bounded,
    redact_text,
)
from wal_engine.state_machine import Status
from wal_engine.store import Store

if TYPE_CHECKING:
    from wal_engine.runtime.context import AgentContext
    from wal_engine.store import Database

replay_timeout_s_default: Final = 60.0
"""Longest a replay may run; agent code that waits on something outside ``ctx`` stops."""

CODE_ENDED_FAILURE: Final = "agent_error"
"""The ``task_failed`` reason of a task whose code raised (the code ended it, not the engine)."""

AgentFunction = Callable[["AgentContext", Any], Awaitable[Any]]
ProgressCallback = Callable[[str, int, int], None]
"""``(phase, done, total)``: phase ``events`` while the log is read, ``calls`` while replaying."""


class ReplaySource(Protocol):
    """What a replay reads of an engine (:class:`~wal_engine.engine.Engine` is one): its
    store, its session pool and its registered agents, which are the code checked."""

    @property
    def store(self) -> Store: ...

    @property
    def database(self) -> Database: ...

    @property
    def agents(self) -> Mapping[str, Any]: ...


class ReplayFinished(BaseException):
    """Unwinds agent code where it would act or write past the recorded history.

    A BaseException so that agent code's ``except Exception`` cannot swallow it.
    """

    def __init__(self, reason: str, seq: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.seq = seq


class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    """Where today's code and the history part.

    ``kind`` is ``call`` (another external call, or fewer or more of them), ``command``
    (another message, checkpoint, environment or plan change), or ``ending`` (the history
    ends another way than today's code: it completed where the code raises, or the reverse).
    """

    kind: str
    seq: int
    fork_point: int
    """The last seq before the divergence: fork there to continue with today's code."""
    detail: str
    call_index: int | None = None
    recorded: str | None = None
    requested: str | None = None


class ReplayReport(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of replaying one task's history against today's code.

    ``outcome`` is one of ``completed`` (the code returned), ``failed`` (the code raised),
    ``reached_end`` (the code got past the recorded history, see ``stopped_at``),
    ``diverged`` (see ``divergence``) or ``timed_out``.
    """

    task_id: str
    agent: str
    events: int
    recorded_status: str
    calls_recorded: int
    calls_replayed: int
    outcome: str
    divergence: Divergence | None = None
    stopped_at: str | None = None
    error: str | None = None
    output_matches: bool | None = None
    """For a completed history and code that returned: whether the outputs are equal."""

    @property
    def ok(self) -> bool:
        """Whether today's code is consistent with the history."""
        return self.divergence is None and self.outcome != "timed_out"


# ----------------------------------------------------------------------------- the run

_CALL_KINDS: Final = frozenset(kind.value for kind in CallKind)

_UNRECORDED: Final[dict[type, str]] = {
    Fresh: "past the recorded history",
    InDoubt: "in doubt in the history (intended, no outcome)",
    Retry: "due for another attempt in the history",
}


class _ReplayJournal(Journal):
    """The journal cursor that answers only from the history and stops anything else."""

    def __init__(self, state: AgentState, *, closed: bool,
                 on_progress: ProgressCallback | None, name_form: NameForms) -> None:
        calls = [call for call in state.calls.values() if not is_internal(call)]
        super().__init__(calls, end_seq=state.last_seq, closed=closed, task_id=state.task_id,
                         name_form=name_form)
        self._names = name_form
        self.total = len(calls)
        self.replayed = 0
        self.first_divergence: NonDeterminismError | None = None
        self._on_progress = on_progress

    def next_call(self, kind: CallKind | str, name: str, args_hash: str = "") -> Outcome:
        try:
            outcome = super().next_call(kind, name, args_hash)
        except NonDeterminismError as error:
            self.diverged(error)
            raise
        if isinstance(outcome, Recorded):
            self.replayed += 1
            if self._on_progress is not None:
                self._on_progress("calls", self.replayed, self.total)
            return outcome
        where = _UNRECORDED.get(type(outcome), "not recorded")
        raise ReplayFinished(
            f"{kind} {self._names(name)!r} is {where}: a worker would act here", self.end_seq)

    def finish(self) -> None:
        try:
            super().finish()
        except NonDeterminismError as error:
            self.diverged(error)
            raise

    def diverged(self, error: NonDeterminismError) -> None:
        """Keep the first divergence, even if agent code catches the error."""
        if self.first_divergence is None:
            self.first_divergence = error


class _ReplayRun:
    """The run a replay gives agent code: it holds the whole recorded history, holds no
    lease, and may never append, act or reach the database.

    It hashes call arguments with the default redactor and the default payload cap, as a
    default worker does (a history recorded with another redactor is checked by an engine
    of its own, whose agents give the code)."""

    epoch = 0
    worker_id = "replay"
    executor: Executor | None = None
    lease_ttl_ms = WorkerConfig().lease_ttl_ms
    redactor: Redactor = default_redactor

    def __init__(self, state: AgentState, journal: _ReplayJournal, code_ended: bool,
                 names: NameForms) -> None:
        self.task_id = state.task_id
        self.redact_name = names
        self.head_seq = state.last_seq
        self.head_hash = state.last_hash
        self.builder = StateBuilder(state)
        self.journal: Journal | None = journal
        self.replay_journal = journal
        self.code_ended = code_ended
        self.last_appended: list[ev.Event] = []
        self.log = get_logger(__name__).bind(task_id=state.task_id, replay=True)
        self.stop_forced = False
        """A replay runs no call (never waits for a thread): kept for the Run protocol."""
        self._state_cache: AgentState | None = None

    @property
    def services(self) -> RunServices:
        """A replay has none: code that needs them would act past the history."""
        raise ReplayFinished("the code needs the engine's services: a worker would act here",
                             self.view.last_seq)

    @property
    def state(self) -> AgentState:
        if self._state_cache is None:
            self._state_cache = self.builder.state()
        return self._state_cache

    @property
    def view(self) -> Any:
        return self.builder.view

    @property
    def status(self) -> Status | None:
        status: Status | None = self.builder.view.status
        return status

    def fence(self, reason: str) -> None:
        raise ReplayFinished(f"the run would stop here ({reason})", self.view.last_seq)

    def check_live(self) -> None:
        return None  # A replay is never fenced: it holds no lease to lose.

    def lease_trusted(self) -> bool:
        return False  # A replay never acts; were it to try, it would start no effect.

    def redact(self, value: Any) -> Any:
        return redact_bounded(self.redactor, value, limits.payload_bytes_max)

    def redact_text(self, text: str) -> str:
        return redact_text(self.redactor, text[:limits.payload_bytes_max])

    async def append(self, events: Sequence[ev.Event], *, redacted: bool = False) -> None:
        kind = ev.event_type(events[0])
        seq = self.view.last_seq
        if self.code_ended:
            error = NonDeterminismError(
                seq=seq, recorded=None, requested=CallSignature(kind="command", name=kind),
                fork_point=seq - 1, call_index=self.replay_journal.position,
                task_id=self.task_id)
            self.replay_journal.diverged(error)
            raise error
        raise ReplayFinished(f"{kind} past the recorded history: a worker would write it", seq)

    async def store_result_or_failure(self, success: ev.Event,
                                      failure: ev.Event) -> ev.Event | None:
        await self.append([success])
        return None

    def adopt_append(self, event: ev.Event, result: Any) -> None:
        raise ReplayFinished("an effect would commit here", self.view.last_seq)

    def usage(self) -> Usage:
        return budget_usage(self.view)  # No runtime: the replay is not the task's run.

    def check_budget(self, *, at_claim: bool = False, planned_tool_calls: int = 0,
                     starting_step: bool = False) -> BudgetTrip | None:
        return None  # A budget trip would write; the history already holds any trip.

    async def check_tenant_spend(self) -> BudgetTrip | None:
        return None  # As for the task's own budgets: the history holds any trip.

    async def add_tenant_spend(self, cost_usd: float) -> None:
        raise ReplayFinished("the code would add to the tenant's spend", self.view.last_seq)

    async def fail_budget(self, trip: BudgetTrip) -> None:
        raise ReplayFinished(f"the code would trip a budget ({trip.budget})",
                             self.view.last_seq)

    async def fail(self, reason: str, error: BaseException | None,
                   diagnostic_extra: dict[str, Any] | None = None) -> None:
        raise ReplayFinished(f"the code would fail the task ({reason})", self.view.last_seq)

    async def release_if_requested(self) -> None:
        return None  # Nothing asks a replay to stop at a durable point.

    async def maybe_snapshot(self) -> None:
        return None

    async def run_hook(self, hook: str, reason: str, detail: Any = None) -> None:
        return None  # Hooks belong to a worker's runs: a replay calls none.


class _Ending(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    output: Any = None
    error: BaseException | None = None
    finished: ReplayFinished | None = None


async def _drive(function: AgentFunction, context: AgentContext, agent_input: Any,
                 journal: _ReplayJournal) -> _Ending:
    """Run the agent; every way it can end becomes a value (nothing crosses a task)."""
    try:
        output = await function(context, agent_input)
        journal.finish()
        context.finish_commands()
    except ReplayFinished as finished:
        return _Ending(kind="reached_end", finished=finished)
    except NonDeterminismError as error:
        journal.diverged(error)
        return _Ending(kind="diverged", error=error)
    except Exception as error:
        return _Ending(kind="failed", error=error)
    return _Ending(kind="completed", output=output)


def _code_ended(state: AgentState) -> bool:
    """Whether the agent code itself ended the history (returned, or raised)."""
    if state.status is Status.COMPLETED:
        return True
    failure = state.failure
    return (state.status is Status.FAILED and failure is not None
            and not failure.cancelled and failure.reason == CODE_ENDED_FAILURE)


def _divergence_of(error: NonDeterminismError) -> Divergence:
    requested = error.requested
    signature = error.recorded or requested
    kind = "call" if signature is not None and signature.kind in _CALL_KINDS else "command"
    return Divergence(
        kind=kind, seq=error.seq, fork_point=error.fork_point, detail=str(error),
        call_index=error.call_index,
        recorded=None if error.recorded is None else str(error.recorded),
        requested=None if requested is None else str(requested),
    )


def _recorded_ending(state: AgentState) -> str:
    if state.status is Status.COMPLETED:
        return "task_completed"
    failure = state.failure
    error = "" if failure is None or failure.error is None else f": {failure.error}"
    return f"task_failed ({CODE_ENDED_FAILURE}{error})"


def _ending_divergence(state: AgentState, ending: _Ending) -> Divergence | None:
    """For a history the code ended: does today's code end the same way, with the same
    output or error? With the same recorded results, deterministic code must."""
    recorded = _recorded_ending(state)
    if ending.kind == "completed" and state.status is Status.FAILED:
        detail, requested = f"the history ends with {recorded}; today's code returns", "return"
    elif ending.kind == "failed" and state.status is Status.COMPLETED:
        detail = f"the history ends with task_completed; today's code raises " \
                 f"{_describe(ending.error)}"
        requested = "raise"
    elif ending.kind == "completed" and not _same_output(state.output, ending.output):
        detail = "today's code returns another output than the recorded one"
        requested = f"return {_short_json(ending.output)}"
        recorded = f"task_completed {_short_json(state.output)}"
    elif ending.kind == "failed" and state.failure is not None and \
            state.failure.error is not None and \
            _error_text(ending.error) != state.failure.error:
        detail = "today's code raises another error than the recorded one"
        requested = f"raise {_describe(ending.error)}"
    else:
        return None
    return Divergence(kind="ending", seq=state.last_seq, fork_point=state.last_seq - 1,
                      detail=detail, recorded=recorded, requested=requested)


def _error_text(error: BaseException | None) -> str:
    """The error as the runtime records it in ``task_failed``."""
    return "" if error is None else f"{type(error).__name__}: {error}"[:error_text_max]


def _short_json(value: Any) -> str:
    try:
        text = orjson.dumps(value, default=str).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _describe(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"[:500]


def _same_output(recorded: Any, output: Any) -> bool:
    """Whether ``output`` would be stored as the recorded output (same canonical bytes)."""
    try:
        mine = ev.encode_event(ev.TaskCompleted(output=output))[2]
    except InvalidPayload:
        return False
    return mine == ev.encode_event(ev.TaskCompleted(output=recorded))[2]


def _report(state: AgentState, events: int, journal: _ReplayJournal, ending: _Ending,
            code_ended: bool) -> ReplayReport:
    divergence: Divergence | None = None
    if journal.first_divergence is not None:
        divergence = _divergence_of(journal.first_divergence)
    elif isinstance(ending.error, NonDeterminismError):
        divergence = _divergence_of(ending.error)  # A command's divergence (ctx.message).
    elif code_ended:
        divergence = _ending_divergence(state, ending)
    output_matches = None
    if ending.kind == "completed" and state.status is Status.COMPLETED:
        output_matches = _same_output(state.output, ending.output)
    return ReplayReport(
        task_id=state.task_id, agent=state.agent, events=events,
        recorded_status=str(state.status), calls_recorded=journal.total,
        calls_replayed=journal.replayed,
        outcome="diverged" if divergence is not None else ending.kind,
        divergence=divergence,
        stopped_at=None if ending.finished is None else
        f"seq {ending.finished.seq}: {ending.finished.reason}",
        error=_describe(ending.error) if ending.kind == "failed" else None,
        output_matches=output_matches,
    )


# ----------------------------------------------------------------------------- entry points


async def replay_state(
    state: AgentState,
    function: AgentFunction,
    *,
    events: int | None = None,
    timeout_s: float = replay_timeout_s_default,
    on_progress: ProgressCallback | None = None,
) -> ReplayReport:
    """Run ``function`` against the folded history ``state``; act on nothing, write nothing.

    Args:
        state: The task's state folded from its whole history.
        function: Today's agent function, ``async def agent(ctx, input)``.
        events: How many events were folded (for the report; default ``state.last_seq``).
        timeout_s: Longest the code may run (it should only ever wait on ``ctx``).
        on_progress: Called with ``("calls", replayed, recorded)`` as calls are matched.
    """
    from wal_engine.runtime.context import AgentContext

    code_ended = _code_ended(state)
    names = NameForms(_ReplayRun.redactor)
    journal = _ReplayJournal(state, closed=code_ended, on_progress=on_progress,
                             name_form=names)
    run = _ReplayRun(state, journal, code_ended, names)
    context = AgentContext(run)
    try:
        ending = await asyncio.wait_for(_drive(function, context, state.input, journal),
                                        timeout_s)
    except TimeoutError:
        return ReplayReport(
            task_id=state.task_id, agent=state.agent, events=events or state.last_seq,
            recorded_status=str(state.status), calls_recorded=journal.total,
            calls_replayed=journal.replayed, outcome="timed_out",
            error=f"the code ran longer than {timeout_s} s without reaching the end",
        )
    return _report(state, state.last_seq if events is None else events, journal, ending,
                   code_ended)


def agent_function(agents: Mapping[str, Any], name: str) -> AgentFunction:
    """The function registered as ``name`` in ``agents`` (definitions or bare functions).

    Raises:
        ConfigurationError: no agent of that name is registered.
    """
    entry = agents.get(name)
    if entry is None:
        known = ", ".join(sorted(agents)) or "none"
        raise ConfigurationError(f"agent {name!r} is not registered (registered: {known})")
    function = getattr(entry, "function", entry)
    if not callable(function):
        raise ConfigurationError(f"agent {name!r} is registered as a {type(entry).__name__}, "
                                 "not a function")
    return cast(AgentFunction, function)


async def replay_events(
    events: Iterable[FoldItem],
    agents: Mapping[str, Any] | AgentFunction,
    *,
    task_id: str = "",
    timeout_s: float = replay_timeout_s_default,
) -> ReplayReport:
    """Replay recorded events (stored rows, or ``(seq, event)`` pairs) against today's code.

    ``agents`` is a registry (name -> definition or function) or the agent function itself.
    """
    state = fold(events, task_id=task_id)
    function = agent_function(agents, state.agent) if isinstance(agents, Mapping) else agents
    return await replay_state(state, function, timeout_s=timeout_s)


async def fold_history(store: Store, task_id: str, *,
                       on_progress: ProgressCallback | None = None) -> tuple[AgentState, int]:
    """Fold a task's whole log (no snapshot), page by page; returns the state and the count.

    Raises:
        UnknownTask: no such task.
        CorruptionError: the log cannot be read or breaks the rules.
    """
    head = await store.read_head(task_id)
    builder = StateBuilder(task_id=task_id)
    folded = 0
    page_events = limits.read_page_events
    while folded < head.head_seq:
        page = await store.read_events(task_id, from_seq=folded + 1, to_seq=head.head_seq,
                                       limit=page_events)
        if not page:
            break
        builder.extend(page)
        folded += len(page)
        if on_progress is not None:
            on_progress("events", folded, head.head_seq)
    return builder.finish(), folded


async def check_history(
    source: ReplaySource | Store,
    task_id: str,
    agents: Mapping[str, Any] | None = None,
    *,
    timeout_s: float = replay_timeout_s_default,
    on_progress: ProgressCallback | None = None,
) -> ReplayReport:
    """Read ``task_id``'s log and replay it against today's code (see the module docstring).

    Args:
        source: An :class:`~wal_engine.engine.Engine` (its agents are the default registry)
            or a :class:`~wal_engine.store.Store`.
        task_id: The task to check.
        agents: Agent name -> :class:`~wal_engine.engine.AgentDefinition` or function;
            defaults to the engine's registered agents.
        timeout_s: Longest the code may run.
        on_progress: ``(phase, done, total)`` for a progress display.

    Raises:
        UnknownTask: no such task.
        ConfigurationError: the task's agent is not in the registry.
        CorruptionError: the log cannot be folded.
    """
    store = source if isinstance(source, Store) else source.store
    registry = agents if agents is not None else getattr(source, "agents", None)
    if registry is None:
        raise ConfigurationError("check_history needs the agents when given a Store")
    state, folded = await fold_history(store, task_id, on_progress=on_progress)
    function = agent_function(registry, state.agent)
    return await replay_state(state, function, events=folded, timeout_s=timeout_s,
                              on_progress=on_progress)


# ----------------------------------------------------------------------------- the deploy gate

deploy_check_live_max: Final = 100_000
"""Most live tasks one deploy check replays (bounded, like every multi-row read)."""


class DeployCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of replaying every live task (and a sample of finished ones) against the
    code about to ship."""

    checked: int
    live: int
    finished: int
    skipped: int
    """Tasks the new code would not run: their agent is not registered, or their version is
    neither the code's nor one it declares compatible (old workers drain them)."""
    divergent: list[ReplayReport]

    @property
    def ok(self) -> bool:
        """Whether every checked task replays against the new code."""
        return not self.divergent


def runs_version(definition: Any, version: str | None) -> bool:
    """Whether the registered ``definition`` would claim a task of ``version``."""
    runs = getattr(definition, "runs", None)
    return version is None or runs is None or version in runs


async def check_tasks(engine: ReplaySource, *, since: Any = None, finished_sample: int = 20,
                      timeout_s: float = replay_timeout_s_default,
                      on_task: Callable[[ReplayReport], None] | None = None) -> DeployCheck:
    """Replay every live task, and the ``finished_sample`` most recently finished ones, of
    the versions the engine's agents can run, against the engine's agents.

    Args:
        engine: An engine whose registered agents are the code about to ship (open it on
            a read-only session: nothing is written either way).
        since: Only tasks updated at or after this ``datetime`` (None: all).
        finished_sample: How many finished (COMPLETED or FAILED) tasks to check as well.
        timeout_s: Longest one task's code may run.
        on_task: Called with each task's report as it is made.
    """
    from wal_engine.store import queries

    rows = await engine.database.fetch(queries.REPLAY_CANDIDATES, since,
                                       deploy_check_live_max, finished_sample)
    reports: list[ReplayReport] = []
    skipped = live = 0
    for row in rows:
        definition = engine.agents.get(row["agent"])
        if definition is None or not runs_version(definition, row["agent_version"]):
            skipped += 1
            continue
        live += row["status"] not in ("COMPLETED", "FAILED")
        report = await check_history(engine, row["task_id"], timeout_s=timeout_s)
        reports.append(report)
        if on_task is not None:
            on_task(report)
    return DeployCheck(checked=len(reports), live=live, finished=len(reports) - live,
                       skipped=skipped, divergent=[r for r in reports if not r.ok])
