"""An effect-safety model test: agents drawn from every call kind, each call misbehaving.

Hypothesis draws tasks whose plan is a list of calls. Each call has a kind (an idempotent
tool, a tool with ``lookup``, a non-idempotent tool, an LLM call, ``ctx.transaction``), a
sync (``def``, run on the worker's thread pool) or async variant, and what its first
attempt does (:class:`~wal_engine.testing.ledger.Behaviour`): return, raise before acting
(``DidNotAct``), act then raise ``ConnectionResetError``, act then answer past its
timeout, block past the lease (1 s leases, 0.3 s heartbeat), or act then end every
database session of the worker; and what it returns: a plain value, a result the engine
cannot store (NaN, NUL, larger than the payload limit) or hostile text. The crash machine
(:mod:`wal_engine.testing.machine`) runs the tasks, crashing workers at drawn failpoints,
expiring leases, starting and killing background workers, and checks every invariant after
each rule. At the end of each program, besides the machine's checks (no key acted twice, no
effect without its intent, final states equal the crash-free run where no call was in
doubt), this module checks:

* E1: a non-idempotent call was delivered at most once, a call with ``lookup`` applied at
  most once (the ledger's I4), and every attempt of one call carried the same key;
* E2: every escalation (``tool_call_uncertain``) is recorded with a known reason that
  matches what the call did (timed out, connection lost, error after start) or the fact
  that a run ended under it (interrupted), and a ``not_before_ms``;
* E3: a non-idempotent call whose first attempt acted and then failed ambiguously was
  escalated or looked up, never recorded as a plain failure nor retried;
* E4: ``engine.reconcile`` was refused only before the escalation's ``not_before_ms``.

Usage (the project runs it in CI; see ``tests/property/test_effect_model.py``)::

    stats = run_effect_model(wal_database_factory)
    print(stats)
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from hypothesis import settings
from hypothesis import strategies as st

from wal_engine.errors import ReconcileRefused
from wal_engine.events import ToolCallUncertain
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import AgentContext, LlmResponse, ToolError
from wal_engine.testing.crash import Responder, default_responder, open_database
from wal_engine.testing.invariants import Violation, read_events
from wal_engine.testing.ledger import Behaviour, EffectLedger, ToolClass, read_effects
from wal_engine.testing.machine import (
    AgentUnderTest,
    MachineStats,
    Submission,
    crash_settings,
    run_crash_machine,
)

if TYPE_CHECKING:
    from replay.state import AgentState
    from wal_engine.engine import Engine
    from wal_engine.runtime.worker import Worker
    from wal_engine.store import EventRecord
    from wal_engine.testing.postgres import DatabaseFactory

AGENT: Final = "effect-model"
KINDS: Final = ("idem", "lookup", "unsafe", "llm", "db")
RESULTS: Final = ("plain", "huge", "nan", "nul", "hostile")
TIMINGS: Final[dict[str, Any]] = {
    "lease_ttl_ms": 1_000, "heartbeat_ms": 300, "poll_ms": 20, "sweep_ms": 50,
    "drain_timeout_s": 5.0,
}
"""Short leases, so that a call blocking its thread longer than the lease is cheap to try."""
block_s: Final = 1.3
"""How long a ``block`` attempt waits before acting: longer than the lease TTL."""
late_s: Final = 0.4
"""How late an ``act_then_sleep`` attempt answers (its call's timeout: ``short_timeout_s``)."""
short_timeout_s: Final = 0.1
long_timeout_s: Final = 10.0
hostile_repeats: Final = 4096
"""``"eyJ-"`` (the start of a JWT) this many times: 16 KiB of text a credential pattern
might scan slowly."""
huge_bytes: Final = 1024 * 1024 + 1
"""A result just over the old 1 MiB payload cap: now stored as a large value in wal_blobs
(docs/architecture.md decision 61), so crashes around its append exercise that path, and
the run that records it and the one that replays it must see the same value."""
reconcile_wait_s: Final = 10.0
LEDGER_SESSION: Final = "wal-test-ledger"
QUICK: Final = RetryPolicy(max_attempts=3, initial_delay_s=0.01, max_delay_s=0.05)

PROFILES: Final = {
    "effects-dev": (8, 8),
    "effects-ci": (45, 8),
    "effects-deep": (600, 14),
}
"""Hypothesis profiles of the model (programs, steps per program): the CI one tries more
than 1,000 calls in about a minute on two cores (about 29 calls per program, 26-36 seen:
how many calls an agent draws depends on how its earlier calls ended, so 45 programs keep a
margin over the test's floor of 1,000); the deep one is for nightly runs."""

# Which tool_call_uncertain reasons an ambiguous first attempt may give, besides
# "interrupted" (a run that ended under the call: a crash, a lost lease, a lost database).
REASONS: Final = {"act_then_raise": {"connection_lost"}, "act_then_sleep": {"timed_out"}}
KNOWN_REASONS: Final = frozenset({"timed_out", "connection_lost", "error_after_start",
                                  "interrupted"})


@dataclass
class EffectStats:
    """Figures of every program the model ran (printed by the test)."""

    machine: MachineStats = field(default_factory=MachineStats)
    programs: int = 0
    tasks: int = 0
    calls: int = 0
    calls_made: int = 0
    calls_by_kind: dict[str, int] = field(default_factory=dict)
    calls_by_outcome: dict[str, int] = field(default_factory=dict)
    calls_by_result: dict[str, int] = field(default_factory=dict)
    sync_calls: int = 0
    attempts: int = 0
    deliveries: int = 0
    escalations: dict[str, int] = field(default_factory=dict)
    reconcile_refused: int = 0
    reconciled_forced: int = 0
    reconciled: int = 0
    workers: int = 0
    loop_stalls: int = 0
    worst_stall_ms: float = 0.0
    violations: int = 0

    def count(self, table: dict[str, int], key: str, n: int = 1) -> None:
        """Add ``n`` to ``table[key]``."""
        table[key] = table.get(key, 0) + n

    def __str__(self) -> str:
        def listed(table: dict[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(table.items()))

        return (f"{self.programs} programs, {self.tasks} tasks, {self.calls} calls drawn, "
                f"{self.calls_made} made ({self.sync_calls} sync; kinds: "
                f"{listed(self.calls_by_kind)}; first attempts: "
                f"{listed(self.calls_by_outcome)}; results: "
                f"{listed(self.calls_by_result)}); ledger: {self.attempts} attempts, "
                f"{self.deliveries} deliveries; escalations: {listed(self.escalations)}; "
                f"reconcile refused {self.reconcile_refused}, reconciled "
                f"{self.reconciled} ({self.reconciled_forced} forced after the attempt "
                f"ended); {self.workers} workers, {self.loop_stalls} loop stalls, worst "
                f"loop lag {self.worst_stall_ms:.1f} ms; violations {self.violations}; "
                f"machine: {self.machine}")


# ---------------------------------------------------------------------- the drawn plans

OUTCOME_WEIGHTS: Final = {"return": 80, "did_not_act": 20, "act_then_raise": 30,
                          "act_then_sleep": 12, "lose_connections": 6, "block": 2}
"""How often each first-attempt outcome is drawn: blocking past the lease costs more than a
second a call, so it is rare."""
RESULT_WEIGHTS: Final = {"plain": 24, "huge": 1, "nan": 1, "nul": 1, "hostile": 1}


def _weighted(weights: dict[str, int]) -> st.SearchStrategy[str]:
    return st.sampled_from([name for name, n in weights.items() for _ in range(n)])


def _call_strategy() -> st.SearchStrategy[dict[str, Any]]:
    # Mostly "wait" on an escalation: a task failed by one stops making its other calls.
    return st.builds(_call, st.sampled_from(KINDS), st.booleans(), _weighted(OUTCOME_WEIGHTS),
                     _weighted(RESULT_WEIGHTS), st.sampled_from([True, True, True, False]))


def _call(kind: str, sync: bool, outcome: str, result: str, wait: bool) -> dict[str, Any]:
    if kind == "db":
        # ctx.transaction takes an async function of the engine's connection: no sync
        # variant, and its effect rolls back with a failure, so it never blocks or sleeps.
        sync = False
        outcome = outcome if outcome in ("return", "act_then_raise") else "return"
    return {"kind": kind, "sync": sync, "outcome": outcome, "result": result,
            "on_uncertain": "wait" if wait else "fail"}


def plans() -> st.SearchStrategy[Submission]:
    """Submissions of the model agent: 5-12 drawn calls each."""
    return st.builds(Submission, agent=st.just(AGENT),
                     input=st.fixed_dictionaries(
                         {"calls": st.lists(_call_strategy(), min_size=5, max_size=12)}))


# ---------------------------------------------------------------------- the agent

def result_of(args: dict[str, Any]) -> Any:
    """The value a fake answers for ``args`` (deterministic: the same on every delivery)."""
    shape = args["result"]
    if shape == "huge":
        return {"i": args["i"], "blob": "x" * huge_bytes}
    if shape == "nan":
        return {"i": args["i"], "value": math.nan}
    if shape == "nul":
        return {"i": args["i"], "text": "a\x00b"}
    if shape == "hostile":
        return {"i": args["i"], "text": "eyJ-" * hostile_repeats}
    return {"i": args["i"], "ok": True}


def script(args: dict[str, Any], attempt: int) -> Behaviour:
    """The drawn behaviour on the first attempt; every retry returns."""
    if attempt > 1:
        return Behaviour()
    outcome = args["outcome"]
    sleep_s = block_s if outcome == "block" else late_s if outcome == "act_then_sleep" else 0
    return Behaviour(outcome=outcome, sleep_s=sleep_s)


def digest(value: Any) -> str:
    """A short, stable fingerprint of a recorded result (the task's output stays small)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


async def register(engine: Engine) -> None:
    """Register the model agent: it makes the calls its input lists, in order. Its fakes
    keep their counts through a pool of their own, which the ``lose_connections`` outcome
    (every session of the engine ended) does not touch: the services stay up while the
    worker loses its database."""
    database = await open_database(engine.database.dsn, application_name=LEDGER_SESSION,
                                   pool_size_max=4)
    ledger = EffectLedger.attach(engine, database, owned=True)
    await ledger.prepare()
    fakes: dict[tuple[str, bool], Callable[..., Any]] = {}
    for sync in (False, True):
        variant = "sync" if sync else "async"
        kind: ToolClass
        for kind in ("idem", "lookup", "unsafe"):
            fakes[kind, sync] = ledger.service(f"{kind}-{variant}", kind=kind,
                                               result=result_of, script=script, sync=sync)
        fakes["llm", sync] = ledger.llm(
            f"llm-{variant}", lambda request: LlmResponse(content=result_of(request),
                                                          input_tokens=3, output_tokens=2),
            script=script, sync=sync)
    fakes["db", False] = ledger.transaction("db-async", result=result_of, script=script)
    lookup = ledger.lookup()

    async def one(ctx: AgentContext, i: int, call: dict[str, Any]) -> Any:
        kind, sync = call["kind"], call["sync"]
        name = f"{kind}-{'sync' if sync else 'async'}"
        args = {"i": i, "outcome": call["outcome"], "result": call["result"]}
        timeout_s = short_timeout_s if call["outcome"] == "act_then_sleep" else long_timeout_s
        function = fakes[kind, sync]
        if kind == "llm":
            return await ctx.llm(name, function, args, retry=QUICK, timeout_s=timeout_s)
        if kind == "db":
            return await ctx.transaction(name, function, args)
        return await ctx.tool(name, function, args, idempotent=kind == "idem",
                              lookup=lookup if kind == "lookup" else None, retry=QUICK,
                              timeout_s=timeout_s, on_uncertain=call["on_uncertain"])

    @engine.agent(AGENT)
    async def model(ctx: AgentContext, task_input: Any) -> Any:
        outcomes = []
        for i, call in enumerate(task_input["calls"]):
            try:
                outcomes.append(digest(await one(ctx, i, call)))
            except ToolError as error:
                outcomes.append(f"error:{error.error_type}")
        return {"outcomes": outcomes}


# ---------------------------------------------------------------------- the checks

def allow_in_doubt(state: AgentState, history: list[EventRecord]) -> bool:
    """A final state may differ from the crash-free run only where a run ended under a call
    not safe to repeat, which is then escalated (``interrupted``) instead of re-run."""
    del state
    return any(r.type == "tool_call_uncertain" and _uncertain(r).reason == "interrupted"
               for r in history)


def _uncertain(record: EventRecord) -> ToolCallUncertain:
    event = record.decode()
    assert isinstance(event, ToolCallUncertain)
    return event


def check_program(histories: dict[str, list[EventRecord]],
                  plans_by_task: dict[str, list[dict[str, Any]]],
                  stats: EffectStats) -> list[Violation]:
    """E1-E3 over one program's log and ledger (pure; see the module docstring)."""
    violations: list[Violation] = []
    for task_id, history in histories.items():
        plan = plans_by_task.get(task_id)
        calls: dict[str, dict[str, Any]] = {}
        keys: dict[str, set[str]] = {}
        order: list[str] = []
        for record in history:
            event = record.decode()
            call_id = getattr(event, "call_id", None)
            if call_id is None or call_id.startswith("~"):
                continue
            if call_id not in calls:
                order.append(call_id)
                calls[call_id] = {"types": []}
            calls[call_id]["types"].append(record.type)
            if record.idempotency_key is not None:
                keys.setdefault(call_id, set()).add(record.idempotency_key)
            if isinstance(event, ToolCallUncertain):
                calls[call_id]["uncertain"] = event
        for call_id, seen in keys.items():
            if len(seen) > 1:
                violations.append(Violation(invariant="E1", task_id=task_id,
                                            detail=f"{call_id} was attempted under "
                                                   f"{len(seen)} keys: {sorted(seen)}"))
        stats.calls_made += len(order)
        for index, call_id in enumerate(order):
            drawn = plan[index] if plan is not None and index < len(plan) else None
            violations += _check_call(task_id, call_id, calls[call_id], drawn, stats)
    return violations


def _check_call(task_id: str, call_id: str, seen: dict[str, Any],
                drawn: dict[str, Any] | None, stats: EffectStats) -> list[Violation]:
    uncertain: ToolCallUncertain | None = seen.get("uncertain")
    if uncertain is not None:
        stats.count(stats.escalations, uncertain.reason)
        allowed = set(KNOWN_REASONS) if drawn is None else (
            REASONS.get(drawn["outcome"], {"error_after_start"}) | {"interrupted"})
        if uncertain.reason not in allowed or uncertain.not_before_ms is None:
            return [Violation(invariant="E2", task_id=task_id,
                              detail=f"{call_id} escalated with reason {uncertain.reason!r} "
                                     f"(allowed {sorted(allowed)}), not_before_ms "
                                     f"{uncertain.not_before_ms}")]
    if drawn is None or drawn["kind"] != "unsafe" or drawn["outcome"] not in REASONS:
        return []
    # The first attempt acted, then failed ambiguously: only escalation is safe.
    if "tool_call_failed" in seen["types"] and uncertain is None:
        return [Violation(invariant="E3", task_id=task_id,
                          detail=f"{call_id} ({drawn['outcome']}) recorded a failure "
                                 f"without escalating: {seen['types']}")]
    return []


# ---------------------------------------------------------------------- the harness

def reconciling_responder(stats: EffectStats) -> Callable[[Engine, dict[str, Any]], Responder]:
    """A responder that reconciles an escalated call as failed the way an operator
    should: it asks first (refused during the grace period: E4 checks the refusal), then,
    once no attempt of a fake is still running in this process, forces it."""

    def make(engine: Engine, signals: dict[str, Any]) -> Responder:
        others = default_responder(engine, signals)
        ledger = EffectLedger.for_engine(engine)

        async def respond(task_id: str, name: str, state: AgentState) -> bool:
            if not name.startswith("~reconcile:"):
                return await others(task_id, name, state)
            call_id = name.removeprefix("~reconcile:")
            text = "reconciled as failed by the effect model"
            try:
                await engine.reconcile(task_id, call_id, error=text)
            except ReconcileRefused as refused:
                await _check_refusal(engine, task_id, refused, stats)
                await ledger.idle(reconcile_wait_s)
                await engine.reconcile(task_id, call_id, error=text, force=True)
                stats.reconciled_forced += 1
            stats.reconciled += 1
            return True

        return respond

    return make


async def _check_refusal(engine: Engine, task_id: str, refused: ReconcileRefused,
                         stats: EffectStats) -> None:
    stats.reconcile_refused += 1
    if refused.not_before_ms is None:
        return  # Refused for another reason (not escalated, task ended): nothing to time.
    row = await engine.database.fetchrow("SELECT (extract(epoch FROM clock_timestamp())"
                                         " * 1000)::int8 AS now_ms")
    if int(row["now_ms"]) >= refused.not_before_ms + 1_000:
        stats.violations += 1
        raise AssertionError(f"E4 task {task_id}: reconcile refused "
                             f"{int(row['now_ms']) - refused.not_before_ms} ms after its "
                             f"not_before_ms")


def model_config(stats: EffectStats, *, tasks_max: int = 4) -> AgentUnderTest:
    """The crash machine's configuration for the effect model."""

    async def finish(engine: Engine, tasks: list[tuple[str, Submission]]) -> list[Violation]:
        plans_by_task = {task_id: list(s.input["calls"]) for task_id, s in tasks}
        stats.programs += 1
        stats.tasks += len(tasks)
        for plan in plans_by_task.values():
            for call in plan:
                stats.calls += 1
                stats.sync_calls += int(call["sync"])
                stats.count(stats.calls_by_kind, call["kind"])
                stats.count(stats.calls_by_outcome, call["outcome"])
                stats.count(stats.calls_by_result, call["result"])
        effects = await read_effects(engine.database)
        stats.attempts += sum(row.attempts for row in effects)
        stats.deliveries += sum(row.deliveries for row in effects)
        histories = await read_events(engine.database, list(plans_by_task))
        found = check_program(histories, plans_by_task, stats)
        stats.violations += len(found)
        return found

    def observe(worker: Worker) -> None:
        stats.workers += 1
        stalls = worker.keeper.stalls
        stats.loop_stalls += stalls.count
        stats.worst_stall_ms = max(stats.worst_stall_ms, stalls.worst_ms)

    return AgentUnderTest(register=register, submissions=plans(), tasks_max=tasks_max,
                          faults_max=6, timings=dict(TIMINGS), degraded=allow_in_doubt,
                          responder=reconciling_responder(stats), finish=finish,
                          observe=observe)


def effect_settings(profile: str | None = None) -> settings:
    """Settings of ``profile``, else ``WAL_ENGINE_EFFECTS_PROFILE``, else ``effects-deep``
    when ``RELIABILITY_DEEP=1``, else ``effects-ci`` (derandomized but for the deep one)."""
    chosen = profile or os.environ.get("WAL_ENGINE_EFFECTS_PROFILE") or (
        "effects-deep" if os.environ.get("RELIABILITY_DEEP") == "1" else "effects-ci")
    examples, steps = PROFILES[chosen]
    return settings(crash_settings("crash-ci"), max_examples=examples,
                    stateful_step_count=steps, derandomize=chosen != "effects-deep")


def run_effect_model(factory: DatabaseFactory, *, profile: str | None = None,
                     settings_: settings | None = None) -> EffectStats:
    """Run the effect model as a test (fails on the first violation); return its figures."""
    stats = EffectStats()
    stats.machine = run_crash_machine(model_config(stats), factory,
                                      settings_=settings_ or effect_settings(profile))
    return stats
