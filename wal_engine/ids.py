"""Identifier types and their validation (pure)."""

from __future__ import annotations

import os
import re
import time
from typing import Final, NewType

from wal_engine import limits
from wal_engine.errors import InvalidInput, InvalidTaskId, InvalidTenant

TaskId = NewType("TaskId", str)
WorkerId = NewType("WorkerId", str)
IdempotencyKey = NewType("IdempotencyKey", str)

_task_id_pattern: Final = re.compile(r"[A-Za-z0-9_.:-]+")
_dots_only: Final = re.compile(r"\.+")
"""Ids made of dots alone (``.``, ``..``) name directories in paths: refused."""

DEFAULT_TENANT: Final = "default"
"""The tenant of an engine connected without one (and of the rows of a schema-1 database)."""


def validate_tenant(tenant: object) -> str:
    """Return ``tenant``, or raise :class:`InvalidTenant`.

    The same allow-list as task ids, at most 64 characters; the same rule is a CHECK
    constraint on every tenant column of ``schema.sql``. It is sent as a connection
    setting, so it is checked before any connection is made.
    """
    if not isinstance(tenant, str):
        raise InvalidTenant(tenant, f"must be a str, not {type(tenant).__name__}")
    if not tenant:
        raise InvalidTenant(tenant, "must not be empty")
    if len(tenant) > limits.tenant_length_max:
        raise InvalidTenant(tenant, f"longer than {limits.tenant_length_max} characters")
    if _task_id_pattern.fullmatch(tenant) is None:
        raise InvalidTenant(tenant, "only letters, digits and _ . : - are allowed")
    return tenant


def validate_task_id(task_id: object) -> TaskId:
    """Return ``task_id`` as a :data:`TaskId`, or raise :class:`InvalidTaskId`.

    The allow-list keeps ids safe in logs, file names and shells; the same rule is a CHECK
    constraint in ``schema.sql``.
    """
    if not isinstance(task_id, str):
        raise InvalidTaskId(task_id, f"must be a str, not {type(task_id).__name__}")
    if not task_id:
        raise InvalidTaskId(task_id, "must not be empty")
    if len(task_id) > limits.task_id_length_max:
        raise InvalidTaskId(task_id, f"longer than {limits.task_id_length_max} characters")
    if _task_id_pattern.fullmatch(task_id) is None:
        raise InvalidTaskId(task_id, "only letters, digits and _ . : - are allowed")
    if _dots_only.fullmatch(task_id) is not None:
        raise InvalidTaskId(task_id, "must not be made of dots alone")
    return TaskId(task_id)


def validate_text(value: object, what: str, *, bytes_max: int, chars_max: int | None = None,
                  empty_ok: bool = True) -> str:
    """Return ``value`` if it is a str that PostgreSQL can store, or raise InvalidInput.

    It must encode to UTF-8 (no lone surrogate, such as the ``\\udcff`` a shell argument
    of byte ``\\xff`` becomes), hold no NUL, and fit in ``bytes_max`` UTF-8 bytes (and
    ``chars_max`` characters), and be non-empty unless ``empty_ok``. Other characters
    are data: the log stores them as given (RELIABILITY.md S10).
    """
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a str, not {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as error:
        raise InvalidInput(f"{what} is not valid text (position {error.start})") from None
    if "\x00" in value:
        raise InvalidInput(f"{what} must not contain NUL")
    if size > bytes_max or (chars_max is not None and len(value) > chars_max):
        limit = f"{bytes_max} bytes" if chars_max is None else f"{chars_max} characters"
        raise InvalidInput(f"{what} is longer than {limit}")
    if not value and not empty_ok:
        raise InvalidInput(f"{what} must not be empty")
    return value


def new_task_id(now_ms: int | None = None) -> TaskId:
    """Mint a fresh task id, ordered by time: ``t-`` and 32 hex digits laid out as a UUIDv7
    (the first 12 are the milliseconds since the Unix epoch, ``now_ms`` or the clock; then
    the version nibble ``7``, 12 random bits, the variant and 62 random bits).

    The log's per-task tables are partitioned by ranges of task ids, one month each
    (``schema.sql``, section "partitioning"; decision 70): a task minted now lands in
    this month's partition, which retention can drop whole once every task in it is
    archived. Ids chosen by callers are accepted as before (they land where their text
    sorts, usually the default partition).
    """
    millis = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    if not 0 <= millis < 1 << 48:
        raise InvalidInput(f"a task id's clock must be 0..2^48-1 ms, not {millis}")
    random_bits = int.from_bytes(os.urandom(10), "big")  # 80 bits, 74 of them used
    value = (millis << 80) | (0x7 << 76) | ((random_bits >> 68) << 64) \
        | (0b10 << 62) | (random_bits & ((1 << 62) - 1))
    return TaskId(f"t-{value:032x}")


def idempotency_key(task_id: str, seq: int) -> IdempotencyKey:
    """The key of the side effect announced by the intent at ``seq`` of ``task_id``.

    It depends only on the position of the intent in the history, so a retry, a replay and
    a new owner of the task all hand the callee the same key (RELIABILITY.md R2).
    """
    return IdempotencyKey(f"idem:{task_id}:{seq}")
