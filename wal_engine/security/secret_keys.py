"""Secret key names: in JSON objects, in header lists, and in ``name=value`` text (pure).

A key is compared after normalisation (camelCase split, lower case, every run of
non-alphanumerics turned into ``_``: ``X-Api-Key``, ``xApiKey`` and ``X_API_KEY`` are all
``x_api_key``) and also with its separators removed (``apiKey``, ``api-key`` and ``APIKEY``
are one name). It is secret if it is one of :data:`SECRET_KEY_NAMES`, or ends with ``_``
and one of :data:`SECRET_KEY_SUFFIXES` (``db_password``, ``aws_secret_access_key``), or
ends with a suffix of several words written without separators (``xapikey``). So
``max_tokens``, ``next_page_token`` and ``idempotency_key`` are not secret.

:class:`KeyRules` applies them; :meth:`KeyRules.redact_assignments` finds ``name=value``,
``name: value``, ``"name": "value"`` (also JSON inside a string, with ``\\"``) in free
text, and replaces the value when the name is secret: ``DB_PASSWORD=...``,
``Authorization: Token ...`` (the scheme is kept), ``Cookie: sessionid=...`` (the whole
header value), ``AccountKey=...;`` in a connection string.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

REDACTED: Final = "[REDACTED]"

SECRET_KEY_NAMES: Final = frozenset({
    "auth", "authorization", "bearer", "cookie", "cookies", "credential", "credentials",
    "jwt", "passphrase", "passwd", "password", "pwd", "pw", "pass", "passcode", "secret",
    "token", "key", "api_key", "apikey", "private_key", "secret_key", "access_key",
    "account_key", "client_secret", "session_token", "access_token", "refresh_token",
    "id_token", "auth_token", "sessionid", "session_id", "phpsessid", "jsessionid",
    "connect_sid", "set_cookie", "proxy_authorization", "shared_access_signature",
    "x_amz_security_token", "private_token",
})
SECRET_KEY_SUFFIXES: Final = (
    "access_key", "access_token", "account_key", "api_key", "apikey", "api_token",
    "auth_token", "authorization", "bearer_token", "client_secret", "cookie", "credential",
    "credentials", "csrf_token", "encryption_key", "id_token", "master_key", "oauth_token",
    "passphrase", "passwd", "password", "pass", "pwd", "pw", "private_key", "private_token",
    "refresh_token", "sas_token", "secret", "secret_key", "secret_token", "security_token",
    "session_id", "session_key", "session_token", "sessionid", "signing_key", "xsrf_token",
    "access_signature", "webhook_secret",
)
HEADER_KEYS: Final = frozenset({"authorization", "proxy_authorization", "cookie",
                                "set_cookie"})
"""Keys whose text value runs to the end of its line (``Cookie: a=1; b=2``)."""
AUTH_HEADER_KEYS: Final = frozenset({"authorization", "proxy_authorization"})
"""Keys whose value may start with a scheme word that is kept (``Token``, ``Bearer``)."""

KEY_TRIGGERS: Final = ("pass", "pw", "secret", "key", "token", "auth", "cookie", "credential",
                       "jwt", "bearer", "sess", "sid", "signature")
"""Substrings of the lower-cased text one of which every secret name holds (the quick test
before the assignment scan); a test checks that each default name holds one."""

key_length_max: Final = 128
value_length_max: Final = 4096
"""A quoted value longer than this, or a header value, is redacted up to this length and
no further (the rest of a runaway line stays)."""

_camel: Final = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_separators: Final = re.compile(r"[^a-z0-9]+")
# A name (starting where no name character precedes it, so a run is scanned from one
# start), an optional closing quote (plain or escaped), spaces, and "=", "=>" (PHP arrays,
# Ruby and Perl hashes) or ":" (not the "://" of a URL; "%3D" and "%3A" are "=" and ":"
# URL-encoded). Possessive runs: linear.
_assignment: Final = re.compile(
    r"(?<![\w.-])([A-Za-z_][\w.-]{0,127}+)"
    r"(\\?[\"']?[ \t]{0,16}+(?:=>?+|:(?!//)|%3[DdAa])[ \t]{0,16}+)")
_unquoted: Final = re.compile(r"[^\s&,;\"'<>\\]{1,4096}+")
_scheme: Final = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,19}+[ \t]++(?=\S)")


def normalise_key(key: str) -> str:
    """A key as the key-name rules see it: ``"X-Api-Key"`` and ``"xApiKey"`` -> ``"x_api_key"``."""
    return _separators.sub("_", _camel.sub("_", key).lower()).strip("_")


class KeyRules:
    """Which keys are secret (:data:`SECRET_KEY_NAMES` and suffixes, plus extra names,
    minus kept ones), with a cache."""

    def __init__(self, extra_keys: Iterable[str] = (), keep_keys: Iterable[str] = ()) -> None:
        """Build the rules from the default names and these changes."""
        extra = [normalise_key(k) for k in extra_keys]
        self.keep = frozenset(normalise_key(k).replace("_", "") for k in keep_keys)
        self.names = frozenset(n.replace("_", "") for n in (*SECRET_KEY_NAMES, *extra,
                                                            *SECRET_KEY_SUFFIXES))
        self.suffixes = tuple(f"_{s}" for s in (*SECRET_KEY_SUFFIXES, *extra))
        self.squashed_suffixes = tuple(s.replace("_", "") for s in (*SECRET_KEY_SUFFIXES,
                                                                    *extra) if "_" in s)
        self.triggers = tuple(dict.fromkeys([*KEY_TRIGGERS, *(e.replace("_", "")
                                                                for e in extra)]))
        self._cache: dict[str, bool] = {}

    def is_secret(self, key: str) -> bool:
        """Whether the value under ``key`` is redacted whole."""
        known = self._cache.get(key)
        if known is None:
            name = normalise_key(key)
            squashed = name.replace("_", "")
            known = squashed not in self.keep and (
                squashed in self.names or name.endswith(self.suffixes)
                or squashed.endswith(self.squashed_suffixes))
            if len(self._cache) < 10_000:
                self._cache[key] = known
        return known

    def may_assign(self, lowered: str) -> bool:
        """The quick test: whether lower-cased text may hold a secret assignment."""
        return any(trigger in lowered for trigger in self.triggers)

    def redact_assignments(self, text: str) -> str:
        """``text`` with the value of every ``secret_name=value`` (or ``: value``) replaced."""
        pieces: list[str] = []
        done = 0
        position = 0
        while True:
            found = _assignment.search(text, position)
            if found is None:
                break
            position = found.end()
            if not self.is_secret(found.group(1)):
                continue
            span = self._value_span(text, found.end(), normalise_key(found.group(1)))
            if span is None:
                continue
            start, end = span
            pieces.append(text[done:start])
            pieces.append(REDACTED)
            done = position = end
        if not pieces:
            return text
        pieces.append(text[done:])
        return "".join(pieces)

    @staticmethod
    def _value_span(text: str, start: int, name: str) -> tuple[int, int] | None:
        """Where the value after a secret name's separator is (None: nothing to redact)."""
        if text.startswith(REDACTED[:9], start):
            return None  # Already redacted (by a format, or by an earlier pass).
        quote = text[start:start + 2]
        if quote[:1] in "\"'" and quote:
            close = text.find(quote[0], start + 1, start + 1 + value_length_max)
            return start + 1, _line_end(text, start + 1) if close < 0 else close
        if quote in ("\\\"", "\\'"):
            close = text.find(quote, start + 2, start + 2 + value_length_max)
            return start + 2, _line_end(text, start + 2) if close < 0 else close
        if name in HEADER_KEYS:
            if name in AUTH_HEADER_KEYS:
                scheme = _scheme.match(text, start)
                if scheme is not None:
                    start = scheme.end()
            end = _line_end(text, start)
            return None if end == start else (start, end)
        value = _unquoted.match(text, start)
        if value is None or text[start] in "{[":
            return None
        return start, value.end()


def _line_end(text: str, start: int) -> int:
    """The end of the line from ``start`` (at most :data:`value_length_max` on)."""
    limit = min(len(text), start + value_length_max)
    ends = [i for i in (text.find("\n", start, limit), text.find("\r", start, limit)) if i >= 0]
    return min(ends) if ends else limit
