"""The write-ahead protocol of one external call: intent, act, record; retries; escalation.

1. append ``*_call_intended`` (with the idempotency key ``idem:<task>:<seq of intent>``) and
   commit;
2. run the call with that key in ``ctx.idempotency_key``;
3. append the result, or the failure of this attempt (with when the next one is due).

A failed attempt is classified by :func:`wal_engine.retries.classify_failure`: retried under
the same key, recorded as the call's failure, or *in doubt*. A call is also in doubt on a
re-run when its intent has no outcome (the previous run ended in between). In doubt, an
idempotent tool is called again with the same key; a tool with a ``lookup`` is asked what
it recorded under the key; a non-idempotent tool is escalated (``tool_call_uncertain``),
then the task fails or waits for a human to reconcile it, and the tool is never re-run
blindly (RELIABILITY.md R3). ``docs/architecture.md`` has the whole table.

Before each attempt acts, the run checks by its own clock that its lease can still be
trusted (:meth:`~wal_engine.runtime.run.TaskRun.lease_trusted`): if not, the attempt is
recorded as not started and the run stops, so a worker that lost its lease starts no
effect. Sync functions run on the worker's thread pool, where ``timeout_s`` applies too.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any, ClassVar, Final

import msgspec

from replay.journal import Fresh, InDoubt, Outcome, Retry
from replay.state import CallKind, CallStatus
from wal_engine import events as ev
from wal_engine import failpoints
from wal_engine.budgets import BudgetTrip
from wal_engine.clock import now_ms
from wal_engine.effects.gateway import Claim
from wal_engine.errors import (
    CallTimedOut,
    InvalidPayload,
    RateLimited,
    ResultTypeError,
    ToolError,
)
from wal_engine.ids import idempotency_key
from wal_engine.observability import metrics
from wal_engine.observability.logs import get_logger
from wal_engine.retries import (
    Disposition,
    LeaseExpired,
    RetryPolicy,
    backoff_delay_s,
    classify_failure,
    is_transient,
)
from wal_engine.runtime.control import (
    RETRY_TIMER_PREFIX,
    Fenced,
    Finished,
    StoppedAfterCall,
    Suspended,
    approval_signal,
    current_call_claim,
    lease_check,
    reconcile_signal,
)
from wal_engine.runtime.limiters import CallLimit, acquire, block, call_key, settle
from wal_engine.runtime.steps import (
    RESULT_TYPE_ERROR,
    LlmResponse,
    ThreadWaiting,
    call_function,
    convert_result,
    outlast,
    wait_signal,
)
from wal_engine.security.redaction import (
    has_secret_refs,
    resolve_secret_refs,
    scrub_values,
    secrets_in,
)
from wal_engine.state_machine import Status

if TYPE_CHECKING:
    from wal_engine.runtime.ports import Run

log = get_logger(__name__)

error_text_max: Final = 2000
attempts_max: Final = 1000
"""Bound on the retry loop of one call (the policy's max_attempts is far lower)."""


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One ``ctx.tool`` call as the driver makes it: the arguments as given (``args``) and
    as recorded (``stored_args``, redacted, and their hash), and the call's options."""

    name: str
    function: Any
    args: Any
    stored_args: Any
    args_hash: str
    idempotent: bool
    retry: RetryPolicy
    timeout_s: float | None
    on_uncertain: str
    lookup: Any
    result_type: Any = None
    limit: CallLimit | None = None
    """The limiter each attempt takes a grant of before its intent (``limiter=``)."""

    kind: ClassVar[str] = "tool"
    intent_redacted: ClassVar[bool] = True
    """The intent carries ``stored_args``, already redacted."""

    def intent(self, call_id: str, key: str, attempt: int) -> ev.Event:
        """The intent, from the arguments as already redacted (``stored_args``)."""
        return ev.ToolCallIntended(
            call_id=call_id, tool=self.name, args=self.stored_args, args_hash=self.args_hash,
            idempotency_key=key, idempotent=self.idempotent, attempt=attempt)

    def failed(self, call_id: str, attempt: int, error_type: str, error: str, *,
               retryable: bool = False, retry_at_ms: int | None = None) -> ev.Event:
        """An attempt's failure, as recorded."""
        return ev.ToolCallFailed(call_id=call_id, attempt=attempt, error_type=error_type,
                                 error=error, retryable=retryable, retry_at_ms=retry_at_ms)

    async def budget_trip(self, run: Run, *, in_loop: bool) -> BudgetTrip | None:
        """The budget an attempt would trip (a retry within one run is not checked again:
        the call's first attempt was)."""
        return None if in_loop else run.check_budget(planned_tool_calls=1)


class LlmSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One ``ctx.llm`` call as the driver makes it. An LLM call is always safe to repeat
    under its key (it only costs tokens; the recorded response wins)."""

    name: str
    """The model."""
    function: Any
    args: Any
    """The request as given."""
    args_hash: str
    retry: RetryPolicy
    timeout_s: float | None
    result_type: Any = None
    limit: CallLimit | None = None
    """The limiter each attempt takes a grant of before its intent (``limiter=``); the
    grant's estimate is settled to the usage recorded."""

    kind: ClassVar[str] = "llm"
    intent_redacted: ClassVar[bool] = False
    idempotent: ClassVar[bool] = True
    lookup: ClassVar[None] = None
    on_uncertain: ClassVar[str] = "fail"

    def intent(self, call_id: str, key: str, attempt: int) -> ev.Event:
        """The intent (the request is redacted as it is appended)."""
        return ev.LlmCallIntended(call_id=call_id, model=self.name, request=self.args,
                                  request_hash=self.args_hash, idempotency_key=key,
                                  attempt=attempt)

    def failed(self, call_id: str, attempt: int, error_type: str, error: str, *,
               retryable: bool = False, retry_at_ms: int | None = None) -> ev.Event:
        """An attempt's failure, as recorded."""
        return ev.LlmCallFailed(call_id=call_id, attempt=attempt, error_type=error_type,
                                error=error, retryable=retryable, retry_at_ms=retry_at_ms)

    async def budget_trip(self, run: Run, *, in_loop: bool) -> BudgetTrip | None:
        """The task's budget, then the tenant's LLM spend cap, before every attempt."""
        return run.check_budget() or await run.check_tenant_spend()


CallSpec = ToolSpec | LlmSpec


def wall_ms(run: Run) -> int:
    """The run's clock in milliseconds since the epoch."""
    return now_ms(run.services.clock)


def intent_seq(run: Run) -> int:
    """The seq the next intent will get (a step_started may go first)."""
    return run.head_seq + (2 if run.status is Status.CHECKPOINTED else 1)


def error_text(run: Run, error: BaseException, secrets: tuple[str, ...]) -> str:
    """An error's text as the log may hold it: the call's resolved secrets and anything
    credential-like removed, then cut to the bound (in that order: a credential cut in half
    would no longer be recognised)."""
    return run.redact_text(scrub_values(str(error), secrets))[:error_text_max]


def call_claim(run: Run, key: str) -> Claim:
    """The call in flight as the gateway and ``ctx.call_claim`` see it."""
    return Claim(key=key, owner=run.worker_id, epoch=run.epoch, task_id=run.task_id)


async def wait_until(run: Run, call_id: str, attempt: int, due_at_ms: int | None,
                      policy: RetryPolicy) -> None:
    """Wait for a retry's due time: in memory if short, as a durable timer if long."""
    delay_ms = 0 if due_at_ms is None else due_at_ms - wall_ms(run)
    # The due time was computed on the wall clock of whichever worker recorded the failure;
    # no backoff exceeds the policy's cap, so a skewed clock cannot stretch it (RELIABILITY
    # K1: a worker an hour ahead would otherwise park the retry for an hour).
    delay_ms = min(delay_ms, round(policy.max_delay_s * 1000))
    timer_id = f"{RETRY_TIMER_PREFIX}{call_id}:{attempt}"
    timer = run.view.calls.get(timer_id)
    if timer is not None:
        if timer.status is CallStatus.PENDING:
            await run.append([ev.TimerFired(timer_id=timer_id)])
        return
    if delay_ms <= 0:
        return
    if delay_ms > policy.durable_after_s * 1000:
        await run.append([ev.TimerStarted(timer_id=timer_id, wake_at_ms=wall_ms(run) + delay_ms,
                                          duration_ms=delay_ms)])
        raise Suspended
    await run.services.clock.sleep(delay_ms / 1000)
    run.check_live()


class CallDriver:
    """One external call, a tool's or an LLM's, through intent, attempts and outcome.

    The kind of call (``spec``) says what differs: the events it writes, the budgets checked
    before an attempt, whether a repeat is safe (an LLM call's always is), and how a result
    is recorded. Everything else, the attempt loop, failure recording, backoff, lease checks
    and secret resolution, is the same for both.
    """

    def __init__(self, run: Run, spec: CallSpec) -> None:
        self.run = run
        self.spec = spec
        self.secrets_used: tuple[str, ...] = ()
        """Values of the secret references resolved for the attempt in flight."""
        self.grant_key: str | None = None
        """The key of the limiter grant of the attempt in flight (with ``spec.limit``)."""

    async def drive(self, outcome: Outcome, *, approval: bool = False) -> Any:
        """Drive the call from the journal's answer to its outcome."""
        if isinstance(outcome, Fresh):
            if approval:
                await self._approved(outcome.call_id)
            return await self._first_attempt(outcome.call_id)
        if isinstance(outcome, Retry):
            return await self._next_attempt(outcome.call_id, outcome.attempt,
                                            outcome.idempotency_key, outcome.due_at_ms)
        assert isinstance(outcome, InDoubt)
        return await self._in_doubt(outcome)

    async def _intend(self, call_id: str, key: str, attempt: int, *, in_loop: bool) -> None:
        """Check the budgets, then append the attempt's intent."""
        run, spec = self.run, self.spec
        trip = await spec.budget_trip(run, in_loop=in_loop)
        if trip is not None:
            await run.fail_budget(trip)
        if spec.limit is not None:
            await self._take_grant(call_id, attempt, call_key(call_id, attempt))
        await run.append([spec.intent(call_id, key, attempt)], redacted=spec.intent_redacted)

    async def _take_grant(self, call_id: str, attempt: int, grant_key: str) -> None:
        """With a limiter: wait for its grant of this attempt (before the intent, so an
        unknown limiter or a long wait leaves nothing of the attempt in the log)."""
        limit = self.spec.limit
        if limit is None:
            return
        await acquire(self.run, limit, call_id, attempt, grant_key,
                      durable_after_s=self.spec.retry.durable_after_s)
        self.grant_key = grant_key
        failpoints.hit("after_limiter_grant")

    async def _rate_limited(self, error: Exception) -> None:
        """A 429 under a limiter: block it for every worker until Retry-After; the refused
        request counts as a request, with no tokens."""
        limit = self.spec.limit
        if limit is None or not isinstance(error, RateLimited):
            return
        await block(self.run, limit, error.retry_after_s)
        if self.grant_key is not None:
            await settle(self.run, limit, self.grant_key, 0, 0)

    async def _first_attempt(self, call_id: str) -> Any:
        key = idempotency_key(self.run.task_id, intent_seq(self.run))
        tool = self.spec.kind == "tool"
        if tool:
            failpoints.hit("before_intent_append")
        await self._intend(call_id, key, 1, in_loop=False)
        if tool:
            failpoints.hit("after_intent_commit")
        return await self._attempts(call_id, key, 1)

    async def _next_attempt(self, call_id: str, attempt: int, key: str | None,
                            due_at_ms: int | None) -> Any:
        assert key is not None
        await wait_until(self.run, call_id, attempt, due_at_ms, self.spec.retry)
        await self._intend(call_id, key, attempt, in_loop=False)
        return await self._attempts(call_id, key, attempt)

    async def _attempts(self, call_id: str, key: str, attempt: int) -> Any:
        """Run attempts until one succeeds, a failure that ends the call, or the call is in
        doubt (then looked up or escalated)."""
        run, spec = self.run, self.spec
        for _ in range(attempts_max):
            try:
                # Secret references are resolved at call time, for this attempt only. Their
                # values, and those redacted from the arguments by key name, are scrubbed
                # from the outcome too: a callee may echo them. A failure here happens
                # before the call: it did not act.
                self.secrets_used = secrets_in(run.redactor, spec.args)
                if has_secret_refs(spec.args):
                    argument, resolved = await resolve_secret_refs(spec.args,
                                                                   run.services.secrets)
                    self.secrets_used += resolved
                else:
                    argument = spec.args
            except Exception as error:
                failure: Exception = error
                verdict = classify_failure(error, spec.retry, attempt, repeat_safe=True)
            else:
                if not run.lease_trusted():
                    await self._stop_untrusted(call_id, attempt)
                found, value = await self._attempt(call_id, key, attempt, argument)
                if found:
                    return value
                failure, verdict = value
                await self._rate_limited(failure)
            retry_at = await self._record_failure(call_id, attempt, failure, verdict)
            if retry_at is None:
                raise ToolError(call_id, type(failure).__name__,
                                error_text(run, failure, self.secrets_used)) from failure
            _stop_unless_leased(run, failure)
            attempt += 1
            await wait_until(run, call_id, attempt, retry_at, spec.retry)
            await self._intend(call_id, key, attempt, in_loop=True)
        raise ToolError(call_id, "RetryLimit", f"more than {attempts_max} attempts")

    async def _attempt(self, call_id: str, key: str, attempt: int,
                       argument: Any) -> tuple[bool, Any]:
        """One attempt: ``(True, result as recorded)``, or ``(False, (error, verdict))``
        for a failure to record."""
        run, spec = self.run, self.spec
        tokens = current_call_claim.set(call_claim(run, key)), lease_check.set(run.lease_trusted)
        try:
            with self._thread_watch(call_id) as waiting:
                result = await call_function(spec.function, argument, spec.timeout_s,
                                             run.executor, waiting, self._forced)
            if spec.kind == "tool":
                failpoints.hit("after_effect_before_result")
        except StoppedAfterCall as stop:
            await self._record_stopped(call_id, key, attempt, stop)
            raise
        except Exception as error:
            verdict = classify_failure(error, spec.retry, attempt,
                                       repeat_safe=spec.idempotent)
            if verdict is Disposition.IN_DOUBT:
                found, value = await self._resolve_doubt(call_id, key, attempt, error)
                if found:
                    return True, value
                verdict = value
            return False, (error, verdict)
        finally:
            current_call_claim.reset(tokens[0])
            lease_check.reset(tokens[1])
        recorded = await self._record_result(call_id, attempt, result)
        if spec.kind == "tool":
            failpoints.hit("after_result_commit")
        return True, recorded

    async def _stop_untrusted(self, call_id: str, attempt: int) -> None:
        """Start no effect on a lease this worker can no longer trust (checked before every
        attempt): record the attempt as not started (the next owner retries it instead of
        escalating it) and stop."""
        run = self.run
        run.log.warning("effect_not_started", call_id=call_id, reason="lease_untrusted")
        await run.append([self.spec.failed(
            call_id, attempt, LeaseExpired.__name__,
            "the lease could not be trusted when the attempt was due: it did not start",
            retryable=True, retry_at_ms=wall_ms(run))])
        run.fence("lease expired by the worker's own clock before an effect")
        raise Fenced

    async def _record_failure(self, call_id: str, attempt: int, error: Exception,
                              verdict: Disposition) -> int | None:
        run, spec = self.run, self.spec
        retryable = verdict is Disposition.RETRY
        retry_at = None
        if retryable:
            delay_s = backoff_delay_s(spec.retry, run.task_id, run.head_seq, attempt)
            retry_after = error.retry_after_s if isinstance(error, RateLimited) else None
            if isinstance(retry_after, int | float) and math.isfinite(retry_after):
                delay_s = max(delay_s, float(retry_after))  # wait_until caps it at max_delay_s
            retry_at = wall_ms(run) + round(delay_s * 1000)
        await run.append([spec.failed(
            call_id, attempt, type(error).__name__,
            error_text(run, error, self.secrets_used), retryable=retryable,
            retry_at_ms=retry_at)])
        log.info(f"{spec.kind}_attempt_failed", task_id=run.task_id, call_id=call_id,
                 attempt=attempt, retryable=retryable, error_type=type(error).__name__)
        metrics.call_failed(spec.kind, retryable)
        return retry_at

    async def _record_result(self, call_id: str, attempt: int, result: Any) -> Any:
        """Record the result; return it as recorded (redacted), as a replay would."""
        if isinstance(self.spec, LlmSpec):
            return await self._record_response(call_id, attempt, _as_response(result))
        value = scrub_values(result, self.secrets_used)
        typed = _untyped if self.spec.result_type is None else await self._typed(
            call_id, attempt, value)
        stored = await self._store(call_id, attempt,
                                   ev.ToolCallCompleted(call_id=call_id, result=value))
        assert isinstance(stored, ev.ToolCallCompleted)
        return stored.result if typed is _untyped else typed

    async def _typed(self, call_id: str, attempt: int, value: Any) -> Any:
        """``value`` as recorded, converted to the call's ``result_type`` (``_untyped`` if
        it cannot be stored: recording then says so). A mismatch is recorded as the call's
        failure, not retried (the same value would not fit again)."""
        result_type = self.spec.result_type
        try:
            recorded = self.run.redact(value)
        except InvalidPayload:
            return _untyped
        try:
            return convert_result(call_id, recorded, result_type)
        except ResultTypeError as error:
            await self.run.append([self.spec.failed(
                call_id, attempt, RESULT_TYPE_ERROR, self.run.redact_text(error.error))])
            raise

    async def _record_response(self, call_id: str, attempt: int,
                               response: LlmResponse) -> Any:
        """Record an LLM response and its usage; return its content as recorded."""
        problem = _usage_problem(response)
        if problem is not None:
            # Negative usage would be added to the task's totals and offset the budget
            # (a task with max_tokens=100 ran on after reporting -3,000 tokens).
            await self.run.append([self.spec.failed(call_id, attempt, "InvalidUsage", problem)])
            raise ToolError(call_id, "InvalidUsage", problem)
        content = scrub_values(response.content, self.secrets_used)
        typed = _untyped if self.spec.result_type is None else await self._typed(
            call_id, attempt, content)
        stored = await self._store(call_id, attempt, ev.LlmCallCompleted(
            call_id=call_id, response=content, input_tokens=response.input_tokens,
            output_tokens=response.output_tokens, cost_usd=response.cost_usd))
        assert isinstance(stored, ev.LlmCallCompleted)
        await self.run.add_tenant_spend(stored.cost_usd)
        if self.spec.limit is not None and self.grant_key is not None:
            await settle(self.run, self.spec.limit, self.grant_key, stored.input_tokens,
                         stored.output_tokens)
        return stored.response if typed is _untyped else typed

    async def _store(self, call_id: str, attempt: int, success: ev.Event) -> ev.Event:
        """Append ``success``, or a storable failure instead if it cannot be stored (then
        raise); return ``success`` as recorded."""
        what = "the tool's result" if self.spec.kind == "tool" else "the LLM response"
        stored = await self.run.store_result_or_failure(success, self.spec.failed(
            call_id, attempt, "UnstorableResult", f"{what} cannot be stored"))
        if stored is None:
            raise ToolError(call_id, "UnstorableResult", f"{what} cannot be stored")
        return stored

    async def _resolve_doubt(self, call_id: str, key: str, attempt: int,
                             error: Exception) -> tuple[bool, Any]:
        """An attempt of a call not safe to repeat failed ambiguously: ``(True, result)``
        if its ``lookup`` found what it did, ``(False, disposition)`` if the lookup says
        it never acted; escalated otherwise (which unwinds or returns the reconciled
        result as ``(True, result)``)."""
        spec = self.spec
        if isinstance(error, CallTimedOut) and error.still_running():
            await self._outlast(call_id, error)
        if spec.lookup is not None:
            looked_up, found = await self._look_up(call_id, key)
            if looked_up and found is not None:
                return True, await self._record_result(call_id, attempt, found)
            if looked_up:
                transient = is_transient(error, spec.retry)
                more = attempt < spec.retry.max_attempts
                return False, Disposition.RETRY if transient and more else Disposition.FAIL
        reason = _doubt_reason(error)
        return True, await self._escalate(call_id, attempt, reason, error)

    async def _outlast(self, call_id: str, error: CallTimedOut) -> None:
        """Wait until the thread of a timed-out sync call has ended. It cannot be stopped
        and may still act: a lookup asked before could say "not acted" a moment before it
        acts, and an escalation recorded before would let a human reconcile the call (by
        doing it by hand) once the grace period passed, while the thread could still act
        (found by an audit: reconcile accepted at 1 s, the thread charged at 2.4 s). The
        lease keeper's thread renews the lease meanwhile, so no other worker takes the
        call over; the loop is not blocked.

        A stop of the worker meanwhile does not cut the wait short (the task would be
        handed back while the thread may act); once the thread has ended the run unwinds
        as stopped, and the next owner looks the call up or escalates it."""
        assert error.thread is not None
        self.run.log.warning("call_overran", call_id=call_id, timeout_s=error.timeout_s,
                             reason="waiting for the timed-out call's thread to end")
        with self._thread_watch(call_id, error.timeout_s) as waiting:
            stopped = await outlast(asyncio.wrap_future(error.thread), waiting,
                                    self._forced)
        if stopped:
            raise asyncio.CancelledError("the worker stopped while a timed-out call's "
                                         "thread ran; it has ended")

    def _forced(self) -> bool:
        """Whether the worker is going away without a drain (a cancellation not waited
        through: the task is left to lease expiry, as in a crash)."""
        return self.run.stop_forced

    def _thread_watch(self, call_id: str, timeout_s: float | None = None) -> _ThreadWatch:
        """A ``waiting`` callback for a wait on a sync call's thread, as a context manager:
        it logs the wait (``drain_waiting_on_thread`` while the worker stops,
        ``call_overran`` again while a timed-out call's thread runs on) and counts the call
        in the ``wal_engine_sync_calls_overrunning`` gauge until the wait ends."""
        return _ThreadWatch(self.run.log, call_id, timeout_s)

    async def _record_stopped(self, call_id: str, key: str, attempt: int,
                              stop: StoppedAfterCall) -> None:
        """Record the outcome of an attempt whose run was stopped while its thread ran, now
        that the thread has ended: the result, or the failure as classified (in doubt:
        looked up or escalated, with the thread over). Never another attempt: the run
        unwinds after this and hands its task back."""
        spec = self.spec
        try:
            if not stop.failed:
                await self._record_result(call_id, attempt, stop.outcome)
                return
            error = stop.outcome
            if not isinstance(error, Exception):
                raise stop  # The thread died of a BaseException: left in doubt in the log.
            verdict = classify_failure(error, spec.retry, attempt, repeat_safe=spec.idempotent)
            if verdict is Disposition.IN_DOUBT:
                found, value = await self._resolve_doubt(call_id, key, attempt, error)
                if found:
                    return
                verdict = value
            await self._record_failure(call_id, attempt, error, verdict)
        except ToolError:
            pass  # Recorded (a result that does not fit its type, say): the run unwinds.

    async def _look_up(self, call_id: str, key: str) -> tuple[bool, Any]:
        """Ask the callee what it recorded under ``key``: ``(True, result or None)``, or
        ``(False, None)`` if the lookup itself failed (then the call stays in doubt)."""
        assert self.spec.lookup is not None
        try:
            return True, await self.spec.lookup(key)
        except Exception as error:
            self.run.log.warning("lookup_failed", call_id=call_id,
                                 error=self.run.redact_text(repr(error)))
            return False, None

    async def _in_doubt(self, outcome: InDoubt) -> Any:
        """The crash fell between intent and outcome (window 2 of RELIABILITY.md W3)."""
        run, spec = self.run, self.spec
        key = outcome.idempotency_key
        assert key is not None
        if outcome.escalated:
            return await self._reconcile(outcome.call_id, outcome.attempt)
        looked_up = False
        if spec.lookup is not None:
            looked_up, found = await self._look_up(outcome.call_id, key)
            if looked_up and found is not None:
                return await self._record_result(outcome.call_id, outcome.attempt, found)
        # Idempotent: the key makes another delivery safe. With a lookup that found nothing
        # under the key, the callee never acted: sending now is the first delivery.
        if spec.idempotent or looked_up:
            log.info("in_doubt_retry", task_id=run.task_id, call_id=outcome.call_id, key=key)
            metrics.call_retried(spec.kind, "in_doubt")
            # Sent again: the provider may have seen the first sending, so it counts again.
            await self._take_grant(outcome.call_id, outcome.attempt,
                                   call_key(outcome.call_id, outcome.attempt, run.epoch))
            return await self._attempts(outcome.call_id, key, outcome.attempt)
        return await self._escalate(outcome.call_id, outcome.attempt, "interrupted", None)

    async def _escalate(self, call_id: str, attempt: int, reason: str,
                        error: Exception | None) -> Any:
        """Record the call as uncertain, with when a human may reconcile it, and hand it to
        ``on_uncertain``. Until ``not_before_ms`` the previous attempt may still act (its
        thread, or a stopped worker continued), so ``engine.reconcile`` refuses before it."""
        run, spec = self.run, self.spec
        grace_ms = max(round((spec.timeout_s or 0) * 1000), run.lease_ttl_ms)
        text = None if error is None else error_text(run, error, self.secrets_used)
        await run.append([ev.ToolCallUncertain(
            call_id=call_id, policy=spec.on_uncertain, reason=reason,
            error_type=None if error is None else type(error).__name__, error=text,
            not_before_ms=wall_ms(run) + grace_ms)])
        log.warning("call_uncertain", task_id=run.task_id, call_id=call_id,
                    policy=spec.on_uncertain, reason=reason)
        metrics.call_escalated(spec.kind, reason)
        await run.run_hook("on_escalation", reason, {
            "call_id": call_id, "tool": spec.name, "error_type": type(error).__name__
            if error is not None else None, "error": text, "policy": spec.on_uncertain})
        return await self._reconcile(call_id, attempt)

    async def _reconcile(self, call_id: str, attempt: int) -> Any:
        """An escalated call: fail the task, or wait for a human's reconciliation signal."""
        run = self.run
        if self.spec.on_uncertain != "wait":
            await run.fail("uncertain_side_effect", None, diagnostic_extra={
                "call_id": call_id, "tool": self.spec.name})
            raise Finished
        signal_name = reconcile_signal(call_id)
        received = _received_signals(run, signal_name)
        payload = received[0] if received else await wait_signal(run, signal_name, None)
        if isinstance(payload, dict) and "error" in payload:
            await run.append([ev.ToolCallFailed(
                call_id=call_id, attempt=attempt, error=str(payload["error"])[:error_text_max],
                error_type="Reconciled", retryable=False)])
            raise ToolError(call_id, "Reconciled", str(payload["error"]))
        result = payload.get("result") if isinstance(payload, dict) else payload
        return await self._record_result(call_id, attempt, result)

    async def _approved(self, call_id: str) -> None:
        """Wait until a human approved this exact call (tool and hash of its arguments);
        a refusal fails the task."""
        run, spec = self.run, self.spec
        planned = spec.stored_args if isinstance(spec, ToolSpec) else None
        decision = await decide_approval(run, call_id, spec.name, spec.args_hash, planned)
        if decision.approved:
            return
        await run.fail("approval_refused", None, diagnostic_extra={
            "call_id": call_id, "tool": spec.name, "approver": decision.approver})
        raise Finished


async def decide_approval(run: Run, call_id: str, tool: str, hashed: str,
                          args: Any = None) -> ev.ApprovalDecided:
    """Request a human's decision on the planned call ``call_id`` (``tool`` with arguments
    ``args``, recorded redacted, of hash ``hashed``) and wait durably for it; return it
    once recorded.

    Raises:
        ToolError: too many answers that did not match the planned call.
    """
    signal_name = approval_signal(call_id)
    approval = run.view.approvals.get(call_id)
    if approval is None:
        await run.append([ev.ApprovalRequested(call_id=call_id, tool=tool, args_hash=hashed,
                                               signal_name=signal_name, args=args)])
    elif approval.approved is not None:
        assert approval.approver is not None
        return ev.ApprovalDecided(call_id=call_id, approved=approval.approved,
                                  approver=approval.approver, args_hash=approval.args_hash,
                                  comment=approval.comment)
    # Approvals already received (a crash fell between receipt and decision) are
    # decided again first, in order, before waiting for another one.
    received = iter(_received_signals(run, signal_name))
    for _ in range(attempts_max):
        payload = next(received, _none)
        if payload is _none:
            payload = await wait_signal(run, signal_name, None)
        decision = _approval_decision(payload)
        if decision is None or decision.args_hash != hashed:
            log.warning("approval_rejected", task_id=run.task_id, call_id=call_id,
                        reason="does not match the planned call")
            continue
        decided = ev.ApprovalDecided(
            call_id=call_id, approved=decision.approved, approver=decision.approver,
            args_hash=decision.args_hash, comment=decision.comment)
        await run.append([decided])
        return decided
    raise ToolError(call_id, "ApprovalLimit", "too many approvals that did not match")


_none: Final = object()
_untyped: Final = object()


def _doubt_reason(error: BaseException) -> str:
    """Why an attempt is in doubt, as ``tool_call_uncertain`` records it."""
    if isinstance(error, TimeoutError):
        return "timed_out"
    if isinstance(error, ConnectionError):
        return "connection_lost"
    return "error_after_start"


def _stop_unless_leased(run: Run, error: BaseException) -> None:
    """After a failure recorded as retryable: make no further attempt on a lease this
    worker cannot trust (the next owner makes it, under the same key)."""
    if isinstance(error, LeaseExpired) or not run.lease_trusted():
        run.fence("lease expired by the worker's own clock")
        raise Fenced


def _received_signals(run: Run, name: str) -> list[Any]:
    """Payloads of the internal signal ``name`` already received, in order (consumed from
    the inbox: waiting again would never see them)."""
    return [call.result for call in run.view.calls.values()
            if call.kind is CallKind.SIGNAL and call.name == name
            and call.status is CallStatus.COMPLETED]


def _approval_decision(payload: Any) -> ev.ApprovalDecided | None:
    """The decision a signal payload carries, or None if it is malformed."""
    if not isinstance(payload, dict):
        return None
    approver, hashed = payload.get("approver"), payload.get("args_hash")
    approved, comment = payload.get("approved"), payload.get("comment")
    if not isinstance(approver, str) or not approver or not isinstance(hashed, str):
        return None
    if not isinstance(approved, bool) or not (comment is None or isinstance(comment, str)):
        return None
    return ev.ApprovalDecided(call_id="", approved=approved, approver=approver,
                              args_hash=hashed, comment=comment)


def _usage_problem(response: LlmResponse) -> str | None:
    """Why the usage an LLM function reported cannot be counted, or None."""
    for name in ("input_tokens", "output_tokens"):
        value = getattr(response, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name} must be a non-negative integer, not {value!r}"[:error_text_max]
    cost = response.cost_usd
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not (
            math.isfinite(cost) and cost >= 0):
        return f"cost_usd must be a finite non-negative number, not {cost!r}"[:error_text_max]
    return None


def _as_response(raw: Any) -> LlmResponse:
    if isinstance(raw, LlmResponse):
        return raw
    if isinstance(raw, dict) and "content" in raw:
        return LlmResponse(
            content=raw["content"], input_tokens=int(raw.get("input_tokens", 0)),
            output_tokens=int(raw.get("output_tokens", 0)),
            cost_usd=float(raw.get("cost_usd", 0.0)),
        )
    return LlmResponse(content=raw)


class _ThreadWatch:
    """:meth:`CallDriver._thread_watch`: a plain class rather than a generator-based
    context manager, because every attempt enters one (most never wait on a thread)."""

    __slots__ = ("call_id", "counted", "log", "timeout_s")

    def __init__(self, log_: Any, call_id: str, timeout_s: float | None) -> None:
        self.log, self.call_id, self.timeout_s = log_, call_id, timeout_s
        self.counted: str | None = None

    def __enter__(self) -> ThreadWaiting:
        return self.waiting

    def __exit__(self, *_exc: object) -> None:
        if self.counted is not None:
            metrics.sync_call_overrun_ended()

    def waiting(self, waited_s: float, stopped: bool) -> None:
        """Told the seconds waited on the thread so far and whether the run was stopped."""
        if self.counted is None:
            self.counted = "stopping" if stopped else "timed_out"
            metrics.sync_call_overrunning(self.counted)
        if stopped:
            self.log.warning("drain_waiting_on_thread", call_id=self.call_id,
                             waited_s=round(waited_s, 3),
                             reason="a sync call's thread still runs: the task is handed "
                                    "back once it has ended")
        elif waited_s > 0:
            self.log.warning("call_overran", call_id=self.call_id, timeout_s=self.timeout_s,
                             waited_s=round(waited_s, 3),
                             reason="the timed-out call's thread still runs")
