"""Group commit: the pending appends of many tasks flushed in one statement and one commit.

Each task run has at most one append in flight (its code is sequential), so a flush holds
at most one batch per task. When nothing is being flushed, a request is sent at once (a
lone task pays no extra latency); while flushes are in flight, requests accumulate and go
together in the next one. Every task in a flush is fenced on its own
(``Store.append_many``), so one stale task never rejects the others.
"""

from __future__ import annotations

import asyncio
from typing import Final

import structlog

from wal_engine.store import AppendResult, PendingAppend, Store
from wal_engine.store.connection import CONNECTION_ERRORS

log = structlog.get_logger(__name__)

flushes_in_flight_max: Final = 1
"""Concurrent flush statements; each holds one pooled connection."""

flush_tasks_max: Final = 256
"""Most task batches in one statement."""


class _Request:
    __slots__ = ("append", "future")

    def __init__(self, append: PendingAppend, future: asyncio.Future[AppendResult]) -> None:
        self.append = append
        self.future = future


class GroupCommitter:
    """Coalesces appends of different tasks into shared statements."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pending: list[_Request] = []
        self._in_flight = 0
        self._flushers: set[asyncio.Task[None]] = set()
        self.flushes = 0
        self.appends = 0

    async def append(self, append: PendingAppend) -> AppendResult:
        """Queue one task's batch; returns its new head or raises its own error."""
        if self._in_flight == 0 and not self._pending:
            # Nothing to share a commit with: send it from this task, saving the hand-off
            # to a flusher task (an event-loop turn) on the lone-task path.
            self._in_flight += 1
            try:
                result = await self.store.append_events(
                    append.task_id, append.events, epoch=append.epoch,
                    expected_seq=append.expected_seq, prev_hash=append.prev_hash,
                    encoded=append.encoded,
                )
                self.flushes += 1
                self.appends += 1
                return result
            finally:
                self._in_flight -= 1
                self._maybe_flush()
        future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(append, future))
        self._maybe_flush()
        return await future

    def _maybe_flush(self) -> None:
        while self._pending and self._in_flight < flushes_in_flight_max:
            taken, self._pending = self._pending[:flush_tasks_max], self._pending[flush_tasks_max:]
            self._in_flight += 1
            flusher = asyncio.create_task(self._flush(taken))
            self._flushers.add(flusher)
            flusher.add_done_callback(self._flushers.discard)

    async def _flush(self, requests: list[_Request]) -> None:
        try:
            if len(requests) == 1:
                await self._flush_one(requests[0])
            else:
                await self._flush_many(requests)
            self.flushes += 1
            self.appends += len(requests)
        finally:
            self._in_flight -= 1
            self._maybe_flush()

    async def _flush_one(self, request: _Request) -> None:
        append = request.append
        try:
            result = await self.store.append_events(
                append.task_id, append.events, epoch=append.epoch,
                expected_seq=append.expected_seq, prev_hash=append.prev_hash,
                encoded=append.encoded,
            )
        except BaseException as error:  # Delivered to the waiting task run, not lost.
            _settle(request, error)
            return
        _settle(request, result)

    async def _flush_many(self, requests: list[_Request]) -> None:
        try:
            results = await self.store.append_many([r.append for r in requests])
        except CONNECTION_ERRORS:
            # The shared commit's outcome is unknown: resolve each task on its own path,
            # which reads back by key (RELIABILITY.md R4).
            await asyncio.gather(*(self._flush_one(r) for r in requests))
            return
        except BaseException as error:
            for request in requests:
                _settle(request, error)
            return
        for request in requests:
            _settle(request, results[request.append.task_id])

    async def close(self) -> None:
        """Wait for flushes in flight."""
        while self._flushers:
            await asyncio.gather(*list(self._flushers), return_exceptions=True)


def _settle(request: _Request, outcome: AppendResult | BaseException) -> None:
    if request.future.done():
        return
    if isinstance(outcome, BaseException):
        request.future.set_exception(outcome)
    else:
        request.future.set_result(outcome)
