"""``ctx.transaction``: a DB-local effect, its dedup row and its result event in one
transaction (exactly once for effects on the engine's own database).

The attempt bookkeeping (intent, backoff, failure text) is the call driver's
(:mod:`wal_engine.runtime.calls`); what differs is that a failed attempt rolled back whole,
so it never acted and is never in doubt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from replay.journal import Fresh, InDoubt, Outcome, Retry
from wal_engine import events as ev
from wal_engine.effects.gateway import StaleEpoch
from wal_engine.errors import (
    AmbiguousCommit,
    ConcurrencyConflict,
    DatabaseUnavailable,
    InvalidPayload,
    LeaseLost,
    ToolError,
    UnknownTask,
)
from wal_engine.ids import idempotency_key
from wal_engine.retries import Disposition, RetryPolicy, backoff_delay_s, classify_failure
from wal_engine.runtime.calls import (
    attempts_max,
    call_claim,
    error_text,
    intent_seq,
    wait_until,
    wall_ms,
)
from wal_engine.runtime.control import current_call_claim
from wal_engine.security.redaction import redact_event
from wal_engine.store.connection import CONNECTION_ERRORS

if TYPE_CHECKING:
    from wal_engine.runtime.ports import Run


async def run_transaction(run: Run, outcome: Outcome, name: str,
                          function: Callable[[Any, Any], Any], args: Any, hashed: str,
                          policy: RetryPolicy) -> Any:
    """A DB-local effect: the effect, its dedup row and the result event in one transaction.

    A failed attempt rolled back whole, so it did not act: a transient failure is retried
    under the same key, any other is recorded and raised as a ``ToolError``. An in-doubt
    transaction call never committed (the result event would be in the log otherwise), so
    it is simply run again under the same key.
    """
    key: str
    if isinstance(outcome, Fresh):
        call_id, attempt = outcome.call_id, 1
        key = idempotency_key(run.task_id, intent_seq(run))
        await run.append([ev.ToolCallIntended(call_id=call_id, tool=name, args=args,
                                              args_hash=hashed, idempotency_key=key)])
    else:
        assert isinstance(outcome, InDoubt | Retry) and outcome.idempotency_key is not None
        call_id, key, attempt = outcome.call_id, outcome.idempotency_key, outcome.attempt
        if isinstance(outcome, Retry):
            await wait_until(run, call_id, attempt, outcome.due_at_ms, policy)
            await run.append([_transaction_intent(call_id, name, args, hashed, key, attempt)])
    for _ in range(attempts_max):
        try:
            return await _transaction_attempt(run, call_id, key, function, args)
        except InvalidPayload as error:
            # The result cannot be stored, so the transaction rolled back whole: nothing
            # acted. Recorded as the call's failure, as for a tool (never left pending).
            await run.append([ev.ToolCallFailed(
                call_id=call_id, attempt=attempt, error_type="UnstorableResult",
                error="the effect's result cannot be stored", retryable=False)])
            raise ToolError(call_id, "UnstorableResult", str(error)) from error
        except _INFRASTRUCTURE:
            raise
        except Exception as error:
            verdict = classify_failure(error, policy, attempt, repeat_safe=True)
            retry_at = None
            if verdict is Disposition.RETRY:
                retry_at = wall_ms(run) + round(1000 * backoff_delay_s(
                    policy, run.task_id, run.head_seq, attempt))
            text = error_text(run, error, ())
            await run.append([ev.ToolCallFailed(
                call_id=call_id, attempt=attempt, error=text, error_type=type(error).__name__,
                retryable=retry_at is not None, retry_at_ms=retry_at)])
            if retry_at is None:
                raise ToolError(call_id, type(error).__name__, text) from error
        attempt += 1
        await wait_until(run, call_id, attempt, retry_at, policy)
        await run.append([_transaction_intent(call_id, name, args, hashed, key, attempt)])
    raise ToolError(call_id, "RetryLimit", f"more than {attempts_max} attempts")


def _transaction_intent(call_id: str, name: str, args: Any, hashed: str, key: str,
                        attempt: int) -> ev.ToolCallIntended:
    return ev.ToolCallIntended(call_id=call_id, tool=name, args=args, args_hash=hashed,
                               idempotency_key=key, attempt=attempt)


async def _transaction_attempt(run: Run, call_id: str, key: str,
                               function: Callable[[Any, Any], Any], args: Any) -> Any:
    """One attempt of a DB-local effect, its dedup row and its result event."""
    pending: dict[str, Any] = {}

    async def record(connection: Any, result: Any) -> None:
        # Appended outside TaskRun.append, so redacted here (the gateway already did: kept
        # as a second line, it changes nothing then).
        event = redact_event(ev.ToolCallCompleted(call_id=call_id, result=result),
                             run.redactor, bytes_max=run.services.store.payload_bytes_max)
        encoded = [ev.encode_event(event, payload_bytes_max=run.services.store.payload_bytes_max)]
        pending["append"] = await run.services.store.append_events(
            run.task_id, [event], epoch=run.epoch, expected_seq=run.head_seq,
            prev_hash=run.head_hash, connection=connection, encoded=encoded)
        # As the log holds it: what a replay returns (decision 61).
        pending["event"] = ev.decode_event(*encoded[0])

    claim = call_claim(run, key)
    # Like a tool, the effect can read its key and epoch (ctx.idempotency_key, current_call).
    token = current_call_claim.set(claim)
    try:
        result = await run.services.gateway.run_in_transaction(
            claim, lambda connection: function(connection, args), record)
    finally:
        current_call_claim.reset(token)
    if "append" in pending:
        run.adopt_append(pending["event"], pending["append"])
        return pending["event"].result
    return result


_INFRASTRUCTURE: Final = (ToolError, LeaseLost, ConcurrencyConflict, UnknownTask, StaleEpoch,
                          DatabaseUnavailable, AmbiguousCommit, *CONNECTION_ERRORS)
"""Failures of a DB-local effect that are the engine's, not the effect's: the run handles
them (fenced, interrupted), they are never recorded as the call's failure."""
