"""Per-tenant payload encryption that can be crypto-shredded (optional ``cryptography``).

Redaction removes secrets the log must never hold. Some data the log *must* hold (a
customer's document, an LLM transcript) is still sensitive, and the log is append-only: it
cannot be deleted on request. Sealing such values under a per-tenant key solves both: the
log stores a **sealed envelope** (plain JSON, so it is validated, hashed and stored like any
value), and deleting the tenant's key makes every envelope of that tenant unreadable
("crypto-shredding") without editing a single row. The chain hash covers the stored
envelope, so ``verify`` and anchors work without any key.

Keys: the application provides each tenant's key-encryption key (KEK, 32 bytes or more) through
a :data:`KeyProvider` (a KMS, a vault; it returns None once the key is deleted). The data key
is derived from it per tenant and key version (HKDF-SHA256), so no key material is stored in
the database at all. Sealing is deterministic AES-SIV (RFC 5297) with the tenant and key
version as associated data: the same value sealed twice gives the same envelope, which
replay needs (a sealed tool argument is matched by its hash), at the cost of revealing that
two sealed values are equal. An envelope cannot be moved to another tenant.

Use it explicitly where values enter and leave: a tool returns ``cipher.seal(tenant,
result)``, agent code calls ``cipher.open(sealed)`` when it needs the value (live and on
replay alike, while the key exists). Snapshots hold what the events hold, the envelopes.

Needs ``pip install 'wal-engine[security]'``.
"""

from __future__ import annotations

import base64
import importlib
from collections.abc import Callable
from typing import Any, Final

import orjson

from wal_engine.errors import ConfigurationError
from wal_engine.errors import EnvelopeInvalid as EnvelopeInvalid
from wal_engine.errors import KeyShredded as KeyShredded
from wal_engine.payloads import encode_payload

SEALED_KEY: Final = "$sealed"
ENVELOPE_VERSION: Final = 1
kek_bytes_min: Final = 32

KeyProvider = Callable[[str, int], bytes | None]
"""``(tenant, key_version) -> key`` or None when that key was deleted (shredded)."""


def is_sealed(value: Any) -> bool:
    """Whether ``value`` is a sealed envelope (redaction leaves these alone)."""
    return type(value) is dict and value.get(SEALED_KEY) == ENVELOPE_VERSION \
        and type(value.get("ct")) is str


def _primitives() -> tuple[Any, Any, Any]:
    try:
        aead = importlib.import_module("cryptography.hazmat.primitives.ciphers.aead")
        hkdf = importlib.import_module("cryptography.hazmat.primitives.kdf.hkdf")
        hashes = importlib.import_module("cryptography.hazmat.primitives.hashes")
    except ImportError as error:
        raise ConfigurationError("payload encryption needs the 'cryptography' package: "
                                 "pip install 'wal-engine[security]'") from error
    return aead, hkdf, hashes


class PayloadCipher:
    """Seals and opens plain JSON values under per-tenant keys."""

    def __init__(self, keys: KeyProvider, *, key_version: int = 1) -> None:
        """Build a cipher over the application's tenant keys.

        Args:
            keys: Returns a tenant's key for a version, or None once it was deleted.
            key_version: The version new envelopes are sealed with (rotation: seal new data
                under a new version; old envelopes keep naming theirs).
        """
        self.keys = keys
        self.key_version = key_version
        self._aead, self._hkdf, self._hashes = _primitives()
        self._ciphers: dict[tuple[str, int], Any] = {}

    def _cipher(self, tenant: str, key_version: int) -> Any:
        cached = self._ciphers.get((tenant, key_version))
        if cached is not None:
            return cached
        kek = self.keys(tenant, key_version)
        if kek is None:
            raise KeyShredded(tenant, key_version)
        if len(kek) < kek_bytes_min:
            raise ConfigurationError(f"tenant keys need at least {kek_bytes_min} bytes")
        data_key = self._hkdf.HKDF(
            algorithm=self._hashes.SHA256(), length=64, salt=None,
            info=f"wal-engine/data-key/v1/{tenant}/{key_version}".encode(),
        ).derive(kek)
        cipher = self._aead.AESSIV(data_key)
        if len(self._ciphers) < 10_000:
            self._ciphers[(tenant, key_version)] = cipher
        return cipher

    def forget(self, tenant: str) -> None:
        """Drop the tenant's cached data keys (call after deleting its key)."""
        for cached in [k for k in self._ciphers if k[0] == tenant]:
            del self._ciphers[cached]

    def seal(self, tenant: str, value: Any) -> dict[str, Any]:
        """The envelope of ``value`` (plain JSON, deterministic) for the tenant."""
        if not tenant:
            raise ValueError("sealing needs a tenant")
        plaintext = encode_payload(value)
        version = self.key_version
        ciphertext = self._cipher(tenant, version).encrypt(plaintext, _associated(tenant,
                                                                                   version))
        return {SEALED_KEY: ENVELOPE_VERSION, "tenant": tenant, "key_version": version,
                "ct": base64.b64encode(ciphertext).decode("ascii")}

    def open(self, envelope: Any) -> Any:
        """The value sealed in ``envelope``; raises :class:`KeyShredded` once its key is gone."""
        if not is_sealed(envelope):
            raise EnvelopeInvalid("not a sealed envelope")
        tenant, version = envelope.get("tenant"), envelope.get("key_version")
        if not isinstance(tenant, str) or not isinstance(version, int):
            raise EnvelopeInvalid("the envelope names no tenant or key version")
        cipher = self._cipher(tenant, version)
        exceptions = importlib.import_module("cryptography.exceptions")
        try:
            plaintext = cipher.decrypt(base64.b64decode(envelope["ct"], validate=True),
                                       _associated(tenant, version))
        except (ValueError, exceptions.InvalidTag) as error:
            raise EnvelopeInvalid("the envelope does not authenticate") from error
        return orjson.loads(plaintext)


def _associated(tenant: str, key_version: int) -> list[bytes]:
    return [f"wal-engine sealed v{ENVELOPE_VERSION}\n{tenant}\n{key_version}".encode()]
