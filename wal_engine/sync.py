"""A synchronous client for sync web apps (Flask, Django, any WSGI server) and scripts.

An :class:`~wal_engine.engine.Engine` is asyncio through and through. A sync application
cannot await it, and must not start an event loop per request (the engine's pool belongs
to one loop). :func:`connect_sync` therefore runs one engine on an event loop of its own,
in a daemon thread, and every method hands its coroutine to that loop and blocks the
calling thread until the answer comes back. Many request threads may call one client at
once (the pool serves them concurrently); create it once per process, at start-up::

    from wal_engine.sync import connect_sync

    engine = connect_sync()                     # dsn=..., else WAL_ENGINE_DSN, else embedded

    @app.post("/tickets")
    def create_ticket():
        task_id = engine.submit("triage", request.get_json())
        return {"task_id": task_id}

The client submits and steers tasks; the workers that run them are separate processes
(``wal-engine worker --agents module:register``). Errors are the engine's own
(:class:`~wal_engine.errors.WalError` subclasses), raised in the calling thread; a
:meth:`SyncEngine.wait` that runs out of time raises :class:`TimeoutError`. After a fork
(gunicorn's pre-fork model) create the client in each worker process (``post_fork``), not
in the parent: a thread does not survive ``fork()``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Final, TypeVar

from wal_engine.errors import ConfigurationError

if TYPE_CHECKING:
    from replay.state import AgentState
    from wal_engine.engine import Engine
    from wal_engine.events import Budget
    from wal_engine.store import EventRecord, TaskHead

T = TypeVar("T")

close_timeout_s: Final = 30.0
thread_name: Final = "wal-engine-sync"


class SyncEngine:
    """A blocking facade over an engine that runs on its own event loop thread.

    Build it with :func:`connect_sync`. It is a context manager (``with connect_sync() as
    engine:``); :meth:`close` closes the engine's pool and stops the thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 engine: Engine) -> None:
        self._loop = loop
        self._thread = thread
        self.engine: Final = engine
        """The asyncio engine underneath (use it only from the client's loop)."""
        self._closed = False

    def _call(self, work: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        if self._closed:
            work.close()
            raise ConfigurationError("this wal-engine sync client is closed")
        future: Future[T] = asyncio.run_coroutine_threadsafe(work, self._loop)
        return future.result(timeout_s)

    def submit(self, agent: str, input: Any = None, *, budget: Budget | None = None,
               task_id: str | None = None) -> str:
        """Queue a task (see :meth:`Engine.submit`); returns its id."""
        return str(self._call(self.engine.submit(agent, input, budget=budget,
                                                 task_id=task_id)))

    def signal(self, task_id: str, name: str, payload: Any = None, *,
               dedup_key: str | None = None) -> int:
        """Put a signal in a task's inbox (see :meth:`Engine.signal`); returns its id."""
        return self._call(self.engine.signal(task_id, name, payload, dedup_key=dedup_key))

    def approve(self, task_id: str, call_id: str, *, approver: str, approved: bool = True,
                args_hash: str | None = None, comment: str | None = None) -> int:
        """Answer a pending approval (see :meth:`Engine.approve`)."""
        return self._call(self.engine.approve(task_id, call_id, approver=approver,
                                              approved=approved, args_hash=args_hash,
                                              comment=comment))

    def cancel(self, task_id: str, *, reason: str = "cancelled",
               requested_by: str | None = None) -> bool:
        """Cancel a task (see :meth:`Engine.cancel`); False if it had already finished."""
        return self._call(self.engine.cancel(task_id, reason=reason,
                                             requested_by=requested_by))

    def state(self, task_id: str) -> AgentState:
        """The task's folded state (see :meth:`Engine.state`)."""
        return self._call(self.engine.state(task_id))

    def head(self, task_id: str) -> TaskHead:
        """The task's head row: status, seq, lease (see :meth:`Engine.head`)."""
        return self._call(self.engine.head(task_id))

    def history(self, task_id: str) -> list[EventRecord]:
        """Every event of the task, in seq order (see :meth:`Engine.history`)."""
        return self._call(self.engine.history(task_id))

    def wait(self, task_id: str, *, timeout_s: float | None = None) -> AgentState:
        """Block until the task is COMPLETED or FAILED; return its final state.

        Raises:
            TimeoutError: It did not finish within ``timeout_s``.
        """
        return self._call(self.engine.wait(task_id, timeout_s=timeout_s))

    def close(self) -> None:
        """Close the engine and stop the loop thread (idempotent)."""
        if self._closed:
            return
        try:
            self._call(self.engine.close(), close_timeout_s)
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(close_timeout_s)

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def connect_sync(dsn: str | None = None, **options: Any) -> SyncEngine:
    """Connect an engine on a private event-loop thread and return its blocking client.

    Takes the arguments of :func:`wal_engine.engine.connect` (``dsn``, ``tenant=``,
    ``development=``, ``pool_size_max=``, ...) and raises what it raises.
    """
    from wal_engine.engine import connect

    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=serve, name=thread_name, daemon=True)
    thread.start()
    ready.wait()
    try:
        engine = asyncio.run_coroutine_threadsafe(connect(dsn, **options), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(close_timeout_s)
        raise
    return SyncEngine(loop, thread, engine)
