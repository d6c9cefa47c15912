"""Leases kept from a thread of their own, and a watchdog of the worker's event loop.

A worker's heartbeat used to be a coroutine on the worker's event loop: any code that
blocked the loop (a plain ``def`` tool, a CPU-bound parse of a tool result, a quadratic
regex) stopped the renewals, the lease expired, another worker took the task over and ran
the effect again. The :class:`LeaseKeeper` renews every lease of its worker from a thread
with an event loop and a PostgreSQL connection of its own, so a blocked loop cannot cost a
live lease while the process runs (a stopped or killed process stops the thread too, and
its leases expire as before).

It also keeps, for each lease, the instant until which the worker may trust it by its own
monotonic clock: the send time of the last successful renewal (or of the claim) plus the
TTL less a margin. The database started the TTL no earlier than that send time, so the
local bound never outlives the database's. Before starting an effect a task run asks
:meth:`LeaseKeeper.valid`: a worker whose renewals stopped (database unreachable, process
stopped and continued) does not start another effect on a lease it may have lost, without
a round trip.

The watchdog pings the worker's loop from the keeper's thread. A ping not answered within
``stall_warn_ms`` is a stall: it is logged once with the stack the loop is stuck in (its
cause), and counted; its length is logged when the loop answers again. A loop unresponsive
for longer than ``stall_abandon_ms`` is presumed wedged: the keeper stops renewing its
leases, so that the tasks are taken over instead of being held forever; the wedged code,
should it ever wake, finds its local lease expired and starts no effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Final

import asyncpg
import msgspec

from wal_engine import failpoints
from wal_engine.errors import DatabaseError
from wal_engine.failpoints import SimulatedCrash
from wal_engine.observability import metrics
from wal_engine.observability.logs import get_logger
from wal_engine.retries import RECONNECT_RETRY, retrying
from wal_engine.store import queries
from wal_engine.store.connection import CONNECTION_ERRORS, connect_once, is_unavailable

log = get_logger(__name__)

watchdog_interval_max_s: Final = 0.25
stop_timeout_s: Final = 5.0
stack_frames_max: Final = 8


def lease_margin_ms(lease_ttl_ms: int) -> int:
    """How much sooner than the database a worker stops trusting its lease (a tenth of the
    TTL: room for clock rates and for the moment between the check and the effect)."""
    return lease_ttl_ms // 10


class LoopStalls(msgspec.Struct, kw_only=True):
    """What the watchdog saw of the worker's event loop."""

    count: int = 0
    """Stalls longer than the warning threshold."""
    worst_ms: float = 0.0
    """The longest time the loop took to answer a ping."""
    last_cause: str | None = None
    """Where the loop was stuck during the last stall (innermost frames)."""


class _Lease(msgspec.Struct, kw_only=True):
    epoch: int
    valid_until: float
    """Monotonic seconds: the worker trusts the lease until then."""


class LeaseKeeper:
    """Renews one worker's leases from its own thread; answers whether a lease is valid.

    Args:
        dsn: Where to connect.
        session_settings: The engine's session settings for the keeper's connection.
        lease_ttl_ms: The lease TTL the claims and renewals set.
        heartbeat_ms: Interval of renewals.
        stall_warn_ms: A loop that does not answer a ping for this long is stalled.
        stall_abandon_ms: A loop stalled this long is presumed wedged: its leases lapse.
        on_lost: Called on the worker's loop with ``(task_id, epoch)`` when a renewal
            finds a lease taken over.
        pooler: The connection pooler in front of the database (``"transaction"``,
            ``"session"`` or None; :mod:`wal_engine.store.pooler`).
    """

    def __init__(self, *, dsn: str, session_settings: Mapping[str, str], lease_ttl_ms: int,
                 heartbeat_ms: int, stall_warn_ms: int, stall_abandon_ms: int,
                 on_lost: Callable[[str, int], None], worker_id: str,
                 pooler: str | None = None) -> None:
        self.dsn = dsn
        self.pooler = pooler
        self.worker_id = worker_id
        self.session_settings = dict(session_settings)
        self.lease_ttl_ms = lease_ttl_ms
        self.heartbeat_s = heartbeat_ms / 1000
        self.stall_warn_s = stall_warn_ms / 1000
        self.stall_abandon_s = stall_abandon_ms / 1000
        self.on_lost = on_lost
        self.stalls = LoopStalls()
        self.renewals = 0
        self.log = log.bind(worker_id=worker_id)
        self._trust_s = (lease_ttl_ms - lease_margin_ms(lease_ttl_ms)) / 1000
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self._main_thread_id = threading.get_ident()
        self._ping_sent: float | None = None
        self._stall_reported = False
        self._abandoned = False

    # ------------------------------------------------------------------ the worker's side

    def hold(self, task_id: str, epoch: int, sent_at: float) -> None:
        """Keep the lease of ``task_id`` at ``epoch``, set by a statement sent at
        ``sent_at`` (monotonic seconds)."""
        with self._lock:
            self._leases[task_id] = _Lease(epoch=epoch, valid_until=sent_at + self._trust_s)

    def drop(self, task_id: str) -> None:
        """Stop renewing the lease of ``task_id`` (its run ended)."""
        with self._lock:
            self._leases.pop(task_id, None)

    def valid(self, task_id: str, epoch: int) -> bool:
        """Whether the worker may still trust its lease of ``task_id`` at ``epoch``, by its
        own monotonic clock (no round trip)."""
        with self._lock:
            lease = self._leases.get(task_id)
            return (lease is not None and lease.epoch == epoch
                    and time.monotonic() < lease.valid_until)

    def valid_for_s(self, task_id: str, epoch: int) -> float:
        """Seconds the lease may still be trusted (0 when it may not)."""
        with self._lock:
            lease = self._leases.get(task_id)
            if lease is None or lease.epoch != epoch:
                return 0.0
            return max(0.0, lease.valid_until - time.monotonic())

    def start(self) -> None:
        """Start the keeper's thread (from the worker's running loop)."""
        self._main_loop = asyncio.get_running_loop()
        self._main_thread_id = threading.get_ident()
        self._thread = threading.Thread(target=self._thread_main, name="wal-engine-leases",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (bounded)."""
        loop, stop = self._thread_loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # Its loop already closed.
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(stop_timeout_s)

    # ------------------------------------------------------------------ the thread

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._thread_loop = loop
        self._stop = asyncio.Event()
        try:
            loop.run_until_complete(self._main())
        except SimulatedCrash as crash:
            # A crash point fired in the heartbeat: the keeper 'dies', its leases lapse.
            self.log.warning("simulated_crash", point=str(crash))
        finally:
            loop.close()

    async def _main(self) -> None:
        watchdog = asyncio.ensure_future(self._watch())
        try:
            await self._renew_forever()
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog

    async def _sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True once the keeper is stopping."""
        assert self._stop is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def _connect(self) -> asyncpg.Connection:
        """The renewals' own session, reconnecting (RECONNECT_RETRY) until the keeper stops
        (then :class:`_KeeperStopped`)."""

        async def pause(seconds: float) -> None:
            if await self._sleep(seconds):
                raise _KeeperStopped

        def failed(error: BaseException, attempt: int, delay_s: float) -> None:
            self.log.warning("worker_connect_failed", role="heartbeat", error=repr(error),
                             attempt=attempt, delay_s=round(delay_s, 3))

        return await retrying(RECONNECT_RETRY,
                              lambda: connect_once(self.dsn, self.session_settings,
                                                   pooler=self.pooler),
                              retry_if=_outage, key=f"{self.worker_id}:heartbeat",
                              on_retry=failed, sleep=pause)

    async def _renew_forever(self) -> None:
        while True:
            try:
                connection = await self._connect()
            except _KeeperStopped:
                return
            try:
                while True:
                    started = time.monotonic()
                    await self._renew(connection)
                    # Renewals start a heartbeat apart, however long each took: waiting a
                    # whole heartbeat after a slow reply would leave the next one less of
                    # the lease to arrive in.
                    pause_s = self.heartbeat_s - (time.monotonic() - started)
                    # Clamped: a clock stepped back (a faked or jumping clock) must not
                    # stretch the pause past one heartbeat.
                    if await self._sleep(min(self.heartbeat_s, max(0.0, pause_s))):
                        return
            except (*CONNECTION_ERRORS, asyncpg.PostgresError) as error:
                self.log.warning("worker_connection_lost", role="heartbeat", error=repr(error))
            except Exception as error:
                # The thread must outlive any error: a dead keeper leaves every lease to
                # expire while the worker believes it is working.
                self.log.error("worker_loop_failed", role="heartbeat", error=repr(error))
                if await self._sleep(RECONNECT_RETRY.initial_delay_s):
                    return
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(connection.close(), 2)

    async def _renew(self, connection: asyncpg.Connection) -> None:
        if self._wedged():
            return
        with self._lock:
            held = {task_id: lease.epoch for task_id, lease in self._leases.items()}
        if not held:
            return
        failpoints.hit("during_heartbeat")
        sent_at = time.monotonic()
        rows = await connection.fetch(queries.RENEW_LEASES, list(held), list(held.values()),
                                      self.lease_ttl_ms, timeout=self._renewal_timeout_s(sent_at))
        renewed = {row["task_id"] for row in rows}
        self.renewals += 1
        with self._lock:
            for task_id, epoch in held.items():
                lease = self._leases.get(task_id)
                if lease is None or lease.epoch != epoch:
                    continue  # Dropped or re-claimed meanwhile.
                if task_id in renewed:
                    lease.valid_until = sent_at + self._trust_s
                else:
                    lease.valid_until = 0.0  # Taken over: trust it no more, at once.
        for task_id in held.keys() - renewed:
            self._to_worker(self.on_lost, task_id, held[task_id])

    def _renewal_timeout_s(self, now: float) -> float:
        """How long a renewal may wait for its reply: as long as the soonest lease that is
        still trusted may be trusted (at least a second).

        A slow reply is worth waiting for until then: the statement may already have run,
        and giving up costs a reconnect, several round trips on the same slow link, so the
        lease would lapse before the next renewal got through (a jitter soak broke 26 live
        leases when renewals gave up after one heartbeat). Past that moment the worker
        stops trusting the lease anyway, and a new session is the only way forward.
        """
        with self._lock:
            soonest = min((lease.valid_until for lease in self._leases.values()
                           if lease.valid_until > now), default=now + self._trust_s)
        return max(1.0, soonest - now)

    def _wedged(self) -> bool:
        """Whether the worker's loop has not answered for longer than ``stall_abandon_s``."""
        sent = self._ping_sent
        wedged = sent is not None and time.monotonic() - sent > self.stall_abandon_s
        if wedged and not self._abandoned:
            self.log.error("leases_abandoned", reason="the event loop is not answering",
                           stalled_s=round(time.monotonic() - (sent or 0.0), 3),
                           cause=self._main_stack())
        self._abandoned = wedged
        return wedged

    def _to_worker(self, callback: Callable[..., None], *args: Any) -> bool:
        loop = self._main_loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            return False  # The worker's loop closed meanwhile.
        return True

    # ------------------------------------------------------------------ the watchdog

    async def _watch(self) -> None:
        interval_s = min(watchdog_interval_max_s, self.stall_warn_s / 2)
        while True:
            now = time.monotonic()
            sent = self._ping_sent
            if sent is None:
                self._ping_sent = now
                if not self._to_worker(self._pong, now):
                    self._ping_sent = None
            elif now - sent >= self.stall_warn_s and not self._stall_reported:
                self._stall_reported = True
                cause = self._main_stack()
                self.stalls.count += 1
                self.stalls.last_cause = cause
                metrics.loop_stalled()
                self.log.warning("event_loop_stalled", stalled_ms=round((now - sent) * 1000),
                                 cause=cause)
            await asyncio.sleep(interval_s)

    def _pong(self, sent: float) -> None:
        """Runs on the worker's loop: the ping sent at ``sent`` got through."""
        lag_s = time.monotonic() - sent
        self.stalls.worst_ms = max(self.stalls.worst_ms, lag_s * 1000)
        if self._stall_reported:
            self.log.warning("event_loop_stall_ended", stalled_ms=round(lag_s * 1000),
                             cause=self.stalls.last_cause)
        self._stall_reported = False
        self._ping_sent = None

    def _main_stack(self) -> str:
        """The innermost frames the worker's thread is running (what blocks its loop)."""
        frame = sys._current_frames().get(self._main_thread_id)
        if frame is None:
            return "unknown"
        frames = traceback.extract_stack(frame)[-stack_frames_max:]
        return " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
                           for f in reversed(frames))


class _KeeperStopped(Exception):
    """The keeper was stopped while its session was reconnecting."""


def _outage(error: BaseException) -> bool:
    """A database outage, or a SQL error of the renewal session's start (waited out):
    ``connect_once`` makes a SQLSTATE the engine has no error of its own for (a revoked
    CONNECT, 42501) a :class:`DatabaseError`, which must be waited out too, or the
    keeper's thread would end and every lease lapse."""
    return is_unavailable(error) or isinstance(error, DatabaseError | asyncpg.PostgresError)
