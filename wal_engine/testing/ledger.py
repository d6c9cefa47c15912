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
``stale_rejected``. :func:`check_effects` turns the counts into violations of I4 (acted
twice), I5 (acted without a durable intent), I6 (completed without acting) and I7 (two
owners acting under one epoch).

Usage, inside the function that registers your agents::

    ledger = EffectLedger.for_engine(engine)
    charge = ledger.service("charge", kind="unsafe", result=lambda args: {"ok": True})

    @engine.agent("billing")
    async def billing(ctx, task_input):
        return await ctx.tool("charge", charge, task_input, idempotent=False)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Final, Literal

import msgspec

from wal_engine.context import LlmResponse, current_call
from wal_engine.events import ToolCallCompleted, ToolCallIntended
from wal_engine.payloads import decode_payload, encode_payload
from wal_engine.retries import PermanentError, TransientError
from wal_engine.store import Database, EventRecord
from wal_engine.store.connection import CONNECTION_ERRORS
from wal_engine.testing.invariants import Violation, read_snapshot

ToolClass = Literal["db", "idem", "lookup", "unsafe", "llm"]
TOOL_CLASSES: Final = ("db", "idem", "lookup", "unsafe", "llm")
ResultSource = Callable[[Any], Any] | Any

LEDGER_SCHEMA: Final = (
    """
    CREATE TABLE IF NOT EXISTS wal_test_effects (
        key            text PRIMARY KEY,
        task_id        text,
        tool           text NOT NULL,
        tool_class     text NOT NULL,
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
LOOKUP: Final = "SELECT applied, result FROM wal_test_effects WHERE key = $1"
READ_EFFECTS: Final = """
SELECT key, task_id, tool, tool_class, deliveries, applied, stale_rejected, owners, epochs
  FROM wal_test_effects ORDER BY key LIMIT $1
"""
READ_EFFECTS_IF_PRESENT: Final = """
SELECT key, task_id, tool, tool_class, deliveries, applied, stale_rejected, owners, epochs
  FROM wal_test_effects ORDER BY key
"""
effects_read_max: Final = 1_000_000


class OutcomeUnknown(PermanentError):
    """A non-deduplicating fake lost the answer of a delivery: whether it acted is unknown."""


class StaleDelivery(PermanentError):
    """A delivery carried an older lease epoch than the task's current one (a zombie's)."""


class EffectRow(msgspec.Struct, frozen=True, kw_only=True):
    """What the ledger counted for one idempotency key."""

    key: str
    task_id: str | None
    tool: str
    tool_class: str
    deliveries: int
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


class EffectLedger:
    """Fake services whose effects are counted per idempotency key in the database."""

    def __init__(self, database: Database, *, reject_stale: bool = True) -> None:
        self.database = database
        self.reject_stale = reject_stale
        self.tools: dict[str, ToolClass] = {}
        self._prepared = False

    @classmethod
    def for_engine(cls, engine: Any, *, reject_stale: bool = True) -> EffectLedger:
        """The ledger of ``engine`` (one per engine, created on first use)."""
        ledger: EffectLedger | None = getattr(engine, "_wal_effect_ledger", None)
        if ledger is None:
            ledger = cls(engine.database, reject_stale=reject_stale)
            engine._wal_effect_ledger = ledger
        return ledger

    @classmethod
    def attach(cls, engine: Any, database: Database, *,
               reject_stale: bool = True) -> EffectLedger:
        """Give ``engine`` a ledger on its own ``database`` handle (call before registering
        agents): the fakes then use their own connections, which faults aimed at the
        engine's sessions do not hit."""
        ledger = cls(database, reject_stale=reject_stale)
        engine._wal_effect_ledger = ledger
        return ledger

    async def prepare(self) -> None:
        """Create the ledger table (idempotent)."""
        if not self._prepared:
            for statement in LEDGER_SCHEMA:
                await self.database.fetch(statement)
            self._prepared = True

    # ------------------------------------------------------------------ fake services

    def service(self, tool: str, *, kind: ToolClass = "idem", result: ResultSource = None,
                fail_first: int = 0) -> Callable[[Any], Awaitable[Any]]:
        """A fake external service for ``ctx.tool(tool, <this>, args)``.

        ``result`` is the response (or a function of the args giving it). ``kind`` is
        ``idem``, ``lookup`` or ``unsafe`` (see the module docstring). The first
        ``fail_first`` deliveries of each key fail with a :class:`TransientError` before
        acting (a flaky service).
        """
        if kind not in ("idem", "lookup", "unsafe"):
            raise ValueError(f"service kind must be idem, lookup or unsafe, not {kind!r}")
        self.tools[tool] = kind

        async def call(args: Any) -> Any:
            key, task_id, owner, epoch = _call_identity()
            deliveries = await self._deliver(key, task_id, tool, kind, owner, epoch)
            if deliveries <= fail_first:
                raise TransientError(f"{tool}: delivery {deliveries} fails on purpose")
            encoded = encode_payload(_source(result, args))
            statement = APPLY_ONCE if kind == "idem" else APPLY_ALWAYS
            try:
                rows = await self.database.fetch(statement, key, encoded)
            except CONNECTION_ERRORS as error:
                # Whether the service acted is unknown. Only a deduplicating service may
                # say "try again"; the others report an unknown outcome (not retryable).
                if kind == "idem":
                    raise TransientError(f"{tool}: service unreachable: {error!r}") from error
                raise OutcomeUnknown(f"{tool}: lost the answer: {error!r}") from error
            return decode_payload(rows[0]["result"])

        return call

    def lookup(self) -> Callable[[str], Awaitable[Any]]:
        """``lookup=`` for ``ctx.tool``: the recorded response of a key, or None."""

        async def find(key: str) -> Any:
            await self.prepare()
            row = await self.database.fetchrow(LOOKUP, key)
            if row is None or row["applied"] == 0 or row["result"] is None:
                return None
            return decode_payload(row["result"])

        return find

    def transaction(self, tool: str, *, result: ResultSource = None
                    ) -> Callable[[Any, Any], Awaitable[Any]]:
        """A DB-local effect for ``ctx.transaction(tool, <this>, args)``: exactly once."""
        self.tools[tool] = "db"

        async def act(connection: Any, args: Any) -> Any:
            key, task_id, owner, epoch = _call_identity()
            # Counted inside the engine's transaction: it commits or rolls back with it, and
            # the engine's fenced append in the same transaction is the epoch check.
            await connection.fetchrow(DELIVER, key, task_id, tool, "db", owner, epoch, False)
            value = _source(result, args)
            await connection.fetch(APPLY_ALWAYS, key, encode_payload(value))
            return value

        return act

    def llm(self, model: str, respond: Callable[[Any], Any] | None = None
            ) -> Callable[[Any], Awaitable[Any]]:
        """A deterministic fake LLM for ``ctx.llm(model, <this>, request)``; counts calls."""
        self.tools[model] = "llm"

        async def call(request: Any) -> Any:
            key, task_id, owner, epoch = _call_identity()
            await self._deliver(key, task_id, model, "llm", owner, epoch)
            if respond is not None:
                return respond(request)
            return LlmResponse(content={"echo": request}, input_tokens=10, output_tokens=5)

        return call

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


def _call_identity() -> tuple[str, str | None, str, int]:
    claim = current_call()
    if claim is None:
        raise RuntimeError("a ledger service must be called through ctx.tool / ctx.llm / "
                           "ctx.transaction (no call in flight)")
    return claim.key, claim.task_id, claim.owner, claim.epoch



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
