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
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import asyncpg
import msgspec

from wal_engine import metrics, payloads
from wal_engine.errors import DatabaseUnavailable, WalError
from wal_engine.redaction import Redactor, no_redaction, redact_text
from wal_engine.store.connection import TRANSIENT_SQLSTATES, Database

T = TypeVar("T")

claim_ttl_ms_default: Final = 60_000
wait_poll_s: Final = 0.05
wait_max_s: Final = 300.0

CLAIM_KEY: Final = """
INSERT INTO wal_idempotency AS k (key, task_id, state, owner, epoch, expires_at)
VALUES ($1, $2, 'running', $3, $4, now() + $5 * interval '1 millisecond')
ON CONFLICT (tenant, key) DO UPDATE
   SET owner = EXCLUDED.owner, epoch = EXCLUDED.epoch, claimed_at = now(),
       expires_at = EXCLUDED.expires_at
 WHERE k.state = 'running'
   AND (k.epoch < EXCLUDED.epoch OR (k.epoch = EXCLUDED.epoch AND k.expires_at < now()))
RETURNING state
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


class StaleEpoch(WalError):
    """A caller holding an older lease epoch than the key's holder tried to act."""

    def __init__(self, key: str, epoch: int, recorded_epoch: int) -> None:
        super().__init__(
            f"key {key!r}: epoch {epoch} is older than recorded epoch {recorded_epoch}"
        )
        self.key = key
        self.epoch = epoch
        self.recorded_epoch = recorded_epoch


class EffectFailed(WalError):
    """The first execution under this key failed permanently; the failure is the answer."""

    def __init__(self, key: str, error: str) -> None:
        super().__init__(f"effect under key {key!r} failed: {error}")
        self.key = key
        self.error = error


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """Who acts under a key."""

    key: str
    owner: str
    epoch: int
    task_id: str | None = None


class IdempotencyGateway:
    """At-most-once execution per key on ``wal_idempotency``."""

    def __init__(self, database: Database, *, claim_ttl_ms: int = claim_ttl_ms_default,
                 redactor: Redactor = no_redaction) -> None:
        self.database = database
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
            won = await self.database.fetch(
                CLAIM_KEY, claim.key, claim.task_id, claim.owner, claim.epoch, self.claim_ttl_ms
            )
            if won:
                return await self._act(claim, effect)
            settled = await self._settled(claim)
            if settled is not _pending:
                return settled
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"key {claim.key!r} stayed claimed for {wait_max_s} s")
            await asyncio.sleep(wait_poll_s)

    async def _act(self, claim: Claim, effect: Callable[[], Awaitable[Any]]) -> Any:
        try:
            result = await effect()
        except BaseException:
            await self.database.fetch(RELEASE_KEY, claim.key, claim.owner, claim.epoch)
            raise
        result = self.redactor(result)
        encoded = payloads.encode_payload(result)
        done = await self.database.fetch(
            COMPLETE_KEY, claim.key, claim.owner, claim.epoch, "completed", encoded, None
        )
        if not done:
            row = await self.database.fetchrow(READ_KEY, claim.key)
            raise StaleEpoch(claim.key, claim.epoch, int(row["epoch"]) if row else -1)
        return result

    async def _settled(self, claim: Claim) -> Any:
        """The stored outcome of a key someone else holds, or ``_pending`` while it runs."""
        row = await self.database.fetchrow(READ_KEY, claim.key)
        if row is None:
            return _pending  # Released between our claim attempt and this read: try again.
        if row["epoch"] > claim.epoch:
            # A newer owner holds (or held) the key: this caller is a zombie, refused even
            # when the answer is known, so it learns it was fenced.
            raise StaleEpoch(claim.key, claim.epoch, int(row["epoch"]))
        if row["state"] == "completed":
            metrics.effect_deduplicated()
            return payloads.decode_payload(row["result"])
        if row["state"] == "failed":
            raise EffectFailed(claim.key, str(row["error"]))
        return _pending

    async def fail(self, claim: Claim, error: str) -> None:
        """Record a permanent failure as the key's answer (later callers get EffectFailed)."""
        error = redact_text(self.redactor, error)
        await self.database.fetch(
            COMPLETE_KEY, claim.key, claim.owner, claim.epoch, "failed", None, error
        )

    async def lookup(self, key: str) -> tuple[str, Any] | None:
        """``(state, result)`` recorded for ``key``, or None (the T-lookup reconciliation)."""
        row = await self.database.fetchrow(READ_KEY, key)
        if row is None:
            return None
        result = None if row["result"] is None else payloads.decode_payload(row["result"])
        return str(row["state"]), result

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
        for attempt in range(1, 4):
            try:
                return await self._transaction_once(claim, effect, on_commit)
            except asyncpg.exceptions.UniqueViolationError:
                # A racer committed the key first; its stored result is the answer.
                settled = await self._settled(claim)
                if settled is not _pending:
                    return settled
            except asyncpg.PostgresError as error:
                # Deadlock, lock or statement timeout: the transaction rolled back whole
                # (effect included), so it may run again; never the caller's failure.
                if error.sqlstate not in TRANSIENT_SQLSTATES:
                    raise
                if attempt == 3:
                    raise DatabaseUnavailable(self.database.dsn_redacted,
                                              f"SQLSTATE {error.sqlstate}: {error}") from error
                await asyncio.sleep(random.uniform(0, 0.05 * 2**attempt))
        raise TimeoutError(f"key {claim.key!r} is held by another transaction")

    async def _transaction_once(
        self,
        claim: Claim,
        effect: Callable[[asyncpg.Connection], Awaitable[T]],
        on_commit: Callable[[asyncpg.Connection, T], Awaitable[None]] | None,
    ) -> T | Any:
        async with self.database.pool.acquire() as connection, connection.transaction():
            existing = await connection.fetchrow(READ_KEY, claim.key)
            if existing is not None and existing["epoch"] > claim.epoch:
                raise StaleEpoch(claim.key, claim.epoch, int(existing["epoch"]))
            if existing is not None and existing["state"] == "completed":
                metrics.effect_deduplicated()
                return payloads.decode_payload(existing["result"])
            await connection.execute(INSERT_TRANSACTION_KEY, claim.key, claim.task_id,
                                     claim.owner, claim.epoch)
            result = self.redactor(await effect(connection))
            await connection.execute(
                COMPLETE_KEY, claim.key, claim.owner, claim.epoch, "completed",
                payloads.encode_payload(result), None,
            )
            if on_commit is not None:
                await on_commit(connection, result)
            return result


class _Pending:
    """Marker: the key is held by a live claim that has not finished."""


_pending: Final = _Pending()
