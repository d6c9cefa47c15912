"""The gateway store on Redis (``pip install 'wal-engine[redis]'``): keys in Redis hashes.

Each key is one hash ``wal:{TENANT}:k:KEY`` with the fields ``state``, ``owner``, ``epoch``,
``expires_at`` (the claim's lease end, Redis server milliseconds), ``result``, ``error``;
settled keys are also indexed by completion time in the sorted set ``wal:{TENANT}:done``,
which :meth:`RedisGatewayStore.expire_keys` walks. The tenant is the hash tag, so a tenant's
keys and its index share a cluster slot.

Every change is one Lua script, which Redis runs atomically: the claim reads the holder's
state, epoch and lease and takes the key in the same step, so a fenced worker (older epoch)
can never overwrite a newer claim, and two racing claimants cannot both win. Time is the
Redis server's clock (``TIME``), never a client's, like PostgreSQL's ``now()`` for the
PostgreSQL store.

Retention: a settled key also gets a Redis TTL of ``retention_ms`` (a running claim gets its
lease plus ``retention_ms``), so Redis forgets outcomes on its own even if nobody calls
:meth:`~RedisGatewayStore.expire_keys`. Durability is Redis's: with AOF and
``appendfsync always`` an acknowledged outcome survives a crash of Redis; with
``appendfsync everysec`` up to a second of outcomes may be lost, without persistence all of
them (docs/gateway.md says what the engine's log still guarantees then).

The client does not retry a command on its own: a claim whose answer was lost could be
retried into a "held" answer for its own claim. A lost connection is
:class:`~wal_engine.effects.gateway.GatewayStoreUnavailable`; the caller retries the whole call.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

from wal_engine.effects.gateway import (
    Acquired,
    Claim,
    GatewayStoreUnavailable,
    KeyRecord,
    Settled,
    _check_expiry,
    check_key,
    expire_batch_max,
)
from wal_engine.errors import ConfigurationError
from wal_engine.store.connection import redact_dsn, resolve_tenant

retention_ms_default: Final = 24 * 3600 * 1000
command_timeout_s: Final = 5.0

_NOW: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] entry; ARGV owner, epoch, ttl_ms, task_id, retention_ms.
CLAIM_SCRIPT: Final = _NOW + """
local epoch = tonumber(ARGV[2])
local found = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'expires_at')
local answer = 'new'
if found[1] then
  if found[1] ~= 'running' then return 'held' end
  local held = tonumber(found[2])
  if not (held < epoch or (held == epoch and tonumber(found[3]) < now)) then
    return 'held'
  end
  answer = 'taken_over'
end
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'state', 'running', 'owner', ARGV[1], 'epoch', ARGV[2],
           'expires_at', now + ttl, 'task_id', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[5]))
return answer
"""

# KEYS[1] entry, KEYS[2] done index; ARGV owner, epoch, state, result, error, retention_ms,
# has_result.
COMPLETE_SCRIPT: Final = _NOW + """
local found = redis.call('HMGET', KEYS[1], 'state', 'owner', 'epoch')
if found[1] ~= 'running' or found[2] ~= ARGV[1] or found[3] ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], 'expires_at', 'result', 'error')
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'completed_at', now)
if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'result', ARGV[4]) end
if ARGV[3] == 'failed' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[6]))
return 1
"""

# KEYS[1] entry; ARGV owner, epoch.
RELEASE_SCRIPT: Final = """
local found = redis.call('HMGET', KEYS[1], 'state', 'owner', 'epoch')
if found[1] == 'running' and found[2] == ARGV[1] and found[3] == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] entry. One script so that "expired" is judged on the server's clock.
READ_SCRIPT: Final = _NOW + """
local found = redis.call('HMGET', KEYS[1], 'state', 'owner', 'epoch', 'result', 'error',
                         'expires_at')
if not found[1] then return false end
local expired = 0
if found[1] == 'running' and tonumber(found[6]) < now then expired = 1 end
return {found[1], found[2] or false, found[3], found[4] or false, found[5] or false, expired}
"""

# KEYS[1] done index; ARGV retention_ms, limit, entry-name prefix. The entries it deletes
# share the index's hash tag (one slot), which is why naming them outside KEYS is safe here.
# Entries of other prefixes are left for their own owner (and their Redis TTL); a scan looks
# at four times ``limit`` of the oldest, so they cannot hide this prefix's for long.
EXPIRE_SCRIPT: Final = _NOW + """
local limit = tonumber(ARGV[2])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]),
                       'LIMIT', 0, limit * 4)
local prefix = ARGV[3]
local removed = 0
for _, entry in ipairs(old) do
  if removed >= limit then break end
  if string.sub(entry, 1, #prefix) == prefix then
    local state = redis.call('HGET', entry, 'state')
    if state == 'completed' or state == 'failed' then
      removed = removed + redis.call('DEL', entry)
    end
    if state ~= 'running' then redis.call('ZREM', KEYS[1], entry) end
  end
end
return removed
"""


class RedisGatewayStore:
    """Keys, claims and outcomes in Redis; see the module docstring for the layout."""

    def __init__(self, client: Any, *, tenant: str | None = None,
                 retention_ms: int = retention_ms_default, where: str = "redis",
                 owns_client: bool = False, replicas_min: int = 0,
                 replicas_timeout_ms: int = 1000) -> None:
        if retention_ms <= 0:
            raise ConfigurationError("retention_ms must be > 0")
        if replicas_min < 0 or replicas_timeout_ms <= 0:
            raise ConfigurationError("replicas_min must be >= 0, replicas_timeout_ms > 0")
        self.client = client
        self.replicas_min = replicas_min
        """Replicas that must hold a claim or an outcome before it counts (Redis ``WAIT``):
        with 1 or more, a Sentinel failover to an acknowledging replica loses nothing
        acknowledged."""
        self.replicas_timeout_ms = replicas_timeout_ms
        self.tenant = resolve_tenant(tenant)
        self.retention_ms = retention_ms
        self.where = where
        self._owns_client = owns_client
        self._prefix = f"wal:{{{self.tenant}}}:"
        self._claim = client.register_script(CLAIM_SCRIPT)
        self._complete = client.register_script(COMPLETE_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._read = client.register_script(READ_SCRIPT)
        self._expire = client.register_script(EXPIRE_SCRIPT)

    @classmethod
    def from_url(cls, url: str, *, tenant: str | None = None,
                 retention_ms: int = retention_ms_default,
                 replicas_min: int = 0) -> RedisGatewayStore:
        """A store with its own client on ``url`` (``redis://host:port/db``)."""
        client = _client_from_url(url)
        return cls(client, tenant=tenant, retention_ms=retention_ms, where=redact_dsn(url),
                   owns_client=True, replicas_min=replicas_min)

    @classmethod
    def from_sentinel(cls, sentinels: list[tuple[str, int]], service_name: str, *,
                      tenant: str | None = None, retention_ms: int = retention_ms_default,
                      replicas_min: int = 0) -> RedisGatewayStore:
        """A store on the primary that Redis Sentinel names for ``service_name``; after a
        failover the client finds the new primary on its next connection."""
        from redis.asyncio.sentinel import Sentinel

        # redis-py before 8.2 leaves Sentinel's constructor unannotated (mypy's no-untyped-call),
        # 8.2 annotates it: called through Any, it type-checks under both.
        sentinel_type: Any = Sentinel
        sentinel = sentinel_type(sentinels, socket_timeout=command_timeout_s)
        client = sentinel.master_for(service_name, **_client_options())
        return cls(client, tenant=tenant, retention_ms=retention_ms, owns_client=True,
                   where=f"sentinel {service_name}", replicas_min=replicas_min)

    def entry(self, key: str) -> str:
        """The Redis key of ``key``'s hash."""
        return f"{self._prefix}k:{check_key(key)}"

    @property
    def done_index(self) -> str:
        """The Redis key of the sorted set of settled keys."""
        return f"{self._prefix}done"

    async def claim_key(self, claim: Claim, ttl_ms: int) -> Acquired:
        """See :meth:`wal_engine.effects.gateway.GatewayStore.claim_key`."""
        answer = await self._call(self._claim, [self.entry(claim.key)],
                                  [claim.owner, str(claim.epoch), ttl_ms,
                                   claim.task_id or "", self.retention_ms])
        acquired = Acquired(answer.decode() if isinstance(answer, bytes) else answer)
        if acquired is Acquired.NEW:
            try:
                await self._replicated("claim")
            except GatewayStoreUnavailable:
                # The caller will not act on an unconfirmed claim: give a key that was free
                # back (best effort), or it would look in doubt once its lease ends. A
                # taken-over claim stays: its dead holder may have acted.
                with contextlib.suppress(GatewayStoreUnavailable):
                    await self.release_key(claim)
                raise
        elif acquired is Acquired.TAKEN_OVER:
            await self._replicated("claim")
        return acquired

    async def read_key(self, key: str) -> KeyRecord | None:
        """See :meth:`wal_engine.effects.gateway.GatewayStore.read_key`."""
        found = await self._call(self._read, [self.entry(key)], [])
        if not found:
            return None
        state, owner, epoch, result, error, expired = found
        return KeyRecord(state=state.decode(), owner=_text(owner), epoch=int(epoch),
                         result=result or None, error=_text(error), expired=bool(expired))

    async def complete_key(self, claim: Claim, state: Settled, result: bytes | None,
                           error: str | None) -> bool:
        """See :meth:`wal_engine.effects.gateway.GatewayStore.complete_key`."""
        done = await self._call(
            self._complete, [self.entry(claim.key), self.done_index],
            [claim.owner, str(claim.epoch), state, result or b"", error or "",
             self.retention_ms, "1" if result is not None else "0"])
        if done:
            await self._replicated("outcome")
        return bool(done)

    async def _replicated(self, what: str) -> None:
        """With ``replicas_min``: wait until that many replicas hold the write."""
        if not self.replicas_min:
            return
        from redis.exceptions import RedisError

        try:
            acknowledged = int(await self.client.wait(self.replicas_min,
                                                      self.replicas_timeout_ms))
        except (RedisError, OSError) as error:
            raise GatewayStoreUnavailable(self.where, str(error)) from error
        if acknowledged < self.replicas_min:
            raise GatewayStoreUnavailable(
                self.where, f"the {what} is on the primary but only {acknowledged} of "
                            f"{self.replicas_min} replicas acknowledged it in "
                            f"{self.replicas_timeout_ms} ms")

    async def release_key(self, claim: Claim) -> None:
        """See :meth:`wal_engine.effects.gateway.GatewayStore.release_key`."""
        await self._call(self._release, [self.entry(claim.key)],
                         [claim.owner, str(claim.epoch)])

    async def expire_keys(self, retention_ms: int, limit: int = expire_batch_max,
                          prefix: str = "") -> int:
        """See :meth:`wal_engine.effects.gateway.GatewayStore.expire_keys`."""
        _check_expiry(retention_ms, limit)
        return int(await self._call(self._expire, [self.done_index],
                                    [retention_ms, limit, f"{self._prefix}k:{prefix}"]))

    async def ping(self) -> None:
        """See :meth:`wal_engine.effects.gateway.GatewayStore.ping`."""
        from redis.exceptions import RedisError

        try:
            await self.client.ping()
        except (RedisError, OSError) as error:
            raise GatewayStoreUnavailable(self.where, str(error)) from error

    async def close(self) -> None:
        """Close the client if this store opened it."""
        if self._owns_client:
            await self.client.aclose()

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        from redis.exceptions import RedisError, ResponseError

        try:
            return await script(keys=keys, args=args)
        except ResponseError as error:
            # A script error is this module's bug or a foreign value under our key; the
            # message names which, and no driver class reaches the caller.
            raise GatewayStoreUnavailable(self.where, f"script failed: {error}") from error
        except (RedisError, OSError) as error:
            raise GatewayStoreUnavailable(self.where, str(error)) from error


def _text(value: bytes | None) -> str | None:
    return None if not value else value.decode()


def _client_from_url(url: str) -> Any:
    try:
        import redis.asyncio as redis_asyncio
    except ImportError as error:
        raise ConfigurationError(
            "the Redis gateway store needs the redis extra: pip install 'wal-engine[redis]'"
        ) from error
    return redis_asyncio.Redis.from_url(url, **_client_options())


def _client_options() -> dict[str, Any]:
    """Timeouts on every command, and no retry of a command whose answer was lost."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return {"socket_timeout": command_timeout_s, "socket_connect_timeout": command_timeout_s,
            "retry": Retry(NoBackoff(), 0), "retry_on_error": []}
