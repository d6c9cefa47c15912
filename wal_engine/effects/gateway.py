"""The idempotency gateway: run an effect at most once per key, fenced by lease epoch.

What "once" means depends on where the effect lives (RELIABILITY.md R3):

* :meth:`IdempotencyGateway.run_in_transaction`, for effects on this database: the effect
  and the key's record commit together, so the effect happens exactly once per key.
* :meth:`IdempotencyGateway.run_once`, for effects elsewhere: once a key's result is
  recorded, every later caller gets it without acting, and two live callers never act
  concurrently. A holder that dies after acting but before recording leaves the key
  ``running``; the next holder acts again (at-least-once across that crash), which is why
  the key is also handed to the callee, who must deduplicate on it.

A tool implementation (or a service in front of an external API) calls
:meth:`IdempotencyGateway.run_once` with the key the engine handed it. The first caller
claims the key (a row in ``wal_idempotency`` in state ``running``), runs the effect and
stores its result; every later caller with the same key gets the stored result without
acting again, also when two workers race on the key (the primary key decides).

Fencing reaches the effect: the row records the lease epoch of its holder. A caller with an
older epoch than the recorded one is refused (:class:`StaleEpoch`), so a zombie worker still
inside a tool cannot act after another worker took the task over. A newer epoch takes a
``running`` claim over at once (its holder's lease was broken, so it is presumed dead); the
same epoch retakes it only after the claim expired (a crashed attempt of the same owner).
The key itself is epoch-independent, so the new owner's retry is deduplicated against the
zombie's first attempt.

:meth:`run_in_transaction` is the exactly-once form for effects on this same database: the
effect, the dedup row and (through ``on_commit_events``) the result event commit together.

Where the keys live is a :class:`GatewayStore`: :class:`PostgresGatewayStore` (the table
``wal_idempotency``, the default) or :class:`wal_engine.effects.redis_store.RedisGatewayStore` (the
``redis`` extra). :meth:`run_once` works on either; :meth:`run_in_transaction` always uses
PostgreSQL, since its point is to commit with the effect in one database transaction.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal, Protocol, TypeVar

import asyncpg
import msgspec

from wal_engine import limits, payloads
from wal_engine.errors import ConfigurationError, DatabaseUnavailable, DuplicateRow, WaitTimedOut
from wal_engine.errors import EffectFailed as EffectFailed
from wal_engine.errors import GatewayStoreUnavailable as GatewayStoreUnavailable
from wal_engine.errors import InvalidKey as InvalidKey
from wal_engine.errors import StaleEpoch as StaleEpoch
from wal_engine.observability import metrics
from wal_engine.retries import GATEWAY_TRANSACTION_RETRY, retrying
from wal_engine.security.redaction import Redactor, no_redaction, redact_bounded, redact_text
from wal_engine.store import sqlstate
from wal_engine.store.connection import Database

T = TypeVar("T")

claim_ttl_ms_default: Final = 60_000
wait_poll_s: Final = 0.05
wait_max_s: Final = 300.0
key_chars_max: Final = 512
"""The longest key any store accepts (the bound ``wal_idempotency.key`` checks)."""
expire_batch_max: Final = 1000

CLAIM_KEY: Final = """
INSERT INTO wal_idempotency AS k (key, task_id, state, owner, epoch, expires_at)
VALUES ($1, $2, 'running', $3, $4, now() + $5 * interval '1 millisecond')
ON CONFLICT (tenant, key) DO UPDATE
   SET owner = EXCLUDED.owner, epoch = EXCLUDED.epoch, claimed_at = now(),
       expires_at = EXCLUDED.expires_at
 WHERE k.state = 'running'
   AND (k.epoch < EXCLUDED.epoch OR (k.epoch = EXCLUDED.epoch AND k.expires_at < now()))
RETURNING state, xmax <> '0'::xid AS took_over
"""

READ_KEY: Final = """
SELECT state, owner, epoch, result, error, expires_at < now() AS expired
  FROM wal_idempotency WHERE tenant = current_setting('wal.tenant', true) AND key = $1
"""

COMPLETE_KEY: Final = """
UPDATE wal_idempotency
   SET state = $4, result = $5, error = $6, completed_at = now(), expires_at = NULL
 WHERE tenant = current_setting('wal.tenant', true) AND key = $1 AND owner = $2 AND epoch = $3
   AND state = 'running'
RETURNING key
"""

# Inside the exactly-once transaction: a plain INSERT, so a racing transaction on the same
# key waits for ours and then fails on the primary key instead of acting twice.
INSERT_TRANSACTION_KEY: Final = """
INSERT INTO wal_idempotency (key, task_id, state, owner, epoch) VALUES ($1, $2, 'running', $3, $4)
"""

# wal_release_key (schema.sql) deletes the claim with the owner's rights: runtime roles
# hold no DELETE on shared tables (docs/architecture.md, decision 35).
RELEASE_KEY: Final = "SELECT wal_release_key($1, $2, $3)"

# Settled keys past their retention, oldest first, a bounded batch per call. Running claims
# stay: their epoch is what fences a zombie holder.
EXPIRE_KEYS: Final = """
DELETE FROM wal_idempotency
 WHERE tenant = current_setting('wal.tenant', true)
   AND key IN (SELECT key FROM wal_idempotency
                WHERE tenant = current_setting('wal.tenant', true) AND state <> 'running'
                  AND completed_at < now() - $1 * interval '1 millisecond'
                  AND starts_with(key, $3)
                ORDER BY completed_at LIMIT $2)
RETURNING key
"""

PING: Final = "SELECT 1"


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """Who acts under a key."""

    key: str
    owner: str
    epoch: int
    task_id: str | None = None


class Acquired(enum.Enum):
    """What a claim attempt got."""

    NEW = "new"
    """The key was free: nobody acted under it before."""
    TAKEN_OVER = "taken_over"
    """A running claim of a presumed-dead holder (newer epoch, or expired): it may have
    acted already."""
    HELD = "held"
    """Someone else holds the key, or it is settled: read it."""


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a store holds for one key."""

    state: Literal["running", "completed", "failed"]
    owner: str | None
    epoch: int
    result: bytes | None
    error: str | None
    expired: bool
    """A running claim whose lease is over (always False once settled)."""


Settled = Literal["completed", "failed"]


class GatewayStore(Protocol):
    """Where keys, claims and outcomes live (PostgreSQL, Redis).

    Every implementation runs the abstract suite in ``tests/integration/gateway_store_suite.py``.
    The rules they share: a claim is won when the key is free, or held by an older epoch, or
    by the same epoch with an expired lease; only the holder (key, owner and epoch equal)
    records an outcome or releases; a settled key is never claimed again until it expires.
    """

    async def claim_key(self, claim: Claim, ttl_ms: int) -> Acquired:
        """Try to take ``claim.key`` for ``claim.owner`` at ``claim.epoch``."""
        ...

    async def read_key(self, key: str) -> KeyRecord | None:
        """What is stored under ``key``, or None."""
        ...

    async def complete_key(self, claim: Claim, state: Settled, result: bytes | None,
                           error: str | None) -> bool:
        """Record the outcome; False when ``claim`` no longer holds the key."""
        ...

    async def release_key(self, claim: Claim) -> None:
        """Give a running claim up (the effect did not act), so a retry may act."""
        ...

    async def expire_keys(self, retention_ms: int, limit: int = expire_batch_max,
                          prefix: str = "") -> int:
        """Forget up to ``limit`` outcomes settled more than ``retention_ms`` ago whose keys
        start with ``prefix`` (so one user of a tenant's keys never expires another's);
        return how many."""
        ...

    async def ping(self) -> None:
        """Raise unless the store answers."""
        ...

    async def close(self) -> None:
        """Release connections the store opened itself."""
        ...


def check_key(key: str) -> str:
    """``key`` if every store can hold it; else :class:`InvalidKey` (nothing is written)."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(key, "must be a non-empty string")
    if len(key) > key_chars_max:
        raise InvalidKey(key, f"longer than {key_chars_max} characters")
    if "\x00" in key:
        raise InvalidKey(key, "holds a NUL character")
    return key


class PostgresGatewayStore:
    """Keys in ``wal_idempotency`` of the engine's database, scoped to its tenant."""

    def __init__(self, database: Database, *, owns_database: bool = False) -> None:
        self.database = database
        self._owns_database = owns_database

    async def claim_key(self, claim: Claim, ttl_ms: int) -> Acquired:
        """See :meth:`GatewayStore.claim_key`."""
        row = await self.database.fetchrow(CLAIM_KEY, check_key(claim.key), claim.task_id,
                                           claim.owner, claim.epoch, ttl_ms)
        if row is None:
            return Acquired.HELD
        return Acquired.TAKEN_OVER if row["took_over"] else Acquired.NEW

    async def read_key(self, key: str) -> KeyRecord | None:
        """See :meth:`GatewayStore.read_key`."""
        row = await self.database.fetchrow(READ_KEY, check_key(key))
        if row is None:
            return None
        return KeyRecord(state=row["state"], owner=row["owner"], epoch=int(row["epoch"]),
                         result=row["result"], error=row["error"],
                         expired=bool(row["expired"]))

    async def complete_key(self, claim: Claim, state: Settled, result: bytes | None,
                           error: str | None) -> bool:
        """See :meth:`GatewayStore.complete_key`."""
        done = await self.database.fetch(COMPLETE_KEY, check_key(claim.key), claim.owner,
                                         claim.epoch, state, result, error)
        return bool(done)

    async def release_key(self, claim: Claim) -> None:
        """See :meth:`GatewayStore.release_key`."""
        await self.database.fetch(RELEASE_KEY, check_key(claim.key), claim.owner, claim.epoch)

    async def expire_keys(self, retention_ms: int, limit: int = expire_batch_max,
                          prefix: str = "") -> int:
        """See :meth:`GatewayStore.expire_keys`."""
        _check_expiry(retention_ms, limit)
        return len(await self.database.fetch(EXPIRE_KEYS, retention_ms, limit, prefix))

    async def ping(self) -> None:
        """See :meth:`GatewayStore.ping`."""
        await self.database.fetch(PING)

    async def close(self) -> None:
        """Close the database if the store was handed it to own (``owns_database``)."""
        if self._owns_database:
            await self.database.close()


def _check_expiry(retention_ms: int, limit: int) -> None:
    if retention_ms < 0:
        raise ConfigurationError("retention_ms must be >= 0")
    if not 1 <= limit <= expire_batch_max:
        raise ConfigurationError(f"limit must be between 1 and {expire_batch_max}")


class IdempotencyGateway:
    """At-most-once execution per key on a :class:`GatewayStore` (``wal_idempotency`` by
    default)."""

    def __init__(self, database: Database | None = None, *,
                 store: GatewayStore | None = None,
                 claim_ttl_ms: int = claim_ttl_ms_default,
                 redactor: Redactor = no_redaction) -> None:
        if store is None:
            if database is None:
                raise ConfigurationError("IdempotencyGateway needs a database or a store")
            store = PostgresGatewayStore(database)
        self.database = database
        self.store = store
        self.claim_ttl_ms = claim_ttl_ms
        self.redactor = redactor
        """Applied to results and errors before they are stored; every caller, the first
        included, gets the stored (redacted) result."""

    async def run_once(self, claim: Claim, effect: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``effect`` unless ``claim.key`` already acted; return the (first) result.

        Raises :class:`StaleEpoch` when a newer epoch holds the key, and
        :class:`EffectFailed` when the first execution failed permanently. If ``effect``
        raises, the claim is released so that a retry with the same key may act.
        """
        deadline = asyncio.get_running_loop().time() + wait_max_s
        while True:
            acquired = await self.store.claim_key(claim, self.claim_ttl_ms)
            if acquired is not Acquired.HELD:
                return await self._act(claim, effect)
            settled = await self._settled(claim)
            if settled is not _pending:
                return settled
            if asyncio.get_running_loop().time() > deadline:
                raise WaitTimedOut(f"the claim on key {claim.key!r} to settle", wait_max_s)
            await asyncio.sleep(wait_poll_s)

    async def _act(self, claim: Claim, effect: Callable[[], Awaitable[Any]]) -> Any:
        try:
            result = await effect()
        except BaseException:
            await self.store.release_key(claim)
            raise
        # Bounded before any regex runs on it (the effect's result is outside text).
        result = redact_bounded(self.redactor, result, limits.payload_bytes_ceiling)
        encoded = payloads.encode_payload(result)
        if not await self.store.complete_key(claim, "completed", encoded, None):
            record = await self.store.read_key(claim.key)
            raise StaleEpoch(claim.key, claim.epoch, record.epoch if record else -1)
        return result

    async def _settled(self, claim: Claim) -> Any:
        """The stored outcome of a key someone else holds, or ``_pending`` while it runs."""
        record = await self.store.read_key(claim.key)
        if record is None:
            return _pending  # Released between our claim attempt and this read: try again.
        if record.epoch > claim.epoch:
            # A newer owner holds (or held) the key: this caller is a zombie, refused even
            # when the answer is known, so it learns it was fenced.
            raise StaleEpoch(claim.key, claim.epoch, record.epoch)
        if record.state == "completed":
            metrics.effect_deduplicated()
            return None if record.result is None else payloads.decode_payload(record.result)
        if record.state == "failed":
            raise EffectFailed(claim.key, str(record.error))
        return _pending

    async def fail(self, claim: Claim, error: str) -> None:
        """Record a permanent failure as the key's answer (later callers get EffectFailed)."""
        error = redact_text(self.redactor, error)
        await self.store.complete_key(claim, "failed", None, error)

    async def lookup(self, key: str) -> tuple[str, Any] | None:
        """``(state, result)`` recorded for ``key``, or None (the T-lookup reconciliation)."""
        record = await self.store.read_key(key)
        if record is None:
            return None
        result = None if record.result is None else payloads.decode_payload(record.result)
        return record.state, result

    def _transaction_database(self) -> Database:
        if self.database is None:
            raise ConfigurationError("run_in_transaction needs the gateway's database")
        return self.database

    async def run_in_transaction(
        self,
        claim: Claim,
        effect: Callable[[asyncpg.Connection], Awaitable[T]],
        on_commit: Callable[[asyncpg.Connection, T], Awaitable[None]] | None = None,
    ) -> T | Any:
        """Exactly once for effects on this database: effect, dedup row and ``on_commit``
        (for example the result event's append) commit in one transaction, or none do.

        Returns the effect's result, or the stored result if the key already completed.
        """
        async def attempt() -> T | Any:
            try:
                return await self._transaction_once(claim, effect, on_commit)
            except DuplicateRow as error:
                # A racer committed the key first; its stored result is the answer.
                settled = await self._settled_in_database(claim)
                if settled is _pending:
                    raise _KeyRaced(claim.key) from error
                return settled

        try:
            return await retrying(GATEWAY_TRANSACTION_RETRY, attempt,
                                  retry_if=_transaction_retryable, key=claim.key)
        except _KeyRaced as error:
            raise WaitTimedOut(f"the transaction holding key {claim.key!r} to settle",
                               None) from error
        except asyncpg.PostgresError as error:
            # Deadlock, lock or statement timeout on every attempt: the transaction rolled
            # back whole (effect included), never the caller's failure.
            if not sqlstate.is_transient(error):
                raise
            raise DatabaseUnavailable(self._transaction_database().dsn_redacted,
                                      f"SQLSTATE {error.sqlstate}: {error}") from error

    async def _transaction_once(
        self,
        claim: Claim,
        effect: Callable[[asyncpg.Connection], Awaitable[T]],
        on_commit: Callable[[asyncpg.Connection, T], Awaitable[None]] | None,
    ) -> T | Any:
        check_key(claim.key)
        database = self._transaction_database()
        acquired = in_effect = False
        try:
            async with database.pool.acquire() as connection, connection.transaction():
                acquired = True
                existing = await connection.fetchrow(READ_KEY, claim.key)
                if existing is not None and existing["epoch"] > claim.epoch:
                    raise StaleEpoch(claim.key, claim.epoch, int(existing["epoch"]))
                if existing is not None and existing["state"] == "completed":
                    metrics.effect_deduplicated()
                    return payloads.decode_payload(existing["result"])
                await connection.execute(INSERT_TRANSACTION_KEY, claim.key, claim.task_id,
                                         claim.owner, claim.epoch)
                in_effect = True
                value = await effect(connection)
                in_effect = False
                result = redact_bounded(self.redactor, value, limits.payload_bytes_ceiling)
                await connection.execute(
                    COMPLETE_KEY, claim.key, claim.owner, claim.epoch, "completed",
                    payloads.encode_payload(result), None,
                )
                if on_commit is not None:
                    await on_commit(connection, result)
                return result
        except Exception as error:
            if in_effect:
                raise  # The effect's own error (rolled back): the caller's to classify.
            translated = database.translate(error, claim.task_id, sent=acquired)
            if translated is error:
                raise
            raise translated from error

    async def _settled_in_database(self, claim: Claim) -> Any:
        """Like :meth:`_settled`, on ``wal_idempotency`` whatever the gateway's store is."""
        if isinstance(self.store, PostgresGatewayStore):
            return await self._settled(claim)
        gateway = IdempotencyGateway(self._transaction_database(), redactor=self.redactor)
        return await gateway._settled(claim)


class _KeyRaced(Exception):
    """Internal: a racing transaction committed the key but its answer is not readable yet."""


def _transaction_retryable(error: BaseException) -> bool:
    return isinstance(error, _KeyRaced) or sqlstate.is_transient(error)


class _Pending:
    """Marker: the key is held by a live claim that has not finished."""


_pending: Final = _Pending()
