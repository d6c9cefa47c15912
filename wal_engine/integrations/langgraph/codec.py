"""Pure helpers of the LangGraph saver: thread ids, channel versions, stored values.

Nothing here touches the database. Values come from LangGraph's serializer
(``serde.dumps_typed`` -> ``(type, bytes)``) and are stored as plain JSON inside event
payloads, in one of three shapes:

* ``{"j": value}``: a plain JSON scalar (``None``, ``bool``, ``int``, finite ``float``,
  ``str``) kept as itself, readable by SQL audits. Only when the serializer is LangGraph's
  own ``JsonPlusSerializer`` (never for an encrypting or custom serializer, whose output
  must stay opaque).
* ``{"t": type, "b": base64}``: the serializer's bytes.
* ``{"t": type, "z": base64}``: the serializer's bytes compressed with zlib, when that
  saves at least an eighth (large message lists compress several times over).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import random
import re
import zlib
from typing import Any, Final, Protocol

from wal_engine.errors import CorruptionError, InvalidPayload
from wal_engine.payloads import validate_json_value

TASK_PREFIX: Final = "lg-"
"""Task id of a thread whose id is already a safe task id: ``lg-<thread_id>``."""

HASHED_TASK_PREFIX: Final = "lgh-"
"""Task id of any other thread: ``lgh-<sha256 of the thread id>`` (no collision with the
plain form, whose next character after ``lg`` is always ``-``)."""

_plain_thread_id: Final = re.compile(r"[A-Za-z0-9_.:-]{1,100}")

version_digits_min: Final = 12
"""Zero-padded width of the counter of string versions (threads that came with them)."""

version_random_bits: Final = 48
"""Random bits after the counter of string versions, as LangGraph's own savers mint them."""

compress_min_bytes: Final = 256
"""Serialized values at least this long are tried with zlib."""

compress_level: Final = 3
"""zlib level: most of level 6's ratio on message lists at a third of its cost."""

decompressed_bytes_max: Final = 256 * 1024 * 1024
"""Largest value a stored compressed value may expand to (a bound, not a setting)."""

_json_scalar_types: Final = (str, int, float, bool, type(None))


class TypedSerializer(Protocol):
    """The part of LangGraph's ``SerializerProtocol`` the saver uses."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        """Serialize ``obj`` into a type tag and bytes."""
        ...

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        """Deserialize what :meth:`dumps_typed` produced."""
        ...


def thread_task_id(thread_id: str) -> str:
    """The wal-engine task id of a LangGraph thread (deterministic, always a valid task id).

    A thread id made of ``[A-Za-z0-9_.:-]`` and at most 100 characters maps to
    ``lg-<thread_id>`` (readable in ``wal-engine tasks``); any other maps to
    ``lgh-<sha256 hex of its UTF-8>``.
    """
    if _plain_thread_id.fullmatch(thread_id):
        return TASK_PREFIX + thread_id
    digest = hashlib.sha256(thread_id.encode("utf-8", "surrogatepass")).hexdigest()
    return HASHED_TASK_PREFIX + digest


def version_key(version: object) -> str:
    """The text a channel version is indexed under (the same on write and on read)."""
    if isinstance(version, str):
        return version
    return repr(version)


def next_version(current: str | int | float | None) -> str:
    """The next string channel version: a zero-padded counter, a dot, random hex.

    The saver mints integers; this continues a thread whose versions are strings (written by
    LangGraph's Postgres or in-memory saver and copied here). String versions compare as
    strings (LangGraph takes ``max`` of them and compares them with ``>``), so the counter is
    zero-padded and never narrower than the version it follows.
    """
    width = version_digits_min
    if current is None:
        counter = 0
    elif isinstance(current, (int, float)):
        counter = int(current)
    else:
        head = current.split(".", 1)[0]
        counter = int(head)
        width = max(width, len(head))
    suffix = random.getrandbits(version_random_bits)
    return f"{counter + 1:0{width}d}.{suffix:0{version_random_bits // 4}x}"


class ValueCodec:
    """Turns channel values and writes into plain JSON entries and back.

    Args:
        serde: LangGraph's serializer of the saver.
        inline_json: Keep plain JSON scalars as themselves (see the module docstring).
    """

    def __init__(self, serde: TypedSerializer, *, inline_json: bool) -> None:
        self.serde = serde
        self.inline_json = inline_json

    def encode(self, value: Any) -> dict[str, Any]:
        """The stored entry of ``value``."""
        if self.inline_json and type(value) in _json_scalar_types:
            try:
                validate_json_value(value)
            except InvalidPayload:
                pass  # NUL, lone surrogate, NaN or a huge int: the serializer keeps it exact.
            else:
                return {"j": value}
        kind, data = self.serde.dumps_typed(value)
        if len(data) >= compress_min_bytes:
            packed = zlib.compress(data, compress_level)
            if len(packed) * 8 <= len(data) * 7:
                return {"t": kind, "z": base64.b64encode(packed).decode("ascii")}
        return {"t": kind, "b": base64.b64encode(data).decode("ascii")}

    def decode(self, entry: dict[str, Any]) -> Any:
        """The value of a stored entry; raises :class:`CorruptionError` on a malformed one."""
        if "j" in entry:
            return entry["j"]
        try:
            kind = entry["t"]
            if "z" in entry:
                data = _inflate(base64.b64decode(entry["z"], validate=True))
            else:
                data = base64.b64decode(entry["b"], validate=True)
        except (KeyError, TypeError, binascii.Error, zlib.error) as error:
            raise CorruptionError(f"stored LangGraph value is malformed: {error!r}") from error
        return self.serde.loads_typed((kind, data))


def _inflate(packed: bytes) -> bytes:
    """zlib-decompress with a bound on the output size."""
    inflater = zlib.decompressobj()
    data = inflater.decompress(packed, decompressed_bytes_max)
    if inflater.unconsumed_tail:
        raise CorruptionError(
            f"stored LangGraph value expands past {decompressed_bytes_max} bytes"
        )
    return data


int_min: Final = -(2**63)
int_max: Final = 2**63 - 1
"""The integers the log's payloads hold as JSON numbers (:mod:`wal_engine.payloads`)."""

JsonPath = list[str | int]
"""Keys and indexes from a metadata dict down to one value."""


def lift_big_ints(value: Any, path: JsonPath | None = None,
                  found: list[JsonPath] | None = None) -> tuple[Any, list[JsonPath]]:
    """``value`` with every integer outside the 64-bit range as its decimal text, and where.

    The log's payloads hold only 64-bit integers as numbers; LangGraph's Postgres saver
    keeps any integer exactly (jsonb numeric). The paths let :func:`restore_big_ints` give
    back the very integers, and let a metadata filter match them (``lift_big_ints`` of the
    filter turns them into the same text).
    """
    path = [] if path is None else path
    found = [] if found is None else found
    if type(value) is int and not int_min <= value <= int_max:
        found.append(list(path))
        return str(value), found
    if isinstance(value, dict):
        return {key: lift_big_ints(item, [*path, key], found)[0]
                for key, item in value.items()}, found
    if isinstance(value, (list, tuple)):
        return [lift_big_ints(item, [*path, index], found)[0]
                for index, item in enumerate(value)], found
    return value, found


def restore_big_ints(value: Any, paths: list[JsonPath]) -> Any:
    """``value`` (a stored metadata dict, changed in place) with its big integers back.

    Raises:
        CorruptionError: a path does not lead to the decimal text of an integer.
    """
    for path in paths:
        holder = value
        try:
            for step in path[:-1]:
                holder = holder[step]
            holder[path[-1]] = int(holder[path[-1]])
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise CorruptionError(f"stored big integer at {path!r} is malformed") from error
    return value


def contains(document: Any, wanted: Any) -> bool:
    """JSON containment as jsonb's ``@>`` decides it (objects by key, arrays by element),
    with integers compared exactly: the check behind a metadata filter holding big ints."""
    if isinstance(wanted, dict):
        return isinstance(document, dict) and all(
            key in document and contains(document[key], item) for key, item in wanted.items())
    if isinstance(wanted, (list, tuple)):
        return isinstance(document, list) and all(
            any(contains(element, item) for element in document) for item in wanted)
    numbers = (int, float)
    if (isinstance(document, numbers) and isinstance(wanted, numbers)
            and not isinstance(document, bool) and not isinstance(wanted, bool)):
        return bool(document == wanted)  # jsonb compares numbers by value: 1 matches 1.0
    return type(document) is type(wanted) and bool(document == wanted)


def split_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint without its channel values (what a checkpoint event stores inline).

    Raises:
        InvalidPayload: a field other than the channel values is not plain JSON (LangGraph
            checkpoints of format 4 and later have only plain JSON outside the values).
    """
    skeleton = {key: value for key, value in checkpoint.items() if key != "channel_values"}
    validate_json_value(skeleton)
    return skeleton

