"""Issue 15, case 1, through the public API: a non-idempotent tool that acted and then timed
out or lost its connection is never re-run; it is escalated with its reason, and per
``on_uncertain`` fails the task or waits for a reconciliation, which is refused during the
grace period. (Cases 2, 4, 5 and W10 need worker processes: tests/fault/test_effect_safety.py.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import escalations
from wal_engine import events as ev
from wal_engine.engine import Engine
from wal_engine.errors import InvalidInput, ReconcileRefused
from wal_engine.retries import DidNotAct, LeaseExpired, RetryPolicy
from wal_engine.runtime.context import AgentContext, LlmResponse, current_call, ensure_lease
from wal_engine.state_machine import Status
from wal_engine.testing.crash import expire_leases, run_worker_until_idle
from wal_engine.testing.processes import wait_until

TIMINGS: dict[str, Any] = {"lease_ttl_ms": 1000, "heartbeat_ms": 250, "poll_ms": 20,
                           "sweep_ms": 50}
QUICK = RetryPolicy(max_attempts=3, initial_delay_s=0.01, max_delay_s=0.02)
LATE_S = 0.5


class Charge:
    """A payment API that charges, then answers late or loses the answer (sync or async)."""

    def __init__(self, *, sync: bool, then: str, fail_first_without_acting: int = 0) -> None:
        self.sync = sync
        self.then = then
        self.acted: list[str] = []
        self.calls = 0
        self.fail_first = fail_first_without_acting
        self.finished = threading.Event()
        self._lock = threading.Lock()

    def _act(self) -> None:
        claim = current_call()
        assert claim is not None
        with self._lock:
            self.calls += 1
            if self.calls <= self.fail_first:
                raise DidNotAct("the request never left the client")
            self.acted.append(claim.key)

    def function(self) -> Callable[[Any], Any]:
        """The tool function, a plain def or a coroutine function."""

        def charge_sync(args: Any) -> Any:
            try:
                self._act()
                if self.then == "late":
                    time.sleep(LATE_S)
                elif self.then == "reset":
                    raise ConnectionResetError("charged, then the connection was reset")
                return {"charged": args["amount"]}
            finally:
                self.finished.set()

        async def charge_async(args: Any) -> Any:
            try:
                self._act()
                if self.then == "late":
                    await asyncio.sleep(LATE_S)
                elif self.then == "reset":
                    raise ConnectionResetError("charged, then the connection was reset")
                return {"charged": args["amount"]}
            finally:
                self.finished.set()

        return charge_sync if self.sync else charge_async


def _register(engine: Engine, charge: Charge, *, idempotent: bool = False,
              on_uncertain: str = "fail") -> str:
    name = f"charge-{id(charge)}"
    function = charge.function()

    @engine.agent(name)
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("charge", function, task_input, idempotent=idempotent,
                              timeout_s=0.1, retry=QUICK,
                              on_uncertain=on_uncertain)  # type: ignore[arg-type]

    return name


async def _run(engine: Engine, task_id: str) -> Status:
    await run_worker_until_idle(engine, **TIMINGS)
    return (await engine.head(task_id)).status


async def _settled(charge: Charge) -> None:
    """Wait (bounded) until the attempt's thread or coroutine returned: an act after the
    timeout would show up only then."""
    await asyncio.to_thread(charge.finished.wait, 5)
    await asyncio.sleep(LATE_S)  # Room for a wrong retry to act too (it would be counted).


@pytest.mark.parametrize("sync", [True, False], ids=["def", "async"])
@pytest.mark.parametrize(("then", "reason", "error_type"), [
    ("late", "timed_out", "CallTimedOut"),
    ("reset", "connection_lost", "ConnectionResetError"),
], ids=["answers-late", "connection-reset"])
async def test_case1_non_idempotent_call_in_doubt_acts_once_and_fails(
        engine: Engine, sync: bool, then: str, reason: str, error_type: str) -> None:
    """idempotent=False, timeout_s=0.1: a charge that acted then answered after 0.5 s, or
    acted then raised ConnectionResetError, acts once; on_uncertain="fail" fails the task
    with uncertain_side_effect and the escalation says why."""
    charge = Charge(sync=sync, then=then)
    task_id = await engine.submit(_register(engine, charge), {"amount": 5})
    assert await _run(engine, task_id) is Status.FAILED
    await _settled(charge)
    assert len(charge.acted) == 1
    state = await engine.state(task_id)
    assert state.failure is not None and state.failure.reason == "uncertain_side_effect"
    [escalation] = await escalations(engine, task_id)
    assert (escalation.reason, escalation.error_type) == (reason, error_type)
    assert escalation.not_before_ms is not None


@pytest.mark.parametrize("sync", [True, False], ids=["def", "async"])
async def test_case1_wait_refuses_reconcile_during_grace_then_completes(engine: Engine,
                                                                        sync: bool) -> None:
    """on_uncertain="wait": the task waits; reconcile before the grace period (the lease
    TTL, 1 s) is refused with its not_before_ms; after it, reconcile completes the task
    with the operator's answer; the charge acted once."""
    charge = Charge(sync=sync, then="late")
    task_id = await engine.submit(_register(engine, charge, on_uncertain="wait"), {"amount": 5})
    assert await _run(engine, task_id) is Status.WAITING
    [escalation] = await escalations(engine, task_id)
    assert escalation.not_before_ms is not None
    with pytest.raises(ReconcileRefused) as refused:
        await engine.reconcile(task_id, escalation.call_id, result={"charged": 5})
    assert refused.value.not_before_ms == escalation.not_before_ms
    await _settled(charge)
    while time.time() * 1000 < escalation.not_before_ms + 50:
        await asyncio.sleep(0.05)  # The grace period is a span of time by definition.
    await engine.reconcile(task_id, escalation.call_id, result={"charged": 5})
    assert await _run(engine, task_id) is Status.COMPLETED
    assert (await engine.state(task_id)).output == {"charged": 5}
    assert len(charge.acted) == 1


async def test_case1_forced_reconcile_completes_during_grace(engine: Engine) -> None:
    """force=True (the operator knows the attempt's worker is gone) is accepted at once."""
    charge = Charge(sync=False, then="reset")
    task_id = await engine.submit(_register(engine, charge, on_uncertain="wait"), {"amount": 7})
    assert await _run(engine, task_id) is Status.WAITING
    [escalation] = await escalations(engine, task_id)
    await engine.reconcile(task_id, escalation.call_id, error="declined by the bank",
                           force=True)
    assert await _run(engine, task_id) is Status.FAILED
    assert len(charge.acted) == 1


async def test_reconcile_of_a_call_that_is_not_escalated_is_refused(engine: Engine) -> None:
    """A typed refusal, and the log unchanged, for a call that is not uncertain."""
    charge = Charge(sync=False, then="ok")
    task_id = await engine.submit(_register(engine, charge), {"amount": 1})
    assert await _run(engine, task_id) is Status.COMPLETED
    head = await engine.head(task_id)
    with pytest.raises(ReconcileRefused):
        await engine.reconcile(task_id, "tool-0", result={"charged": 1}, force=True)
    assert (await engine.head(task_id)).head_seq == head.head_seq


async def test_a_second_answer_for_an_escalated_call_is_refused(engine: Engine) -> None:
    """Two operators answer one escalated call before the task takes it: the same answer
    again is accepted once (same signal), a different one is ReconcileRefused (it used to
    be accepted and never read), and the task ends with the first."""
    charge = Charge(sync=False, then="reset")
    task_id = await engine.submit(_register(engine, charge, on_uncertain="wait"), {"amount": 4})
    assert await _run(engine, task_id) is Status.WAITING
    [escalation] = await escalations(engine, task_id)
    first = await engine.reconcile(task_id, escalation.call_id, result={"charged": 4},
                                   force=True)
    again = await engine.reconcile(task_id, escalation.call_id, result={"charged": 4},
                                   force=True)
    assert again == first
    with pytest.raises(ReconcileRefused, match="another answer"):
        await engine.reconcile(task_id, escalation.call_id, error="declined", force=True)
    assert await _run(engine, task_id) is Status.COMPLETED
    assert (await engine.state(task_id)).output == {"charged": 4}
    assert len(charge.acted) == 1


@pytest.mark.parametrize("name", ["~reconcile:tool-0", "~approval:tool-0", "~"])
async def test_a_raw_signal_cannot_take_a_reserved_name(engine: Engine, name: str) -> None:
    """engine.signal refuses the engine's own names (a pre-sent ``~reconcile:`` signal
    answered the escalation 11 ms after it, skipping the grace period), log unchanged."""
    charge = Charge(sync=False, then="late")
    task_id = await engine.submit(_register(engine, charge, on_uncertain="wait"), {"amount": 2})
    head = await engine.head(task_id)
    with pytest.raises(InvalidInput, match="reserved"):
        await engine.signal(task_id, name, {"result": {"charged": 2}})
    assert (await engine.head(task_id)).head_seq == head.head_seq
    assert await _run(engine, task_id) is Status.WAITING
    await _settled(charge)
    assert len(charge.acted) == 1


@pytest.mark.parametrize("sync", [True, False], ids=["def", "async"])
async def test_did_not_act_is_the_one_retried_failure_of_a_non_idempotent_tool(
        engine: Engine, sync: bool) -> None:
    """DidNotAct on the first two attempts: retried under the same key, acts once."""
    charge = Charge(sync=sync, then="ok", fail_first_without_acting=2)
    task_id = await engine.submit(_register(engine, charge), {"amount": 3})
    assert await _run(engine, task_id) is Status.COMPLETED
    assert charge.calls == 3 and len(charge.acted) == 1
    assert await escalations(engine, task_id) == []


@pytest.mark.parametrize("sync", [True, False], ids=["def", "async"])
async def test_idempotent_tool_retries_a_timeout_under_the_same_key(engine: Engine,
                                                                    sync: bool) -> None:
    """The same late charge declared idempotent: retried on timeout, every delivery with
    one key (the callee dedups on it), the call ends as a failure after the policy's three
    attempts, never escalated."""
    charge = Charge(sync=sync, then="late")
    task_id = await engine.submit(_register(engine, charge, idempotent=True), {"amount": 2})
    assert await _run(engine, task_id) is Status.FAILED
    await _settled(charge)
    assert len(charge.acted) == 3 and len(set(charge.acted)) == 1
    assert await escalations(engine, task_id) == []


# ---------------------------------------------------------------------------------------
# A sync call that waits for a thread: the worker's pool is bounded (``sync_threads``), and
# a timed-out sync call keeps its thread, so every thread can be busy. A call queued behind
# them is started only if it was not given up on meanwhile and its lease is still trusted.


class PoolHog:
    """A def tool holding the pool's one thread until released, then a def tool queued
    behind everything queued meanwhile (when it runs, every earlier item has run)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.drained = threading.Event()

    def register(self, engine: Engine) -> str:
        def hog(_: Any) -> str:
            self.started.set()
            self.release.wait(30)
            return "released"

        def after(_: Any) -> str:
            self.drained.set()
            return "drained"

        @engine.agent("pool-hog")
        async def agent(ctx: AgentContext, task_input: Any) -> Any:
            await ctx.tool("hog", hog, None)
            return await ctx.tool("after", after, None)

        return "pool-hog"


def _queued_charge(engine: Engine, hog: PoolHog, acted: list[str], *,
                   timeout_s: float | None) -> str:
    def charge(args: Any) -> Any:
        claim = current_call()
        assert claim is not None
        acted.append(claim.key)
        return {"charged": args["amount"]}

    @engine.agent("queued-charge")
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        # Agent code may block a thread of its own: this one only orders the test.
        assert await asyncio.to_thread(hog.started.wait, 30)
        return await ctx.tool("charge", charge, task_input, idempotent=False,
                              timeout_s=timeout_s, retry=QUICK)

    return "queued-charge"


async def test_a_sync_call_that_never_got_a_thread_never_acts(engine: Engine) -> None:
    """One pool thread held by another task's tool; a non-idempotent def charge with
    timeout_s=0.1 queued behind it: each attempt is given up before it starts, recorded as
    DidNotAct (retried, then the call fails; nothing is in doubt), and none of them acts
    once the thread is free. Before, the first attempt was escalated as timed_out and the
    queued charge acted about 3 s later, after the grace period a human's reconcile waits
    for (a reconcile by hand then made two charges)."""
    hog, acted = PoolHog(), []
    hog_id = await engine.submit(hog.register(engine), None)
    charge_id = await engine.submit(_queued_charge(engine, hog, acted, timeout_s=0.1),
                                    {"amount": 5})
    worker = engine.worker(concurrency=2, sync_threads=1, **TIMINGS)
    running = asyncio.create_task(worker.run(until_idle=True))
    try:
        async def charge_failed() -> bool:
            return (await engine.head(charge_id)).status is Status.FAILED
        await wait_until(charge_failed, "the queued charge to fail", 20)
        hog.release.set()
        await asyncio.wait_for(asyncio.shield(running), 30)
    finally:
        hog.release.set()
        worker.stop()
        await running
    assert hog.drained.is_set() and (await engine.head(hog_id)).status is Status.COMPLETED
    assert acted == []
    assert await escalations(engine, charge_id) == []
    failures = [record.decode() for record in await engine.history(charge_id)]
    assert [event.error_type for event in failures if isinstance(event, ev.ToolCallFailed)
            ] == ["DidNotAct"] * QUICK.max_attempts


async def test_a_sync_call_queued_past_its_lease_does_not_start(engine: Engine) -> None:
    """A non-idempotent def charge (no timeout) queued behind the pool's one busy thread
    loses its lease while it waits: when the thread is free the charge does not start (its
    lease is checked again in the thread), and the next owner escalates the call. Before,
    it acted on a lease another worker had taken."""
    hog, acted = PoolHog(), []
    await engine.submit(hog.register(engine), None)
    charge_id = await engine.submit(_queued_charge(engine, hog, acted, timeout_s=None),
                                    {"amount": 6})
    worker = engine.worker(concurrency=2, sync_threads=1, **TIMINGS)
    running = asyncio.create_task(worker.run(until_idle=True))
    try:
        async def intended() -> bool:
            return any(isinstance(record.decode(), ev.ToolCallIntended)
                       for record in await engine.history(charge_id))
        await wait_until(intended, "the charge's intent", 20)
        epoch = (await engine.head(charge_id)).lease_epoch
        assert await expire_leases(engine, [charge_id]) == 1
        await wait_until(lambda: not worker.lease_valid(charge_id, epoch),
                         "the worker to distrust the charge's lease", 20)
        hog.release.set()
        await asyncio.wait_for(asyncio.shield(running), 30)
    finally:
        hog.release.set()
        worker.stop()
        await running
    assert acted == []
    assert (await engine.head(charge_id)).status is Status.FAILED
    assert [e.reason for e in await escalations(engine, charge_id)] == ["interrupted"]


# ---------------------------------------------------------------------------------------
# A timed-out sync call's thread cannot be stopped: the call is looked up or escalated only
# once that thread has ended, so neither a lookup nor a human's reconcile can come before a
# late effect.

SLOW_S = 1.5
"""Longer than the grace period of TIMINGS (the lease TTL, 1 s, beats timeout_s=0.1)."""


async def test_no_reconcile_before_a_timed_out_thread_has_acted(engine: Engine) -> None:
    """A non-idempotent def charge that acts only after 1.5 s, timeout_s=0.1, on_uncertain
    "wait": the first reconcile accepted without force comes after the charge acted, and
    the charge acts once. Before, the escalation was recorded at the timeout, reconcile was
    accepted after its 1 s grace, and the thread charged after that (an operator who
    charged by hand on reconcile made two charges)."""
    acted: list[float] = []

    def charge(args: Any) -> Any:
        time.sleep(SLOW_S)  # The callee is slow; then it charges.
        acted.append(time.monotonic())
        return {"charged": args["amount"]}

    @engine.agent("slow-charge")
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("charge", charge, task_input, idempotent=False, timeout_s=0.1,
                              on_uncertain="wait")

    task_id = await engine.submit("slow-charge", {"amount": 8})
    worker = engine.worker(concurrency=2, **TIMINGS)
    running = asyncio.create_task(worker.run())
    try:
        async def reconciled() -> bool:
            escalated = await escalations(engine, task_id)
            if not escalated:
                return False
            try:
                await engine.reconcile(task_id, escalated[0].call_id, result={"charged": 8})
            except ReconcileRefused:
                return False
            return True
        await wait_until(reconciled, "a reconcile accepted without force", 20)
        accepted_at = time.monotonic()
        async def completed() -> bool:
            return (await engine.head(task_id)).status is Status.COMPLETED
        await wait_until(completed, "the reconciled task to complete", 20)
    finally:
        worker.stop()
        await running
    assert len(acted) == 1 and acted[0] < accepted_at
    [escalation] = await escalations(engine, task_id)
    assert escalation.reason == "timed_out"


async def test_a_timed_out_def_tool_with_lookup_is_looked_up_after_its_thread(
        engine: Engine) -> None:
    """A def tool with ``lookup`` that timed out while its thread still ran: the lookup is
    asked once the thread ended and finds what the tool did, so the call completes with no
    human (before, it was always escalated, the lookup never asked)."""
    done: dict[str, Any] = {}

    def transfer(args: Any) -> Any:
        time.sleep(0.5)
        claim = current_call()
        assert claim is not None
        done[claim.key] = {"sent": args["amount"]}
        return done[claim.key]

    async def lookup(key: str) -> Any:
        return done.get(key)

    @engine.agent("looked-up-transfer")
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("transfer", transfer, task_input, idempotent=False,
                              timeout_s=0.1, lookup=lookup)

    task_id = await engine.submit("looked-up-transfer", {"amount": 9})
    assert await _run(engine, task_id) is Status.COMPLETED
    assert (await engine.state(task_id)).output == {"sent": 9}
    assert len(done) == 1 and await escalations(engine, task_id) == []


async def test_case3_hostile_results_are_recorded_once_through_a_worker(engine: Engine) -> None:
    """Case 3 through the public API: a non-idempotent tool returning 128 KiB of "eyJ-" and
    one returning 64 KiB of PEM headers (the inputs that held a worker's loop ~20 s and
    4.5 s, lost its leases and re-ran the tool) each act once, their results are recorded
    and the task completes with no lease broken. The time per KiB is the property test's
    (tests/property/test_redaction_linear.py) and the benchmark's (benchmarks/redaction.py)."""
    acted: list[str] = []
    pages = {"jwt": "eyJ-" * (128 * 1024 // 4),
             "pem": "-----BEGIN PRIVATE KEY-----" * (64 * 1024 // 27)}

    async def fetch(args: Any) -> Any:
        acted.append(args["page"])
        return {"page": pages[args["page"]]}

    @engine.agent("hostile-pages")
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        sizes = []
        for page in ("jwt", "pem"):
            result = await ctx.tool("fetch", fetch, {"page": page}, idempotent=False)
            sizes.append(len(result["page"]))
        return sizes

    task_id = await engine.submit("hostile-pages", None)
    assert await _run(engine, task_id) is Status.COMPLETED
    assert acted == ["jwt", "pem"]
    # Recorded as redacted (the PEM headers partly are): the agent sees what was stored.
    jwt_size, pem_size = (await engine.state(task_id)).output
    assert jwt_size == len(pages["jwt"]) and 0 < pem_size <= len(pages["pem"])
    types = [type(record.decode()).__name__ for record in await engine.history(task_id)]
    assert "TaskOrphaned" not in types and await escalations(engine, task_id) == []


# ---------------------------------------------------------------------------------------
# Ordinary agent code tried against the guarantee (an audit of issue 15): these held.


async def _two_workers_until(engine: Engine, condition: Callable[[], Any], what: str,
                             workers: list[Any] | None = None) -> None:
    pair = workers or [engine.worker(concurrency=2, **TIMINGS) for _ in range(2)]
    running = [asyncio.create_task(worker.run()) for worker in pair]
    try:
        await wait_until(condition, what, 30)
    finally:
        for worker in pair:
            worker.stop()
        await asyncio.gather(*running)


async def test_a_blocking_def_llm_function_is_called_once(engine: Engine) -> None:
    """A plain def LLM function blocking 3 s (three lease TTLs, no timeout), two workers in
    one process: it runs on the pool, so neither loop stalls, no lease is broken, and the
    model is called once."""
    calls: list[str] = []

    def model(request: Any) -> Any:
        claim = current_call()
        assert claim is not None
        calls.append(claim.key)
        time.sleep(3)  # A slow HTTP client call, as requests would make it.
        return LlmResponse(content="plan", input_tokens=3, output_tokens=2)

    @engine.agent("blocking-llm")
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.llm("model", model, {"prompt": "plan"})

    task_id = await engine.submit("blocking-llm", None)

    async def completed() -> bool:
        return (await engine.head(task_id)).status is Status.COMPLETED
    await _two_workers_until(engine, completed, "the task to complete")
    types = [type(record.decode()).__name__ for record in await engine.history(task_id)]
    assert len(calls) == 1 and "TaskOrphaned" not in types


async def test_cancel_while_a_def_tool_runs_in_its_thread(engine: Engine) -> None:
    """engine.cancel while a non-idempotent def tool waits in its thread: the task is
    FAILED at once, the worker is fenced, and the tool's ensure_lease() right before its
    effect refuses (LeaseExpired): nothing acts, and no worker runs the call again."""
    started, release = threading.Event(), threading.Event()
    acted: list[str] = []
    refused: list[str] = []

    def charge(args: Any) -> Any:
        started.set()
        release.wait(30)
        try:
            ensure_lease()
        except LeaseExpired as error:
            refused.append(type(error).__name__)
            raise
        acted.append("charged")
        return {"charged": args["amount"]}

    @engine.agent("cancelled-charge")
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("charge", charge, task_input, idempotent=False)

    task_id = await engine.submit("cancelled-charge", {"amount": 3})
    workers = [engine.worker(concurrency=2, **TIMINGS) for _ in range(2)]

    async def cancelled_and_fenced() -> bool:
        if not started.is_set():
            return False
        await engine.cancel(task_id)
        if any(worker.lease_valid(task_id, 1) for worker in workers):
            return False
        release.set()
        return True
    try:
        await _two_workers_until(engine, cancelled_and_fenced, "the cancel to fence the run",
                                 workers)
    finally:
        release.set()
    assert acted == [] and refused == ["LeaseExpired"]
    assert (await engine.head(task_id)).status is Status.FAILED
    types = [type(record.decode()).__name__ for record in await engine.history(task_id)]
    assert types.count("ToolCallIntended") == 1


# ---------------------------------------------------------------------------------------
# A worker stopped past its drain timeout while a sync call's thread runs keeps the task
# (its lease renewed) until that thread has ended: handed back earlier, the next owner would
# look the call up or escalate it while the thread may still act. (The same with worker
# processes and SIGTERM: tests/fault/test_effect_safety.py.)


def _sample(name: str, **labels: str) -> float:
    """A metric's value in the default registry (0 when never set)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_worker_stopped_during_a_timed_out_call_hands_back_after_its_thread(
        engine: Engine) -> None:
    """A def transfer with ``lookup`` that timed out (0.1 s) and acts after 1.5 s; the
    worker is stopped while the run waits for that thread, drain timeout 0.2 s: the worker
    returns only after the thread acted, the gauge of overrunning sync calls counted it
    meanwhile, and the next owner's lookup finds the transfer: done once, no human. Before,
    the drain's cancellation cut the wait short and handed the task back while the thread
    could still act."""
    done: dict[str, Any] = {}
    acted_at: list[float] = []
    started_at: list[float] = []

    def transfer(args: Any) -> Any:
        started_at.append(time.monotonic())
        time.sleep(SLOW_S)
        claim = current_call()
        assert claim is not None
        done[claim.key] = {"sent": args["amount"]}
        acted_at.append(time.monotonic())
        return done[claim.key]

    async def lookup(key: str) -> Any:
        return done.get(key)

    @engine.agent("stopped-transfer")
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("transfer", transfer, task_input, idempotent=False,
                              timeout_s=0.1, lookup=lookup)

    overruns = _sample("wal_engine_sync_call_overruns_total", reason="timed_out")
    task_id = await engine.submit("stopped-transfer", {"amount": 7})
    worker = engine.worker(concurrency=2, drain_timeout_s=0.2, **TIMINGS)
    running = asyncio.create_task(worker.run())
    await wait_until(lambda: started_at and time.monotonic() > started_at[0] + 0.4,
                     "the call to be past its timeout", 20)
    overrunning = _sample("wal_engine_sync_calls_overrunning")
    worker.stop()
    await running
    returned_at = time.monotonic()
    assert len(acted_at) == 1 and acted_at[0] < returned_at
    assert overrunning >= 1
    assert _sample("wal_engine_sync_call_overruns_total", reason="timed_out") > overruns
    assert _sample("wal_engine_sync_calls_overrunning") == 0
    assert (await engine.head(task_id)).status is Status.RESUMING
    assert await _run(engine, task_id) is Status.COMPLETED
    assert (await engine.state(task_id)).output == {"sent": 7}
    assert len(done) == 1 and await escalations(engine, task_id) == []


async def test_a_second_stop_during_a_sync_call_leaves_the_task_to_lease_expiry(
        engine: Engine) -> None:
    """Stopped once (drain 0.2 s) the run waits for its def tool's thread; cancelled again
    (a forced stop, the CLI's second Ctrl-C) it gives up waiting but does not hand the task
    back, as in a crash: the lease lapses and the next owner escalates the call with the
    reconcile grace. The thread, released afterwards, finds its lease gone (ensure_lease
    refuses) and does not act."""
    started, release, ended = threading.Event(), threading.Event(), threading.Event()
    acted: list[str] = []

    def charge(args: Any) -> Any:
        started.set()
        try:
            release.wait(20)
            ensure_lease()
            acted.append("charged")
            return {"charged": args["amount"]}
        finally:
            ended.set()

    @engine.agent("forced-charge")
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("charge", charge, task_input, idempotent=False)

    stops = _sample("wal_engine_sync_call_overruns_total", reason="stopping")
    task_id = await engine.submit("forced-charge", {"amount": 3})
    worker = engine.worker(concurrency=2, drain_timeout_s=0.2, **TIMINGS)
    running = asyncio.create_task(worker.run())
    try:
        await wait_until(started.is_set, "the tool's thread to start", 20)
        worker.stop()
        await wait_until(lambda: running.done() or _sample(
            "wal_engine_sync_call_overruns_total", reason="stopping") > stops,
                         "the drain to wait for the thread (or end)", 20)
        types = [record.type for record in await engine.history(task_id)]
        assert "task_released" not in types
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        types = [record.type for record in await engine.history(task_id)]
        assert "task_released" not in types
        assert (await engine.head(task_id)).status is Status.RUNNING
    finally:
        release.set()
    await wait_until(ended.is_set, "the tool's thread to end", 20)
    assert acted == []
    await expire_leases(engine, [task_id])
    assert await _run(engine, task_id) is Status.FAILED
    assert [e.reason for e in await escalations(engine, task_id)] == ["interrupted"]
