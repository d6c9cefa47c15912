"""A Hypothesis state machine that crash-tests your agents against a real PostgreSQL.

Point it at the function that registers your agents and a strategy of submissions; every
generated program runs on a fresh database with in-process workers and applies rules in a
random order: submit tasks, run workers, crash a worker at a drawn failpoint (the task run
is abandoned there with no cleanup, :mod:`wal_engine.failpoints`), expire leases (a zombie
is fenced), start, stop and kill background workers, answer signals, and make durable
timers due. After every rule the invariants are checked (seqs contiguous, chains verify,
epochs fence, nothing after a terminal event, no idempotency key acted twice, no effect
without its durable intent, no acknowledged append lost); at the end every task is driven
to its end and its final state must equal the crash-free run of the same agent and input.

Hypothesis rules are synchronous, so each program owns one :class:`asyncio.Runner` and
every rule runs its coroutine on it (RELIABILITY.md finding 9). Example::

    from hypothesis import strategies as st
    from wal_engine.testing import AgentUnderTest, Submission, run_crash_machine

    def test_my_agent_survives_crashes(wal_database_factory):
        stats = run_crash_machine(AgentUnderTest(
            register=my_app.register_agents,
            submissions=st.builds(Submission, agent=st.just("billing"),
                                  input=st.fixed_dictionaries({"amount": st.integers(1, 9)})),
        ), wal_database_factory)
        print(stats)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from replay.state import AgentState, CallStatus
from wal_engine import failpoints
from wal_engine.errors import ConfigurationError
from wal_engine.payloads import encode_payload
from wal_engine.store import EventRecord
from wal_engine.testing.crash import (
    FAST_TIMINGS,
    POINTS,
    Responder,
    advance_timers,
    crash_at,
    default_responder,
    deliver_signals,
    drive_to_quiescence,
    expire_leases,
    open_database,
    open_tasks,
    outcome,
    run_crash_free_many,
    run_worker_until_idle,
)
from wal_engine.testing.invariants import (
    AckRecorder,
    InvariantViolation,
    Violation,
    check_acknowledged,
    check_snapshot,
    read_snapshot,
)
from wal_engine.testing.ledger import (
    READ_EFFECTS_IF_PRESENT,
    EffectLedger,
    check_effect_rows,
    effect_rows,
    totals,
)

if TYPE_CHECKING:
    from wal_engine.engine import Engine
    from wal_engine.runtime.worker import Worker
    from wal_engine.store import Database
    from wal_engine.testing.postgres import DatabaseFactory

T = TypeVar("T")

PROFILE_ENV: Final = "WAL_ENGINE_CRASH_PROFILE"
OBSERVER_SESSION: Final = "wal-test-observer"
PROFILES: Final = {
    "crash-quick": (24, 10),
    "crash-dev": (20, 10),
    "crash-ci": (260, 12),
    "crash-deep": (3000, 30),
}
"""Hypothesis profiles for the machine (examples, steps per program): the quick one is sized
to finish a one-tool agent in under 30 s on 2 cores (a user's per-commit test), the CI one
for >= 1,000 fired crash points per run on the project's demo agent, the deep one for
nightly runs."""


def register_profiles() -> None:
    """Register the ``crash-*`` Hypothesis profiles (idempotent)."""
    for name, (examples, steps) in PROFILES.items():
        settings.register_profile(
            name, max_examples=examples, stateful_step_count=steps, deadline=None,
            derandomize=name != "crash-deep", print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                   HealthCheck.function_scoped_fixture,
                                   HealthCheck.data_too_large],
        )


def crash_settings(profile: str | None = None) -> settings:
    """Settings of ``WAL_ENGINE_CRASH_PROFILE`` when set (it overrides ``profile``, so that
    one environment variable turns every crash test of a suite deep or quick), else of
    ``profile``, else ``crash-deep`` when ``RELIABILITY_DEEP=1``, else ``crash-ci``.

    Raises:
        ConfigurationError: the chosen name is not a registered Hypothesis profile.
    """
    register_profiles()
    chosen = os.environ.get(PROFILE_ENV) or profile or (
        "crash-deep" if os.environ.get("RELIABILITY_DEEP") == "1" else "crash-ci")
    try:
        return settings.get_profile(chosen)
    except InvalidArgument as exc:
        raise ConfigurationError(
            f"unknown crash profile {chosen!r} (profile= or {PROFILE_ENV}); the built-in "
            f"ones are {', '.join(PROFILES)}") from exc


@dataclass(frozen=True)
class Submission:
    """One task to submit: the agent's name and its input."""

    agent: str
    input: Any = None


def had_doubt(state: AgentState) -> bool:
    """Whether a call of the task was escalated (``tool_call_uncertain``): left uncertain,
    reconciled by a human, or the reason the task failed."""
    failed_in_doubt = state.failure is not None and \
        state.failure.reason == "uncertain_side_effect"
    return failed_in_doubt or any(
        call.status is CallStatus.UNCERTAIN
        or (call.error is not None and call.error.error_type == "Reconciled")
        for call in state.calls.values())


HAND_OFFS: Final = frozenset({"task_orphaned", "task_resumed", "run_interrupted"})
"""Records after which a run re-runs agent code against a history it did not all write."""


def allow_escalated(state: AgentState, history: list[EventRecord]) -> bool:
    """The one outcome allowed to differ from the crash-free run: a task that failed because
    a crash left a non-idempotent call in doubt (``tool_call_uncertain``), which the engine
    must escalate instead of re-running (RELIABILITY.md R3). The run that found the call in
    doubt came after a hand-off (``task_orphaned``, ``task_resumed``) or after its own lost
    connection (``run_interrupted``: the same lease, the code re-run from the top)."""
    return (state.failure is not None and state.failure.reason == "uncertain_side_effect"
            and any(r.type == "tool_call_uncertain" for r in history)
            and any(r.type in HAND_OFFS for r in history))



@dataclass
class AgentUnderTest:
    """What the machine needs to know about your agents.

    Attributes:
        register: ``register(engine)`` (sync or async) registers your agents on the engine
            and creates whatever tables your fakes use. Fakes from
            :class:`~wal_engine.testing.ledger.EffectLedger` are counted automatically.
        submissions: Strategy of :class:`Submission` values.
        signals: Payloads to send to tasks waiting for a named signal (approvals are
            approved and escalated calls reconciled as failed automatically).
        project: What of a final state must equal the crash-free run's (default
            :func:`~wal_engine.testing.crash.outcome`).
        degraded: Final states allowed to differ from the crash-free run (default: a
            non-idempotent call escalated after a crash).
        effects_query: SQL returning ``key, tool, deliveries, applied`` (and optionally
            ``tool_class``) for fakes that are not the ledger's; default: the ledger.
        tasks_max: Most tasks one program submits.
        faults_max: Most crashes and kills in one program (more rules still run).
        timings: Worker timings of every worker the machine runs (default
            :data:`~wal_engine.testing.crash.FAST_TIMINGS`: leases end only when a rule
            expires them).
        responder: ``responder(engine, signals)`` answers waiting tasks (default
            :func:`~wal_engine.testing.crash.default_responder`).
        finish: ``await finish(engine, tasks)`` after every task ended: more checks of your
            own over the program's ``(task_id, submission)`` pairs, as violations.
        observe: Called with every worker after it ran (to read its figures).
    """

    register: Callable[[Engine], Any]
    submissions: st.SearchStrategy[Submission]
    signals: dict[str, Any] = field(default_factory=dict)
    project: Callable[[AgentState], Any] = outcome
    degraded: Callable[[AgentState, list[EventRecord]], bool] = allow_escalated
    effects_query: str | None = None
    tasks_max: int = 3
    faults_max: int = 40
    timings: dict[str, Any] = field(default_factory=lambda: dict(FAST_TIMINGS))
    responder: Callable[[Engine, dict[str, Any]], Responder] | None = None
    finish: Callable[[Engine, list[tuple[str, Submission]]],
                     Awaitable[list[Violation]]] | None = None
    observe: Callable[[Worker], None] | None = None


@dataclass
class MachineStats:
    """Figures accumulated over every program the machine ran."""

    programs: int = 0
    rules: int = 0
    tasks: int = 0
    crash_points_tried: int = 0
    crash_points_fired: int = 0
    fired_by_point: dict[str, int] = field(default_factory=dict)
    kills: int = 0
    leases_broken: int = 0
    timers_advanced: int = 0
    signals_sent: int = 0
    effect_keys: int = 0
    deliveries: int = 0
    applied: int = 0
    stale_rejected: int = 0
    acknowledged_appends: int = 0
    degraded: int = 0
    violations: int = 0

    def __str__(self) -> str:
        points = ", ".join(f"{k}={v}" for k, v in sorted(self.fired_by_point.items()))
        return (f"{self.programs} programs, {self.rules} rules, {self.tasks} tasks; crash "
                f"points tried {self.crash_points_tried}, fired {self.crash_points_fired} "
                f"({points}); {self.kills} worker kills, {self.leases_broken} leases broken, "
                f"{self.timers_advanced} timers advanced, {self.signals_sent} signals; "
                f"effects: {self.effect_keys} keys, {self.deliveries} deliveries, "
                f"{self.applied} applied, {self.stale_rejected} stale refused; "
                f"{self.acknowledged_appends} acknowledged appends checked; "
                f"{self.degraded} escalated outcomes; violations {self.violations}")


connect_pool_size: Final = 8
rule_timeout_s: Final = 30.0
background_stop_s: Final = 10.0


def crash_machine(config: AgentUnderTest, factory: DatabaseFactory,
                  stats: MachineStats | None = None) -> type[RuleBasedStateMachine]:
    """The state machine class for ``config`` on databases made by ``factory``."""
    figures = stats if stats is not None else MachineStats()
    crash_schedules = st.lists(st.tuples(st.sampled_from(POINTS), st.integers(1, 3)),
                               min_size=1, max_size=10)
    crash_free: dict[tuple[str, bytes], tuple[Any, bool]] = {}

    class AgentCrashMachine(RuleBasedStateMachine):
        """Crash, fence and resume the agent's tasks; check every invariant after each rule."""

        def __init__(self) -> None:
            super().__init__()
            # A private loop: the thread's current loop (pytest-asyncio's) stays untouched.
            self.runner = asyncio.Runner(loop_factory=asyncio.new_event_loop)
            self.dsn = ""
            self.engine: Engine | None = None
            # The checker's own session: not one of the engine's (its name does not match
            # 'wal-engine:%'), so a call that simulates a lost database by ending every engine
            # session cannot end the checker's reads in the middle of an invariant.
            self.observer: Database | None = None
            self.tasks: list[tuple[str, Submission]] = []
            self.background: dict[int, tuple[Worker, asyncio.Task[None]]] = {}
            # Preconditions may only read what the drawn program decided (attempts, user
            # submissions), never outcomes that depend on timing: Hypothesis replays programs.
            self.faults = 0
            self.submitted = 0
            self.resubmitted = 0
            self.acks = AckRecorder()
            self.responder: Responder | None = None
            figures.programs += 1
            self.run(self._open())

        # -------------------------------------------------------------- plumbing

        def run(self, work: Coroutine[Any, Any, T]) -> T:
            return self.runner.run(work)

        @property
        def live(self) -> Engine:
            assert self.engine is not None
            return self.engine

        @property
        def checker(self) -> Database:
            assert self.observer is not None
            return self.observer

        async def _open(self) -> None:
            from wal_engine.engine import connect

            self.dsn = await factory.create()
            self.engine = await connect(self.dsn, migrate=False, pool_size_max=connect_pool_size)
            self.observer = await open_database(self.dsn, pool_size_max=2,
                                                application_name=OBSERVER_SESSION)
            await EffectLedger.for_engine(self.engine).prepare()
            registered = config.register(self.engine)
            if inspect.isawaitable(registered):
                await registered
            self.acks.install(self.engine)
            make_responder = config.responder or default_responder
            self.responder = make_responder(self.engine, config.signals)

        def _ids(self) -> list[str]:
            return [task_id for task_id, _ in self.tasks]

        def _ledger_tools(self) -> dict[str, str]:
            return dict(EffectLedger.for_engine(self.live).tools)

        async def _worker_run(self, slot: int, concurrency: int) -> None:
            try:
                worker = await run_worker_until_idle(
                    self.live, worker_id=f"w{slot}", concurrency=concurrency,
                    timeout_s=rule_timeout_s, **config.timings)
                if config.observe is not None:
                    config.observe(worker)
            except TimeoutError as error:
                self._fail([Violation(invariant="I11",
                                      detail=f"worker w{slot} still busy after "
                                             f"{rule_timeout_s} s")], error)

        def _fail(self, violations: list[Violation], cause: BaseException | None = None
                  ) -> None:
            figures.violations += len(violations)
            raise InvariantViolation(violations, f"program {figures.programs}") from cause

        # -------------------------------------------------------------- rules

        @initialize(submissions=st.lists(config.submissions, min_size=1,
                                         max_size=max(1, config.tasks_max - 1)))
        def submit_first(self, submissions: list[Submission]) -> None:
            for submission in submissions:
                self._submit(submission)

        @precondition(lambda self: self.submitted < config.tasks_max)
        @rule(submission=config.submissions)
        def submit(self, submission: Submission) -> None:
            self._submit(submission)

        def _submit(self, submission: Submission) -> None:
            task_id = f"task-{len(self.tasks) + 1}"
            self.run(self.live.submit(submission.agent, submission.input, task_id=task_id))
            self.tasks.append((task_id, submission))
            self.submitted += 1
            figures.tasks += 1
            figures.rules += 1

        @rule(slot=st.integers(0, 2), concurrency=st.integers(1, 4))
        def run_worker(self, slot: int, concurrency: int) -> None:
            self.run(self._worker_run(slot, concurrency))
            figures.rules += 1

        @precondition(lambda self: self.faults < config.faults_max)
        @rule(slot=st.integers(0, 2), point=st.sampled_from(POINTS), nth=st.integers(1, 3))
        def crash_worker(self, slot: int, point: str, nth: int) -> None:
            self._crash(slot, point, nth)

        @precondition(lambda self: self.faults < config.faults_max)
        @rule(schedule=crash_schedules)
        def recover_then_crash(self, schedule: list[tuple[str, int]]) -> None:
            """Make every task runnable, crash a worker at the point; again for each entry,
            checking every invariant after each crash."""
            for point, nth in schedule:
                self.run(self._make_runnable())
                self._crash(0, point, nth)
                self.every_invariant_holds()

        @precondition(lambda self: self.faults < config.faults_max)
        @rule(schedule=crash_schedules)
        def crash_again(self, schedule: list[tuple[str, int]]) -> None:
            """The same as :meth:`recover_then_crash` (a second rule doubles how often
            crash schedules are drawn among the other rules)."""
            self.recover_then_crash(schedule)

        def _crash(self, slot: int, point: str, nth: int) -> None:
            if (self.resubmitted < 4 * config.tasks_max
                    and len(self.run(open_tasks(self.live, self._ids()))) < 2):
                # (Nearly) everything finished: resubmit the first input, so that the crash
                # has work to hit. (Not counted as a submission: see __init__.)
                self._submit(self.tasks[0][1])
                self.submitted -= 1
                self.resubmitted += 1
            with crash_at(point, nth) as report:
                self.run(self._worker_run(slot, 4))
            figures.crash_points_tried += 1
            figures.rules += 1
            self.faults += 1
            if report.fired:
                figures.crash_points_fired += 1
                figures.fired_by_point[point] = figures.fired_by_point.get(point, 0) + 1
            note(f"crash {point}:{nth} on w{slot}: {'fired' if report.fired else 'not reached'}")

        async def _make_runnable(self) -> None:
            figures.leases_broken += await expire_leases(self.live)
            figures.timers_advanced += await advance_timers(self.live)
            assert self.responder is not None
            figures.signals_sent += await deliver_signals(self.live, self.responder)

        @rule()
        def expire_all_leases(self) -> None:
            figures.leases_broken += self.run(expire_leases(self.live))
            figures.rules += 1

        @rule()
        def advance_durable_timers(self) -> None:
            figures.timers_advanced += self.run(advance_timers(self.live))
            figures.rules += 1

        @rule()
        def send_signals(self) -> None:
            assert self.responder is not None
            figures.signals_sent += self.run(deliver_signals(self.live, self.responder))
            figures.rules += 1

        @precondition(lambda self: len(self.background) < 2)
        @rule(slot=st.sampled_from([1, 2]))
        def start_background_worker(self, slot: int) -> None:
            if slot in self.background:
                return

            async def start() -> None:
                worker = self.live.worker(concurrency=2, worker_id=f"bg{slot}",
                                          **config.timings)
                task = asyncio.get_running_loop().create_task(worker.run())
                self.background[slot] = (worker, task)
                await asyncio.sleep(0.01)

            self.run(start())
            figures.rules += 1

        @precondition(lambda self: bool(self.background))
        @rule(delay_ms=st.integers(0, 60))
        def let_background_run(self, delay_ms: int) -> None:
            self.run(asyncio.sleep(delay_ms / 1000))
            figures.rules += 1

        @precondition(lambda self: bool(self.background))
        @rule(data=st.data())
        def stop_background_worker(self, data: st.DataObject) -> None:
            slot = data.draw(st.sampled_from(sorted(self.background)))
            self.run(self._stop_background(slot))
            figures.rules += 1

        @precondition(lambda self: bool(self.background) and self.faults < config.faults_max)
        @rule(data=st.data())
        def kill_background_worker(self, data: st.DataObject) -> None:
            """Cancel the worker abruptly (its runs unwind at their current await)."""
            slot = data.draw(st.sampled_from(sorted(self.background)))
            _, task = self.background.pop(slot)
            task.cancel()

            async def reap() -> None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(task, background_stop_s)

            self.run(reap())
            self.faults += 1
            figures.kills += 1
            figures.rules += 1

        async def _stop_background(self, slot: int) -> None:
            worker, task = self.background.pop(slot)
            worker.stop()
            try:
                await asyncio.wait_for(task, background_stop_s)
            except TimeoutError as error:
                self._fail([Violation(invariant="I11", detail=f"bg{slot} did not stop within "
                                                              f"{background_stop_s} s")], error)
            if config.observe is not None:
                config.observe(worker)

        # -------------------------------------------------------------- invariants

        @invariant()
        def every_invariant_holds(self) -> None:
            self._fail_on(self.run(self._violations()))

        def _fail_on(self, violations: list[Violation]) -> None:
            if violations:
                self._fail(violations)

        async def _violations(self) -> list[Violation]:
            query = config.effects_query or READ_EFFECTS_IF_PRESENT
            snapshot = await read_snapshot(self.checker, extra={"effects": query})
            rows = effect_rows(snapshot.extra["effects"])
            violations = check_snapshot(snapshot)
            violations += check_effect_rows(rows, snapshot.events,
                                            completed_tools=self._ledger_tools())
            violations += await check_acknowledged(self.checker, self.acks.acknowledged)
            return violations

        # -------------------------------------------------------------- the end

        def teardown(self) -> None:
            try:
                if self.engine is not None:
                    self.run(self._finish())
            finally:
                failpoints.disarm()
                with contextlib.suppress(Exception):
                    self.run(self._close())
                self.runner.close()

        async def _finish(self) -> None:
            for slot in list(self.background):
                await self._stop_background(slot)
            assert self.responder is not None
            left = await drive_to_quiescence(self.live, self._ids(), responder=self.responder,
                                             deadline_s=rule_timeout_s, **config.timings)
            if left:
                self._fail([Violation(invariant="I11", task_id=task_id,
                                      detail="not terminal after faults stopped")
                            for task_id in left])
            violations = await self._violations()
            violations += await self._compare_with_crash_free()
            if config.finish is not None:
                violations += await config.finish(self.live, list(self.tasks))
            snapshot = await read_snapshot(self.checker,
                                           extra={"effects": config.effects_query
                                                  or READ_EFFECTS_IF_PRESENT})
            sums = totals(effect_rows(snapshot.extra["effects"]))
            figures.effect_keys += sums.keys
            figures.deliveries += sums.deliveries
            figures.applied += sums.applied
            figures.stale_rejected += sums.stale_rejected
            figures.acknowledged_appends += len(self.acks.acknowledged)
            self._fail_on(violations)

        async def _compare_with_crash_free(self) -> list[Violation]:
            await self._run_crash_free([submission for _, submission in self.tasks])
            violations = []
            for task_id, submission in self.tasks:
                state = await self.live.state(task_id)
                expected, reference_in_doubt = crash_free[_crash_free_key(submission)]
                if config.project(state) == expected:
                    continue
                # Where the crash-free run itself had a call in doubt (escalated), another
                # path through the same doubt is allowed too (a crash may let a lookup
                # find what the crash-free run had to ask a human for).
                if reference_in_doubt or config.degraded(
                        state, await self.live.history(task_id)):
                    figures.degraded += 1
                    continue
                violations.append(Violation(
                    invariant="I8", task_id=task_id,
                    detail=f"final state differs from the crash-free run: "
                           f"{config.project(state)!r} != {expected!r}"))
            return violations

        async def _run_crash_free(self, submissions: list[Submission]) -> None:
            """The crash-free runs not made yet, side by side (one per distinct input)."""
            missing: dict[tuple[str, bytes], Submission] = {}
            for submission in submissions:
                key = _crash_free_key(submission)
                if key not in crash_free:
                    missing.setdefault(key, submission)
            if not missing:
                return
            first = len(crash_free) + 1
            states = await run_crash_free_many(
                self.live, [(s.agent, s.input, f"crash-free-{first + n}")
                            for n, s in enumerate(missing.values())],
                responder=self.responder, **config.timings)
            for key, state in zip(missing, states, strict=True):
                crash_free[key] = (config.project(state), had_doubt(state))

        async def _close(self) -> None:
            for _, task in self.background.values():
                task.cancel()
            if self.engine is not None:
                await EffectLedger.for_engine(self.engine).close()
                await asyncio.wait_for(self.engine.close(), 10)
            if self.observer is not None:
                await asyncio.wait_for(self.observer.close(), 10)
            if self.dsn:
                await factory.drop(self.dsn)

    return AgentCrashMachine


def _crash_free_key(submission: Submission) -> tuple[str, bytes]:
    return submission.agent, encode_payload(submission.input)


def run_crash_machine(config: AgentUnderTest, factory: DatabaseFactory, *,
                      profile: str | None = None, settings_: settings | None = None
                      ) -> MachineStats:
    """Run the machine for ``config`` as a test (see the module docstring); return figures.

    Fails with the shrunk program on the first violated invariant.
    """
    stats = MachineStats()
    machine = crash_machine(config, factory, stats)
    run_state_machine_as_test(machine, settings=settings_ or crash_settings(profile))
    return stats
