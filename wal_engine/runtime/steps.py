"""What the agent context and the call driver share: calling a user function (on the loop
or the worker's thread pool, with a timeout), converting a recorded result to the type the
code asks for, and delivering signals from the inbox.

Below both :mod:`wal_engine.runtime.context` (the facade agent code sees) and
:mod:`wal_engine.runtime.calls` (the write-ahead protocol of calls), so that neither
imports the other's internals.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import threading
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from replay.journal import Recorded
from wal_engine import events as ev
from wal_engine import failpoints
from wal_engine.errors import (
    CallTimedOut,
    DidNotAct,
    LeaseExpired,
    ResultTypeError,
    ToolError,
)
from wal_engine.payloads import decode_payload
from wal_engine.runtime.control import (
    Fenced,
    StoppedAfterCall,
    StoppedDuringCall,
    Suspended,
    lease_check,
)
from wal_engine.store import queries

if TYPE_CHECKING:
    from wal_engine.runtime.ports import Run

error_text_max: Final = 2000
"""Longest error text a failed conversion records (msgspec's message, cut)."""
thread_report_interval_s: Final = 5.0
"""How often a run waiting for a sync call's thread to end says so again in the logs."""


class LlmResponse(msgspec.Struct, frozen=True, kw_only=True):
    """What an LLM function returns: the response and its usage (journaled with it)."""

    content: Any = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0


def recorded_value(outcome: Recorded, result_type: Any = None) -> Any:
    """What a recorded outcome gives the code: its result (converted to ``result_type``
    when given), or its failure raised as :class:`ToolError`/:class:`ResultTypeError`."""
    error = outcome.error
    if error is not None:
        if error.error_type == RESULT_TYPE_ERROR:
            raise ResultTypeError(outcome.call_id, error.error)
        raise ToolError(outcome.call_id, error.error_type, error.error)
    if result_type is None:
        return outcome.result
    return convert_result(outcome.call_id, outcome.result, result_type)


RESULT_TYPE_ERROR: Final = ResultTypeError.__name__
"""The ``error_type`` a call's failure records when its result did not convert."""


def convert_result(call_id: str, value: Any, result_type: Any) -> Any:
    """``value`` (a result as recorded) converted to ``result_type`` by msgspec, from its
    plain JSON form: live and on replay alike, the code gets the same typed value.

    Raises:
        ResultTypeError: it does not convert.
    """
    try:
        return msgspec.convert(msgspec.to_builtins(value), result_type)
    except (msgspec.ValidationError, TypeError) as error:
        raise ResultTypeError(call_id, str(error)[:error_text_max]) from error


async def wait_signal(run: Run, name: str, timeout_ms: int | None) -> Any:
    """Deliver a signal from the inbox, or wait durably for one (also for internal waits)."""
    found, payload = await take_signal(run, name)
    if found:
        return payload
    await run.append([ev.SignalAwaited(name=name, timeout_ms=timeout_ms)])
    # A signal that committed while our wait was being written may have missed the wake-up
    # (its sender saw the task RUNNING). Looking once more after the commit closes the race.
    if await _unconsumed_signals(run, name, 1):
        try:
            await run.append([ev.TaskWoken(reason="signal")])
        except Fenced:
            # The sender committed after our wait and woke the task itself (its wake-up
            # took the seq first): nothing is left to do here either way.
            raise Suspended from None
        await run.services.database.fetch(queries.WAKE_WORKERS)
    raise Suspended


async def _unconsumed_signals(run: Run, name: str, limit: int) -> list[Any]:
    return await run.services.database.fetch(queries.READ_SIGNALS, run.task_id, name,
                                           list(run.view.signal_ids), limit)


async def take_signal(run: Run, name: str) -> tuple[bool, Any]:
    """Consume the oldest unconsumed signal ``name``: ``(True, payload)``, or ``(False, None)``."""
    rows = await _unconsumed_signals(run, name, 1)
    if not rows:
        return False, None
    payload = decode_payload(rows[0]["payload"])
    await run.append([ev.SignalReceived(name=name, payload=payload,
                                        signal_id=rows[0]["signal_id"])])
    received = run.last_appended[-1]
    assert isinstance(received, ev.SignalReceived)
    return True, received.payload


def _is_async(function: Callable[[Any], Any]) -> bool:
    """Whether calling ``function`` returns a coroutine without running anything first."""
    if type(function) is types.FunctionType and function.__code__.co_flags & _CO_COROUTINE:
        return True  # An ``async def`` (every call of most agents): no inspect walk.
    target = function.func if isinstance(function, functools.partial) else function
    # An object whose __call__ is async (a class-based tool) is async too. B004 is about
    # testing callability, which is not what this asks.
    call = getattr(target, "__call__", None)  # noqa: B004
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)


_CO_COROUTINE: Final = inspect.CO_COROUTINE

ThreadWaiting = Callable[[float, bool], None]
"""Told, while a run waits for a sync call's thread to end, the seconds waited so far and
whether the run was stopped meanwhile (at the start, then every few seconds)."""


async def call_function(function: Callable[[Any], Any], argument: Any,
                        timeout_s: float | None,
                        executor: concurrent.futures.Executor | None,
                        waiting: ThreadWaiting | None = None,
                        forced: Callable[[], bool] | None = None) -> Any:
    """Call a user function with an optional timeout: an async one on the loop, a sync one
    on ``executor`` (the worker's pool; the loop itself only without one), in a copy of
    the caller's context so that ``ctx.idempotency_key`` and :func:`ensure_lease` work.
    ``forced()`` says whether a cancellation is a forced stop (not waited through).

    A sync call waits for a free thread within its ``timeout_s``; one that never got a
    thread is dropped before it starts, and one whose lease can no longer be trusted when
    its thread is free does not start either. A run cancelled (a stop past its drain time)
    while the call's thread runs waits for the thread to end (telling ``waiting``): the
    thread cannot be stopped, and a task handed back meanwhile would let the next owner
    escalate or look the call up while it may still act.

    Raises:
        CallTimedOut: past ``timeout_s`` (a sync call's thread may still be running it).
        DidNotAct: a sync call found no free thread within ``timeout_s``: it never started.
        LeaseExpired: the lease could not be trusted when the sync call's thread was free.
        StoppedAfterCall: cancelled while the thread ran; it has ended, with this outcome.
        StoppedDuringCall: cancelled twice (a forced stop) while the thread still ran.
    """
    failpoints.hit("during_effect")
    if executor is None or _is_async(function):
        result = function(argument)
        if not inspect.isawaitable(result):
            return result
        if not timeout_s:
            return await result
        try:
            return await asyncio.wait_for(result, timeout_s)
        except TimeoutError as error:
            raise CallTimedOut(timeout_s, None) from error
    loop = asyncio.get_running_loop()
    gate = _StartGate()
    try:
        thread = loop.run_in_executor(executor, contextvars.copy_context().run, _gated,
                                      gate, function, argument)
    except RuntimeError as error:
        # The pool is shut down: the worker is going away and this attempt never started.
        # It unwinds the run like the cancellation it is, never as the tool's failure.
        raise asyncio.CancelledError("the worker's thread pool is shut down") from error
    sent_at = time.monotonic()
    try:
        result = await asyncio.wait_for(asyncio.shield(thread), timeout_s)
    except TimeoutError as error:
        if gate.abandon():
            # Every thread of the pool was busy (timed-out sync calls keep theirs): the
            # attempt is dropped before it starts, never to act after it was given up on.
            raise DidNotAct(f"no thread of the worker's pool was free within {timeout_s} s: "
                            "the call did not start") from error
        raise CallTimedOut(timeout_s or 0.0, _thread_future(thread)) from error
    except asyncio.CancelledError:
        if gate.abandon():
            raise  # The run is going away: a call still queued never starts.
        if forced is not None and forced():
            raise StoppedDuringCall("stopped without a drain while a sync call's thread "
                                    "ran; the task is left to lease expiry") from None
        await outlast(thread, waiting, forced, stopped=True)
        raise _stopped_after(thread, timeout_s, time.monotonic() - sent_at) from None
    if inspect.isawaitable(result):  # A sync function that returned a coroutine.
        return await (asyncio.wait_for(result, timeout_s) if timeout_s else result)
    return result


async def outlast(thread: asyncio.Future[Any], waiting: ThreadWaiting | None,
                  forced: Callable[[], bool] | None = None, *, stopped: bool = False) -> bool:
    """Wait until a sync call's ``thread`` has ended, through one cancellation of the run
    (a graceful stop that ran out of drain time): the lease keeper renews the lease
    meanwhile, so no other worker takes the call over while the thread may act. Returns
    whether the run was stopped (cancelled) before or during the wait.

    Raises:
        StoppedDuringCall: cancelled again, or cancelled when ``forced()`` says the stop
            is a forced one, while the thread still ran.
    """
    started = time.monotonic()
    if waiting is not None:
        waiting(0.0, stopped)
    while not thread.done():
        try:
            # asyncio.wait never cancels what it waits for: the thread's future stays.
            await asyncio.wait({thread}, timeout=thread_report_interval_s)
        except asyncio.CancelledError:
            if stopped or (forced is not None and forced()):
                raise StoppedDuringCall("stopped again while a sync call's thread ran; "
                                        "the task is left to lease expiry") from None
            stopped = True
            if waiting is not None:
                waiting(time.monotonic() - started, stopped)
            continue
        if not thread.done() and waiting is not None:
            waiting(time.monotonic() - started, stopped)
    return stopped


def _stopped_after(thread: asyncio.Future[Any], timeout_s: float | None,
                   elapsed_s: float) -> StoppedAfterCall:
    """The outcome of a sync call whose run was stopped while its thread ran, now that
    the thread has ended: past ``timeout_s`` it timed out (in doubt, as it would have been
    without the stop), otherwise what the function returned or raised."""
    if timeout_s and elapsed_s > timeout_s:
        return StoppedAfterCall(CallTimedOut(timeout_s, _thread_future(thread)), failed=True)
    error = thread.exception()
    if error is not None:
        return StoppedAfterCall(error, failed=True)
    result = thread.result()
    if result is _abandoned:  # Cannot happen (the gate said it started); never a result.
        return StoppedAfterCall(DidNotAct("the call did not start"), failed=True)
    return StoppedAfterCall(result, failed=False)


class _StartGate:
    """Whether a sync attempt queued on the pool starts, or was given up on before it did:
    decided once, under a lock, by whichever comes first (the thread starting it, or the
    loop timing it out or being cancelled)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: str | None = None

    def start(self) -> bool:
        """In the thread: True if the attempt may start (it was not given up on)."""
        with self._lock:
            self._state = self._state or "started"
            return self._state == "started"

    def abandon(self) -> bool:
        """On the loop: True if the attempt had not started (now it never will)."""
        with self._lock:
            self._state = self._state or "abandoned"
            return self._state == "abandoned"


_abandoned: Final = object()


def _gated(gate: _StartGate, function: Callable[[Any], Any], argument: Any) -> Any:
    """Run in a pool thread (in the caller's context copy): start ``function`` only if the
    attempt was not given up on while queued and the lease can still be trusted, which the
    loop checked when it queued the call, possibly long before a thread was free."""
    if not gate.start():
        return _abandoned
    check = lease_check.get()
    if check is not None and not check():
        raise LeaseExpired("the lease could not be trusted when a thread was free for the "
                           "call: it did not start")
    return function(argument)


def _thread_future(thread: asyncio.Future[Any]) -> concurrent.futures.Future[Any]:
    """A thread-safe view of whether the executor's work is done."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def finished(future: asyncio.Future[Any]) -> None:
        # Retrieve the late outcome, so that asyncio does not report it as never retrieved:
        # the attempt was already recorded as timed out.
        if not future.cancelled():
            future.exception()
        done.set_result(None)

    if thread.done():
        finished(thread)  # At once: a caller may ask still_running() before the loop turns.
    else:
        thread.add_done_callback(finished)
    return done
