"""A side-effect ledger: fake services that count how often each idempotency key really acted.

The ledger lives in the test's database (table ``wal_test_effects``), so it counts the
effects of worker subprocesses too, and survives the crash of any of them. Each fake
service stands for one class of tool (RELIABILITY.md, "Tool classes"):

============  ==========================================  ===============================
class         the fake service                            what the engine must achieve
============  ==========================================  ===============================
``db``        writes in the engine's own transaction      exactly once: applied == 1
              (use with ``ctx.transaction``)
``idem``      dedups on the key (returns the stored       applied <= 1 (deliveries may be
              response to a repeated delivery)            more: retries reuse the key)
``lookup``    acts on every delivery; offers              applied <= 1: an in-doubt call
              ``lookup(key)`` (status by key)             is looked up, re-sent only if unseen
``unsafe``    acts on every delivery, no dedup, no        deliveries <= 1: an in-doubt call
              lookup (use with ``idempotent=False``)      is escalated, never re-sent
``llm``       answers deterministically from the request  re-calls allowed (cost only)
============  ==========================================  ===============================

Every fake is fencing-aware like a careful receiver: a delivery carrying an older lease
epoch than the task's current one is refused (:class:`StaleDelivery`) and counted as
``stale_rejected``; and like a careful tool, it calls
:func:`~wal_engine.runtime.context.ensure_lease` right before it acts.

A fake can be scripted per attempt (``script=``, a :class:`Behaviour` for each attempt of
each key: return, raise before acting, act then raise, act then answer late, block before
acting, act then lose the worker's database connections) and comes in a sync variant
(``sync=True``: a plain ``def`` that the worker runs on its thread pool, blocking that
thread where the async one awaits). Attempts are counted too (``attempts``), before
anything else, so a script can tell the first attempt from a retry.

:func:`check_effects` turns the counts into violations of I4 (acted twice), I5 (acted
without a durable intent), I6 (completed without acting) and I7 (two owners acting under
one epoch).

Usage, inside the function that registers your agents::

    ledger = EffectLedger.for_engine(engine)
    charge = ledger.service("charge", kind="unsafe", result=lambda args: {"ok": True})

    @engine.agent("billing")
    async def billing(ctx, task_input):
        return await ctx.tool("charge", charge, task_input, idempotent=False)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, Final, Literal, TypeVar

import msgspec

from wal_engine.events import ToolCallCompleted, ToolCallIntended
from wal_engine.retries import DidNotAct, PermanentError, TransientError
from wal_engine.runtime.context import LlmResponse, current_call, ensure_lease
from wal_engine.store import Database, EventRecord
from wal_engine.store.connection import CONNECTION_ERRORS
from wal_engine.testing.invariants import Violation, read_snapshot

ToolClass = Literal["db", "idem", "lookup", "unsafe", "llm"]
TOOL_CLASSES: Final = ("db", "idem", "lookup", "unsafe", "llm")
ResultSource = Callable[[Any], Any] | Any
T = TypeVar("T")
Outcome = Literal["return", "did_not_act", "act_then_raise", "act_then_sleep", "block",
                  "lose_connections"]
OUTCOMES: Final = ("return", "did_not_act", "act_then_raise", "act_then_sleep", "block",
                   "lose_connections")

LEDGER_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS wal_test_effects (
        key            text PRIMARY KEY,
        task_id        text,
        tool           text NOT NULL,
        tool_class     text NOT NULL,
        attempts       integer NOT NULL DEFAULT 0,
        deliveries     integer NOT NULL DEFAULT 0,
        applied        integer NOT NULL DEFAULT 0,
        stale_rejected integer NOT NULL DEFAULT 0,
        owners         text[] NOT NULL DEFAULT '{}',
        epochs         bigint[] NOT NULL DEFAULT '{}',
        result         bytea
    )
    """,
)

# A delivery is counted in its own statement, before the effect, so that it is counted even
# when the effect then fails or the caller dies. The task's current epoch is read in the
# same statement: a delivery with an older epoch is a zombie's, refused when $7 is true
# and then counted as stale instead of delivered.
DELIVER: Final = """
WITH verdict AS (
    SELECT $7::bool AND coalesce((SELECT lease_epoch FROM wal_tasks
                                   WHERE tenant = current_setting('wal.tenant', true)
                                     AND task_id = $2) > $6, false) AS stale
)
INSERT INTO wal_test_effects AS e (key, task_id, tool, tool_class, deliveries, stale_rejected,
                                   owners, epochs)
SELECT $1, $2, $3, $4, CASE WHEN v.stale THEN 0 ELSE 1 END, CASE WHEN v.stale THEN 1 ELSE 0 END,
       CASE WHEN v.stale THEN '{}'::text[] ELSE ARRAY[$5::text] END,
       CASE WHEN v.stale THEN '{}'::int8[] ELSE ARRAY[$6::int8] END
  FROM verdict v
ON CONFLICT (key) DO UPDATE SET deliveries = e.deliveries + EXCLUDED.deliveries,
                                stale_rejected = e.stale_rejected + EXCLUDED.stale_rejected,
                                owners = e.owners || EXCLUDED.owners,
                                epochs = e.epochs || EXCLUDED.epochs
RETURNING (SELECT stale FROM verdict) AS stale, e.deliveries
"""
APPLY_ALWAYS: Final = """
UPDATE wal_test_effects SET applied = applied + 1, result = $2 WHERE key = $1
RETURNING result
"""
# The receiver's own dedup: act only if this key never acted, else answer as the first time.
APPLY_ONCE: Final = """
WITH acted AS (
    UPDATE wal_test_effects SET applied = applied + 1, result = $2
     WHERE key = $1 AND applied = 0
    RETURNING result
)
SELECT result FROM acted
UNION ALL
SELECT result FROM wal_test_effects WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM acted)
"""
# Counted before anything else, so that a script sees which attempt this is.
ATTEMPT: Final = """
INSERT INTO wal_test_effects AS e (key, task_id, tool, tool_class, attempts)
VALUES ($1, $2, $3, $4, 1)
ON CONFLICT (key) DO UPDATE SET attempts = e.attempts + 1
RETURNING e.attempts
"""
LOOKUP: Final = "SELECT applied, result FROM wal_test_effects WHERE key = $1"
# What a lost database looks like to a worker: every session of the engine (its pool, its
# heartbeat, sweep and listen connections) ends at once, except the one asking.
LOSE_CONNECTIONS: Final = """
SELECT coalesce(array_agg(pid), '{}') AS pids FROM (
    SELECT pid FROM pg_stat_activity
     WHERE datname = current_database() AND pid <> pg_backend_pid()
       AND application_name LIKE 'wal-engine:%' AND pg_terminate_backend(pid)
     LIMIT 10000) AS ended
"""
STILL_CONNECTED: Final = "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = ANY($1::int[])"
lose_wait_s: Final = 5.0
READ_EFFECTS: Final = """
SELECT key, task_id, tool, tool_class, attempts, deliveries, applied, stale_rejected, owners,
       epochs
  FROM wal_test_effects ORDER BY key LIMIT $1
"""
READ_EFFECTS_IF_PRESENT: Final = """
SELECT key, task_id, tool, tool_class, attempts, deliveries, applied, stale_rejected, owners,
       epochs
  FROM wal_test_effects ORDER BY key
"""
effects_read_max: Final = 1_000_000


class OutcomeUnknown(PermanentError):
    """A non-deduplicating fake lost the answer of a delivery: whether it acted is unknown."""


class StaleDelivery(PermanentError):
    """A delivery carried an older lease epoch than the task's current one (a zombie's)."""


class Behaviour(msgspec.Struct, frozen=True, kw_only=True):
    """What a scripted fake does on one attempt of a call.

    ``outcome``:

    * ``return``: act, answer;
    * ``did_not_act``: raise :class:`~wal_engine.retries.DidNotAct` before acting;
    * ``act_then_raise``: act, then raise ``ConnectionResetError`` (the answer was lost);
    * ``act_then_sleep``: act, then answer after ``sleep_s`` (past the call's timeout);
    * ``block``: wait ``sleep_s`` before acting (the sync variant blocks its thread with
      ``time.sleep``; longer than the lease TTL, it tests that the lease is kept), then act;
    * ``lose_connections``: act, then end every database session of the engine.
    """

    outcome: Outcome = "return"
    sleep_s: float = 0.0


Script = Callable[[Any, int], Behaviour]
"""``script(args, attempt)``: the behaviour of attempt number ``attempt`` (1-based, per key)."""
_plain: Final = Behaviour()


class _Identity(msgspec.Struct, frozen=True):
    key: str
    task_id: str | None
    owner: str
    epoch: int


class EffectRow(msgspec.Struct, frozen=True, kw_only=True):
    """What the ledger counted for one idempotency key."""

    key: str
    task_id: str | None
    tool: str
    tool_class: str
    deliveries: int
    attempts: int = 0
    applied: int
    stale_rejected: int = 0
    owners: list[str] = []
    epochs: list[int] = []


class LedgerTotals(msgspec.Struct, frozen=True, kw_only=True):
    """Sums over the ledger, for a test's printed figures."""

    keys: int
    deliveries: int
    applied: int
    stale_rejected: int

    def __str__(self) -> str:
        return (f"{self.keys} keys, {self.deliveries} deliveries, {self.applied} applied, "
                f"{self.stale_rejected} stale deliveries refused")


def _source(result: ResultSource, args: Any) -> Any:
    return result(args) if callable(result) else result


# The fakes keep responses with msgpack, not the engine's payload codec: a response the
# engine cannot store (NaN, NUL, too large) must still be the service's answer when it is
# looked up or delivered again, exactly as the first time.
def _keep(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def _kept(stored: bytes | None) -> Any:
    return None if stored is None else msgspec.msgpack.decode(stored)


class EffectLedger:
    """Fake services whose effects are counted per idempotency key in the database."""

    def __init__(self, database: Database, *, reject_stale: bool = True) -> None:
        self.database = database
        self.reject_stale = reject_stale
        self.tools: dict[str, ToolClass] = {}
        self._prepared = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owned = False
        self.running = 0
        """Attempts of the fakes running now, in this process."""
        self._count_lock = threading.Lock()

    @classmethod
    def for_engine(cls, engine: Any, *, reject_stale: bool = True) -> EffectLedger:
        """The ledger of ``engine`` (one per engine, created on first use)."""
        ledger: EffectLedger | None = getattr(engine, "_wal_effect_ledger", None)
        if ledger is None:
            ledger = cls(engine.database, reject_stale=reject_stale)
            engine._wal_effect_ledger = ledger
        return ledger

    @classmethod
    def attach(cls, engine: Any, database: Database, *, reject_stale: bool = True,
               owned: bool = False) -> EffectLedger:
        """Give ``engine`` a ledger on its own ``database`` handle (call before registering
        agents): the fakes then use their own connections, which faults aimed at the
        engine's sessions do not hit. With ``owned``, :meth:`close` closes ``database``."""
        ledger = cls(database, reject_stale=reject_stale)
        ledger._owned = owned
        engine._wal_effect_ledger = ledger
        return ledger

    async def close(self) -> None:
        """Close the ledger's database handle if it owns it (see :meth:`attach`)."""
        if self._owned:
            self._owned = False
            await self.database.close()

    async def prepare(self) -> None:
        """Create the ledger table (idempotent); sync fakes run their statements on the
        loop that prepared it."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if not self._prepared:
            for statement in LEDGER_SCHEMA:
                await self.database.fetch(statement)
            self._prepared = True

    # ------------------------------------------------------------------ fake services

    def service(self, tool: str, *, kind: ToolClass = "idem", result: ResultSource = None,
                fail_first: int = 0, script: Script | None = None,
                sync: bool = False) -> Callable[[Any], Any]:
        """A fake external service for ``ctx.tool(tool, <this>, args)``.

        ``result`` is the response (or a function of the args giving it). ``kind`` is
        ``idem``, ``lookup`` or ``unsafe`` (see the module docstring). The first
        ``fail_first`` deliveries of each key fail with a :class:`TransientError` before
        acting (a flaky service). ``script(args, attempt)`` gives each attempt a
        :class:`Behaviour`. With ``sync``, the fake is a plain ``def`` (the worker runs it on
        its thread pool; the ledger's statements run on the loop that prepared the ledger).
        """
        if kind not in ("idem", "lookup", "unsafe"):
            raise ValueError(f"service kind must be idem, lookup or unsafe, not {kind!r}")
        self.tools[tool] = kind

        async def act(who: _Identity, args: Any) -> Any:
            deliveries = await self._deliver(who.key, who.task_id, tool, kind, who.owner,
                                             who.epoch)
            if deliveries <= fail_first:
                raise TransientError(f"{tool}: delivery {deliveries} fails on purpose")
            return await self._apply(tool, kind, who.key, _source(result, args))

        return self._scripted(tool, kind, act, script, sync)

    def _scripted(self, tool: str, kind: str,
                  act: Callable[[_Identity, Any], Coroutine[Any, Any, Any]],
                  script: Script | None, sync: bool) -> Callable[[Any], Any]:
        """The fake around ``act``: count the attempt, then behave as ``script`` says."""

        async def call(args: Any) -> Any:
            who = _call_identity()
            with self._running():
                behaviour = await self._begin(who, tool, kind, args, script)
                if behaviour.outcome == "block":
                    await asyncio.sleep(behaviour.sleep_s)
                ensure_lease()  # Right before the part that must not happen twice.
                value = await act(who, args)
                if behaviour.outcome == "lose_connections":
                    await self._lose_connections()
                elif behaviour.outcome == "act_then_sleep":
                    await asyncio.sleep(behaviour.sleep_s)
                return _answer(tool, behaviour, value)

        def call_sync(args: Any) -> Any:
            who = _call_identity()
            value: Any
            with self._running():
                behaviour = self._blocking(self._begin(who, tool, kind, args, script))
                if behaviour.outcome == "block":
                    time.sleep(behaviour.sleep_s)
                ensure_lease()
                value = self._blocking(act(who, args))
                if behaviour.outcome == "lose_connections":
                    self._blocking(self._lose_connections())
                elif behaviour.outcome == "act_then_sleep":
                    time.sleep(behaviour.sleep_s)
                return _answer(tool, behaviour, value)

        return call_sync if sync else call

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        with self._count_lock:
            self.running += 1
        try:
            yield
        finally:
            with self._count_lock:
                self.running -= 1

    async def idle(self, timeout_s: float) -> bool:
        """Wait until no attempt of a fake is running in this process (a sync one that
        timed out may still be acting on its thread); False if some still runs after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.running:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def _begin(self, who: _Identity, tool: str, kind: str, args: Any,
                     script: Script | None) -> Behaviour:
        """Count the attempt; raise DidNotAct if the script says so; else its behaviour."""
        await self.prepare()
        try:
            row = await self.database.fetchrow(ATTEMPT, who.key, who.task_id, tool, kind)
        except CONNECTION_ERRORS as error:
            # Counted or not, nothing acted yet: the service says so, whatever its kind.
            raise DidNotAct(f"{tool}: service unreachable before acting: {error!r}") from error
        behaviour = _plain if script is None else script(args, int(row["attempts"]))
        if behaviour.outcome == "did_not_act":
            raise DidNotAct(f"{tool}: attempt {row['attempts']} did not reach the service")
        return behaviour

    async def _lose_connections(self) -> None:
        """End every session of the engine, and wait until they are gone (so that the
        engine meets the loss on its next statement, not a stale socket later)."""
        rows = await self.database.fetch(LOSE_CONNECTIONS)
        pids = list(rows[0]["pids"])
        deadline = time.monotonic() + lose_wait_s
        while pids and time.monotonic() < deadline:
            with contextlib.suppress(*CONNECTION_ERRORS):  # The ledger shares the engine's.
                row = await self.database.fetchrow(STILL_CONNECTED, pids)
                if not row["n"]:
                    break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # Let the driver see the closed sockets.

    def _blocking(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the ledger's loop from a sync fake's thread, and wait for it."""
        loop = self._loop
        if loop is None:
            work.close()
            raise RuntimeError("a sync ledger fake needs a prepared ledger (await prepare())")
        return asyncio.run_coroutine_threadsafe(work, loop).result()

    async def _apply(self, tool: str, kind: str, key: str, value: Any) -> Any:
        statement = APPLY_ONCE if kind == "idem" else APPLY_ALWAYS
        try:
            rows = await self.database.fetch(statement, key, _keep(value))
        except CONNECTION_ERRORS as error:
            # Whether the service acted is unknown. Only a deduplicating service may
            # say "try again"; the others report an unknown outcome (not retryable).
            if kind == "idem":
                raise TransientError(f"{tool}: service unreachable: {error!r}") from error
            raise OutcomeUnknown(f"{tool}: lost the answer: {error!r}") from error
        return _kept(rows[0]["result"])

    def lookup(self) -> Callable[[str], Awaitable[Any]]:
        """``lookup=`` for ``ctx.tool``: the recorded response of a key, or None."""

        async def find(key: str) -> Any:
            await self.prepare()
            row = await self.database.fetchrow(LOOKUP, key)
            if row is None or row["applied"] == 0:
                return None
            return _kept(row["result"])

        return find

    def transaction(self, tool: str, *, result: ResultSource = None,
                    script: Script | None = None) -> Callable[[Any, Any], Awaitable[Any]]:
        """A DB-local effect for ``ctx.transaction(tool, <this>, args)``: exactly once.

        With ``script``, ``act_then_raise`` raises after the effect inside the transaction
        (which rolls it back), and the other outcomes act and answer.
        """
        self.tools[tool] = "db"

        async def act(connection: Any, args: Any) -> Any:
            who = _call_identity()
            # Counted on the ledger's own connection, so that a rollback keeps the count.
            behaviour = await self._begin(who, tool, "db", args, script)
            # Counted inside the engine's transaction: it commits or rolls back with it, and
            # the engine's fenced append in the same transaction is the epoch check.
            await connection.fetchrow(DELIVER, who.key, who.task_id, tool, "db", who.owner,
                                      who.epoch, False)
            value = _source(result, args)
            await connection.fetch(APPLY_ALWAYS, who.key, _keep(value))
            return _answer(tool, behaviour, value)

        return act

    def llm(self, model: str, respond: Callable[[Any], Any] | None = None, *,
            script: Script | None = None, sync: bool = False) -> Callable[[Any], Any]:
        """A deterministic fake LLM for ``ctx.llm(model, <this>, request)``; counts calls
        (``script`` and ``sync`` as for :meth:`service`)."""
        self.tools[model] = "llm"

        async def act(who: _Identity, request: Any) -> Any:
            await self._deliver(who.key, who.task_id, model, "llm", who.owner, who.epoch)
            if respond is not None:
                return respond(request)
            return LlmResponse(content={"echo": request}, input_tokens=10, output_tokens=5)

        return self._scripted(model, "llm", act, script, sync)

    async def _deliver(self, key: str, task_id: str | None, tool: str, kind: str, owner: str,
                       epoch: int) -> int:
        await self.prepare()
        try:
            row = await self.database.fetchrow(DELIVER, key, task_id, tool, kind, owner, epoch,
                                              self.reject_stale)
        except CONNECTION_ERRORS as error:
            # Perhaps counted, never acted. A deduplicating service (or an LLM) may be
            # tried again; the others must report it, or a retry would count as a second
            # delivery of a call the engine must never send twice.
            if kind in ("idem", "llm"):
                raise TransientError(f"{tool}: service unreachable: {error!r}") from error
            raise OutcomeUnknown(f"{tool}: lost the answer to a delivery: {error!r}") from error
        if row["stale"]:
            raise StaleDelivery(f"key {key}: epoch {epoch} is older than the task's epoch")
        return int(row["deliveries"])

    # ------------------------------------------------------------------ reading

    async def effects(self) -> list[EffectRow]:
        """Every key the fakes saw, with its counts."""
        return await read_effects(self.database)

    async def totals(self) -> LedgerTotals:
        """Sums over every key."""
        return totals(await self.effects())


def _call_identity() -> _Identity:
    claim = current_call()
    if claim is None:
        raise RuntimeError("a ledger service must be called through ctx.tool / ctx.llm / "
                           "ctx.transaction (no call in flight)")
    return _Identity(claim.key, claim.task_id, claim.owner, claim.epoch)


def _answer(tool: str, behaviour: Behaviour, value: Any) -> Any:
    """The fake's answer after it acted: ``value``, or the error its behaviour says."""
    if behaviour.outcome == "act_then_raise":
        raise ConnectionResetError(f"{tool}: acted, then the connection was reset")
    return value



async def read_effects(database: Database) -> list[EffectRow]:
    """Every row of ``wal_test_effects`` (empty when the table does not exist)."""
    if not await _ledger_exists(database):
        return []
    return effect_rows(await database.fetch(READ_EFFECTS, effects_read_max))


async def _ledger_exists(database: Database) -> bool:
    rows = await database.fetch("SELECT to_regclass('wal_test_effects') IS NOT NULL AS x")
    return bool(rows[0]["x"])


def effect_rows(rows: Iterable[Any]) -> list[EffectRow]:
    """:class:`EffectRow` from query rows with at least ``key, tool, deliveries, applied``
    (``tool_class`` defaults to ``idem``)."""
    built = []
    for r in rows:
        values = dict(r)
        built.append(EffectRow(
            key=str(values["key"]), task_id=values.get("task_id"), tool=str(values["tool"]),
            tool_class=str(values.get("tool_class") or "idem"),
            deliveries=int(values["deliveries"]), applied=int(values["applied"]),
            attempts=int(values.get("attempts") or 0),
            stale_rejected=int(values.get("stale_rejected") or 0),
            owners=list(values.get("owners") or []), epochs=list(values.get("epochs") or [])))
    return built


def totals(rows: Sequence[EffectRow]) -> LedgerTotals:
    """Sums over ``rows``."""
    return LedgerTotals(keys=len(rows), deliveries=sum(r.deliveries for r in rows),
                        applied=sum(r.applied for r in rows),
                        stale_rejected=sum(r.stale_rejected for r in rows))


async def check_effects(database: Database, rows: Sequence[EffectRow] | None = None, *,
                        completed_tools: dict[str, str] | None = None) -> list[Violation]:
    """I4, I5, I6, I7 over the ledger (``rows``, read from ``database`` when None).

    Args:
        database: The test database (for the intents in the log).
        rows: Effect counts; pass your own to check another fake (e.g. the demo's table).
        completed_tools: Tool name -> class of tools whose completed calls must have acted
            (I6); by default none are checked.
    """
    extra = {}
    if rows is None and await _ledger_exists(database):
        extra["effects"] = READ_EFFECTS_IF_PRESENT
    snapshot = await read_snapshot(database, extra=extra)
    if rows is None:
        rows = effect_rows(snapshot.extra.get("effects", []))
    return check_effect_rows(rows, snapshot.events, completed_tools=completed_tools)


def check_effect_rows(rows: Sequence[EffectRow], events: dict[str, list[EventRecord]], *,
                      completed_tools: dict[str, str] | None = None) -> list[Violation]:
    """The checks of :func:`check_effects` over rows already read (pure).

    Read ``rows`` no earlier than ``events`` (or in the same snapshot): an effect is always
    preceded by its durable intent, never the other way round.
    """
    violations: list[Violation] = []
    for row in rows:
        violations += _check_row(row)
    intents: set[str] = set()
    completed_keys: list[tuple[str, str, str]] = []
    for task_id, records in events.items():
        keys_by_call: dict[str, tuple[str, str]] = {}
        for record in records:
            if record.idempotency_key is not None:
                intents.add(record.idempotency_key)
            if completed_tools is None:
                continue
            if record.type == "tool_call_intended":
                event = record.decode()
                assert isinstance(event, ToolCallIntended)
                keys_by_call[event.call_id] = (event.idempotency_key, event.tool)
            elif record.type == "tool_call_completed":
                completed = record.decode()
                assert isinstance(completed, ToolCallCompleted)
                if completed.call_id in keys_by_call:
                    completed_keys.append((task_id, *keys_by_call[completed.call_id]))
    for row in rows:
        if row.key not in intents:
            violations.append(Violation(invariant="I5", task_id=row.task_id,
                                        detail=f"{row.tool} acted under key {row.key}, which "
                                               f"is no durable intent"))
    acted = {row.key: row for row in rows}
    for task_id, key, tool in completed_keys:
        kind = (completed_tools or {}).get(tool)
        if kind is None or kind == "llm":
            continue
        found = acted.get(key)
        if found is None or found.applied < 1:
            violations.append(Violation(
                invariant="I6", task_id=task_id,
                detail=f"{tool} ({kind}) recorded a result under {key} but never acted"))
    return violations


def _check_row(row: EffectRow) -> list[Violation]:
    violations: list[Violation] = []
    if row.tool_class != "llm" and row.applied > 1:
        violations.append(Violation(invariant="I4", task_id=row.task_id,
                                    detail=f"{row.tool} ({row.tool_class}) acted {row.applied} "
                                           f"times under key {row.key}"))
    # An unsafe call must never be sent twice. (A lookup call may be: the engine re-sends
    # it only when the lookup says it never acted, so its bound is on "applied".)
    if row.tool_class == "unsafe" and row.deliveries > 1:
        violations.append(Violation(invariant="I4", task_id=row.task_id,
                                    detail=f"{row.tool} ({row.tool_class}) delivered "
                                           f"{row.deliveries} times under key {row.key}"))
    owners_by_epoch: dict[int, set[str]] = {}
    for owner, epoch in zip(row.owners, row.epochs, strict=False):
        owners_by_epoch.setdefault(epoch, set()).add(owner)
    for epoch, owners in owners_by_epoch.items():
        if len(owners) > 1:
            violations.append(Violation(invariant="I7", task_id=row.task_id,
                                        detail=f"{sorted(owners)} all delivered {row.key} "
                                               f"under epoch {epoch}"))
    return violations
