"""Secret redaction before append, and secret references resolved at call time (pure).

The log is permanent, replicated and backed up, and append-only: a secret written to it
cannot be taken back (RELIABILITY.md, Security). So every value that comes from agent code,
a tool, an LLM or a sender of signals passes through a **redactor** before it is hashed and
written: task inputs and outputs, tool and LLM intents (arguments, requests), results,
errors, messages, signals, approvals, environment variables and checkpoint actions.

A redactor is a deterministic function from a plain JSON value to a plain JSON value
(:data:`Redactor`). Deterministic matters twice: replay re-runs agent code and matches its
calls by a hash of their *redacted* arguments, and the chain hash covers the redacted bytes,
so the same input must always give the same output. Agent code sees what was recorded (the
redacted value), live and on replay alike, so behaviour does not change after a crash.

:class:`DefaultRedactor` (the engine's default, configurable on ``connect(redactor=...)``):

* replaces the value under a secret-looking key (``authorization``, ``cookie``,
  ``password``, ``token``, ``secret``, ``api_key``, ``client_secret``, ``private_key``, ...;
  camelCase, kebab-case and prefixes such as ``x-api-key`` or ``db_password`` included) by
  ``"[REDACTED]"``, whatever its type;
* replaces substrings of every string that look like common credential formats (cloud and
  SaaS API keys, GitHub, GitLab, Slack and Stripe tokens, JWTs, private key blocks, bearer
  tokens, passwords in URLs and in ``password=...`` assignments) by ``"[REDACTED:kind]"``.

Secrets a tool needs are passed as **references**, :func:`secret_ref` ``("name")``, a plain
``{"$secret": "name"}`` object that is what the log records; the engine resolves references
through the application's :data:`SecretResolver` just before each attempt of the call and
scrubs the resolved values from the call's result and error text. The value itself is never
stored.

Redaction by pattern is a safety net, not a guarantee: a secret in an unknown format under
an innocent key name passes. Use references for secrets you know of, and payload encryption
(:mod:`wal_engine.encryption`) where the log must hold sensitive data.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, NamedTuple

import msgspec

from wal_engine import events as ev
from wal_engine.encryption import is_sealed
from wal_engine.errors import PayloadTooLarge, WalError

Redactor = Callable[[Any], Any]
"""A deterministic function from a plain JSON value to the plain JSON value to store."""

SecretResolver = Callable[[str], str | Awaitable[str]]
"""Returns the value of the named secret (sync or async); raises if it has none."""

REDACTED: Final = "[REDACTED]"
SECRET_REF_KEY: Final = "$secret"
redaction_depth_max: Final = 256
"""Deeper values are replaced whole (payloads are refused beyond 64 levels anyway)."""
gated_cache_max: Final = 4096
"""Distinct sets of gate characters whose matching formats a redactor remembers."""
known_secret_length_min: Final = 4
"""Resolved secret values shorter than this are not scrubbed from results (too many false
matches); such a value is not a secret worth the name."""

# Key names, compared after normalisation (camelCase split, lower case, every run of
# non-alphanumerics turned into "_"). A key is secret if it equals a name below, or ends with
# "_" + one of the suffixes (so "db_password" and "x_api_key" are secret and "max_tokens",
# "next_page_token" or "idempotency_key" are not).
SECRET_KEY_NAMES: Final = frozenset({
    "auth", "authorization", "bearer", "cookie", "cookies", "credential", "credentials",
    "jwt", "passphrase", "passwd", "password", "pwd", "secret", "token", "api_key", "apikey",
    "private_key", "secret_key", "access_key", "client_secret", "session_token",
    "access_token", "refresh_token", "id_token", "auth_token",
})
SECRET_KEY_SUFFIXES: Final = (
    "access_key", "access_token", "api_key", "apikey", "api_token", "auth_token",
    "authorization", "bearer_token", "client_secret", "cookie", "credential", "credentials",
    "csrf_token", "encryption_key", "id_token", "master_key", "oauth_token", "passphrase",
    "passwd", "password", "private_key", "refresh_token", "secret", "secret_key",
    "session_key", "session_token", "signing_key", "xsrf_token",
)

_camel: Final = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_separators: Final = re.compile(r"[^a-z0-9]+")


class CredentialPattern(msgspec.Struct, frozen=True):
    """A credential format: a regex, what a match is replaced with (``\\1`` allowed), and
    the quick tests that decide whether the regex runs at all (a string that fails them
    is not searched; plain substring tests cost far less than the regex):

    * ``requires``: groups of characters; any match holds at least one character of each
      group (``("-",)`` for ``sk-...``; ``(":=",)`` for ``password=...``). Each is one
      ``memchr`` over the text, so these go first, and most prose fails one of them.
    * ``triggers``: substrings one of which any match contains. They are lower case and
      tested against the lower-cased text, unless ``exact``: then they are tested, as given,
      against the text itself (for case-sensitive formats; fewer, rarer candidates: the AWS
      prefixes are one scan instead of eleven).

    Both must be true of every match, or a credential would pass unredacted: a test checks
    the default formats against a redactor that ignores them."""

    kind: str
    regex: str
    replacement: str
    triggers: tuple[str, ...] = ()
    exact: bool = False
    requires: tuple[str, ...] = ()


_AWS_PREFIXES: Final = ("AKIA", "ASIA", "ABIA", "ACCA", "AGPA", "AIDA", "AIPA", "ANPA", "ANVA",
                        "APKA", "AROA")

# Every format runs in time linear in the text, whatever the text (RELIABILITY.md B10):
# tool results and signal payloads are attacker-controlled, and a regex that backtracks
# over the rest of the text at each of its starts stalls the worker's event loop (a
# 128 KiB run of "eyJ-" once took 20 s). Three rules keep each format linear:
# * a quantifier over a run of characters is possessive (``++``, ``{n,}+``), so a run is
#   never re-scanned shorter when what follows it fails;
# * a format whose first characters belong to the class of its body starts only where a
#   run of that class starts (a lookbehind, not ``\b``), so each run is scanned from one
#   start, not from each of its positions;
# * what stays non-possessive (the words before "PRIVATE KEY", a URL's scheme) is bounded.
DEFAULT_PATTERNS: Final = (
    CredentialPattern(
        "private_key",
        # The body runs to the END line, or, when the END line is missing (a key cut off),
        # to the first character no key body holds.
        r"-----BEGIN (?:[A-Z0-9]{1,20} ){0,4}PRIVATE KEY(?: BLOCK)?-----"
        r"(?:[A-Za-z0-9+/=\s:,\\]|-(?!----)){0,16384}+"
        r"(?:-----END (?:[A-Z0-9]{1,20} ){0,4}PRIVATE KEY(?: BLOCK)?-----)?",
        "[REDACTED:private_key]", ("-----BEGIN",), exact=True, requires=("-",)),
    CredentialPattern(
        "aws_access_key_id",
        r"\b(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|APKA|AROA)[A-Z0-9]{16}\b",
        "[REDACTED:aws_access_key_id]", _AWS_PREFIXES, exact=True, requires=("A",)),
    CredentialPattern("github_token",
                      r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}+|github_pat_[A-Za-z0-9_]{22,255}+)\b",
                      "[REDACTED:github_token]",
                      ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"), exact=True,
                      requires=("_",)),
    CredentialPattern("gitlab_token", r"\bglpat-[A-Za-z0-9_-]{20,}+", "[REDACTED:gitlab_token]",
                      ("glpat-",), exact=True, requires=("-",)),
    CredentialPattern("slack_token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}+",
                      "[REDACTED:slack_token]", ("xox",), exact=True, requires=("-",)),
    CredentialPattern("slack_webhook", r"https://hooks\.slack\.com/services/[A-Za-z0-9/_-]++",
                      "[REDACTED:slack_webhook]", ("hooks.slack.com",), exact=True,
                      requires=(":",)),
    CredentialPattern("stripe_key", r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}+",
                      "[REDACTED:stripe_key]", ("k_live_", "k_test_"), exact=True,
                      requires=("_",)),
    CredentialPattern("api_key", r"\bsk-[A-Za-z0-9_-]{20,}+", "[REDACTED:api_key]", ("sk-",),
                      exact=True, requires=("-",)),
    CredentialPattern("google_api_key", r"\bAIza[0-9A-Za-z_-]{35}",
                      "[REDACTED:google_api_key]", ("AIza",), exact=True,
                      requires=("A",)),
    CredentialPattern("package_token", r"\b(?:npm_[A-Za-z0-9]{36}|pypi-[A-Za-z0-9_-]{50,}+)",
                      "[REDACTED:package_token]", ("npm_", "pypi-"), exact=True,
                      requires=("_-",)),
    CredentialPattern("jwt",
                      r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{5,}+\.eyJ[A-Za-z0-9_-]{5,}+"
                      r"\.[A-Za-z0-9_-]{5,}+",
                      "[REDACTED:jwt]", ("eyJ",), exact=True, requires=("J", ".")),
    # "Bearer <token>" and "Authorization: Basic <base64>": the scheme is kept. A bearer
    # token must hold a digit, so that prose ("the bearer of bad news") is left alone.
    CredentialPattern("bearer",
                      r"(?i:\b(bearer)\s++)(?=[A-Za-z._~+/-]*+[0-9])[A-Za-z0-9._~+/-]{8,}+=*+",
                      r"\1 [REDACTED]", ("bearer",), requires=("0123456789",)),
    CredentialPattern("basic_auth",
                      r"(?i:(authorization\s*+[:=]\s*+basic)\s++)[A-Za-z0-9+/]{6,}+=*+",
                      r"\1 [REDACTED]", ("basic",), requires=(":=",)),
    # scheme://user:password@host: the password only.
    CredentialPattern("url_password",
                      r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]{0,31}+://[^\s:/@]++)"
                      r":[^\s@/]++@",
                      r"\1:[REDACTED]@", ("://",), exact=True,
                      requires=(":", "@")),
    # password=..., api_key: ... in free text (the name and separator are kept).
    CredentialPattern(
        "assignment",
        r"(?i:\b(password|passwd|pwd|secret|client[_-]?secret|api[_-]?key|access[_-]?key|"
        r"access[_-]?token|auth[_-]?token|token)(\s*+[=:]\s*+))(?!\[REDACTED)"
        r"([^\s&'\",;]{3,}+)",
        r"\1\2[REDACTED]", ("pass", "pwd", "secret", "key", "token"), requires=(":=",)),
)
"""The credential formats :class:`DefaultRedactor` looks for in every string."""


def normalise_key(key: str) -> str:
    """A key as the key-name rules see it: ``"X-Api-Key"`` and ``"xApiKey"`` -> ``"x_api_key"``."""
    return _separators.sub("_", _camel.sub("_", key).lower()).strip("_")


def is_secret_ref(value: Any) -> bool:
    """Whether ``value`` is a secret reference (``{"$secret": "name"}``)."""
    return (type(value) is dict and len(value) == 1
            and type(value.get(SECRET_REF_KEY)) is str)


def secret_ref(name: str) -> dict[str, str]:
    """A reference to the application's secret ``name``: what the log records instead of it.

    Pass it in a tool's arguments (``ctx.tool("charge", charge, {"key": secret_ref("stripe")})``);
    the engine resolves it through the resolver given to ``connect(secrets=...)`` right
    before each attempt, so the tool receives the value and the log never does.
    """
    if not name:
        raise ValueError("a secret reference needs a name")
    return {SECRET_REF_KEY: name}


class DefaultRedactor:
    """Key-name and credential-format redaction (deterministic and idempotent)."""

    def __init__(
        self,
        *,
        extra_keys: Iterable[str] = (),
        keep_keys: Iterable[str] = (),
        extra_patterns: Iterable[CredentialPattern] = (),
        patterns: Iterable[CredentialPattern] | None = None,
    ) -> None:
        """Build a redactor from the default rules and these changes.

        Args:
            extra_keys: More key names whose values are always redacted.
            keep_keys: Key names never redacted by name (their strings still are by pattern).
            extra_patterns: More credential formats, after the default ones.
            patterns: Replace the default formats altogether.
        """
        self.keep_keys = frozenset(normalise_key(k) for k in keep_keys)
        self.names = (frozenset(normalise_key(k) for k in extra_keys) | SECRET_KEY_NAMES
                      | frozenset(SECRET_KEY_SUFFIXES))
        self.suffixes = tuple(f"_{s}" for s in SECRET_KEY_SUFFIXES) + tuple(
            f"_{normalise_key(k)}" for k in extra_keys)
        chosen = (*(DEFAULT_PATTERNS if patterns is None else patterns), *extra_patterns)
        # Every character some format requires gets a bit; a format's groups become masks,
        # so that its gate is a few integer ANDs once the text's characters are known.
        gate_chars = sorted({c for p in chosen for group in p.requires for c in group})
        bits = {c: 1 << index for index, c in enumerate(gate_chars)}
        self._gate_bits = tuple(bits.items())
        self._gated: dict[int, tuple[_Format, ...]] = {}
        """The formats whose gates pass, by the set of gate characters a text holds."""
        self.patterns = tuple(
            _Format(re.compile(p.regex), p.replacement,
                    tuple(sum(bits[c] for c in set(group)) for group in p.requires),
                    _trigger_check(p), p.exact)
            for p in chosen)
        self._key_cache: dict[str, bool] = {}

    def __call__(self, value: Any) -> Any:
        """The value with secrets replaced; ``value`` itself is never changed, and is
        returned as is when nothing in it was redacted."""
        return self._walk(value, 0)

    def is_secret_key(self, key: str) -> bool:
        """Whether the value under ``key`` is redacted whole."""
        known = self._key_cache.get(key)
        if known is None:
            name = normalise_key(key)
            known = name not in self.keep_keys and (
                name in self.names or name.endswith(self.suffixes))
            if len(self._key_cache) < 10_000:
                self._key_cache[key] = known
        return known

    def redact_text(self, text: str) -> str:
        """``text`` with every credential-looking substring replaced."""
        if len(text) < 8:
            return text
        present = 0
        for char, bit in self._gate_bits:
            if char in text:
                present |= bit
        formats = self._gated.get(present)
        if formats is None:
            formats = tuple(f for f in self.patterns
                            if all(present & group for group in f.groups))
            if len(self._gated) < gated_cache_max:
                self._gated[present] = formats
        lowered: str | None = None
        redacted = text
        # The quick tests look at the original text: a replacement only removes credentials
        # and adds "[REDACTED...]", so no later format can appear anew.
        for regex, replacement, _groups, check, exact in formats:
            if check is not None:
                if exact:
                    if not check(text):
                        continue
                else:
                    if lowered is None:
                        lowered = text.lower()
                    if not check(lowered):
                        continue
            redacted = regex.sub(replacement, redacted)
        return redacted

    def secrets_in(self, value: Any) -> list[str]:
        """The strings this redactor would remove from ``value`` by key name.

        A call's arguments may carry a secret under a secret-looking key; the tool may echo
        it in its result or error text under an innocent key. The engine scrubs these
        strings from that call's outcome as well.
        """
        found: list[str] = []
        self._collect(value, 0, found)
        return found

    def _collect(self, value: Any, depth: int, found: list[str]) -> None:
        if depth >= redaction_depth_max or len(found) >= 1000:
            return
        if type(value) is dict:
            for key, item in value.items():
                if type(key) is str and self.is_secret_key(key):
                    _strings(item, depth + 1, found)
                else:
                    self._collect(item, depth + 1, found)
        elif type(value) is list or type(value) is tuple:
            for item in value:
                self._collect(item, depth + 1, found)

    def _walk(self, value: Any, depth: int) -> Any:
        kind = type(value)
        if kind is str:
            return self.redact_text(value)
        if kind is dict:
            if depth >= redaction_depth_max:
                return REDACTED
            if is_secret_ref(value) or is_sealed(value):
                return value  # A reference names a secret; an envelope is ciphertext.
            # Unchanged values come back as the same object: callers test identity, not
            # equality (a deep comparison costs as much as the walk). A copy is made at the
            # first change only.
            redacted: dict[Any, Any] | None = None
            for key, item in value.items():
                if item is not None and type(key) is str and self.is_secret_key(key):
                    after = REDACTED
                elif type(item) is str:
                    after = self.redact_text(item)
                else:
                    after = self._walk(item, depth + 1)
                if after is not item:
                    if redacted is None:
                        redacted = dict(value)
                    redacted[key] = after
            return value if redacted is None else redacted
        if kind is list or kind is tuple:
            if depth >= redaction_depth_max:
                return REDACTED
            items = [self._walk(item, depth + 1) for item in value]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        return value


TriggerCheck = Callable[[str], bool]
"""``check(text)``: whether a format's triggers occur (in the lower-cased text unless the
format is ``exact``; None: always search)."""


class _Format(NamedTuple):
    """A credential format as :meth:`DefaultRedactor.redact_text` runs it."""

    regex: re.Pattern[str]
    replacement: str
    groups: tuple[int, ...]
    """Masks over the redactor's gate characters: each must meet the text's."""
    check: TriggerCheck | None
    exact: bool


def _trigger_check(pattern: CredentialPattern) -> TriggerCheck | None:
    """The quick test that decides whether ``pattern`` is searched at all."""
    if not pattern.triggers:
        return None
    triggers = pattern.triggers
    if pattern.exact and len(triggers) > 1 and len({t[0] for t in triggers}) == 1:
        # Triggers sharing their first character (the eleven AWS prefixes, the GitHub
        # ones): one scan, in which the regex engine skips to that character.
        candidates = re.compile("|".join(re.escape(t) for t in triggers))
        return lambda text: candidates.search(text) is not None
    if len(triggers) == 1:
        trigger = triggers[0]
        return lambda text: trigger in text
    return lambda text: any(trigger in text for trigger in triggers)


def _strings(value: Any, depth: int, found: list[str]) -> None:
    if type(value) is str:
        found.append(value)
    elif depth < redaction_depth_max and type(value) is dict:
        for item in value.values():
            _strings(item, depth + 1, found)
    elif depth < redaction_depth_max and (type(value) is list or type(value) is tuple):
        for item in value:
            _strings(item, depth + 1, found)


def secrets_in(redactor: Redactor, value: Any) -> tuple[str, ...]:
    """The strings ``redactor`` removes from ``value`` by key name (none for other hooks)."""
    if isinstance(redactor, DefaultRedactor):
        return tuple(redactor.secrets_in(value))
    return ()


default_redactor: Final = DefaultRedactor()
"""The engine's default redactor."""


def no_redaction(value: Any) -> Any:
    """The identity: store values exactly as given (``connect(redactor=None)``)."""
    return value


def redact_text(redactor: Redactor, text: str) -> str:
    """Redact free text (an error message, a log field) with ``redactor``."""
    if redactor is no_redaction:
        return text
    if isinstance(redactor, DefaultRedactor):
        return redactor.redact_text(text)
    redacted = redactor(text)
    return redacted if isinstance(redacted, str) else REDACTED


# ------------------------------------------------------------------------------- events

_USER_FIELDS: Final[dict[type[ev.Event], tuple[str, ...]]] = {
    ev.TaskSubmitted: ("input",),
    ev.StepCheckpointed: ("next_action",),
    ev.TaskCompleted: ("output",),
    ev.TaskFailed: ("error", "diagnostic"),
    ev.TaskCancelled: ("reason",),
    ev.ToolCallIntended: ("args",),
    ev.ToolCallCompleted: ("result",),
    ev.ToolCallFailed: ("error",),
    ev.LlmCallIntended: ("request",),
    ev.LlmCallCompleted: ("response",),
    ev.LlmCallFailed: ("error",),
    ev.MessageAppended: ("content",),
    ev.SignalReceived: ("payload",),
    ev.ApprovalDecided: ("comment",),
    ev.ValueRecorded: ("value",),
    ev.EnvironmentSet: ("values",),
}
"""The fields of each event type that hold values from outside the engine."""


def check_size(value: Any, bytes_max: int | None, counted: int = 0) -> int:
    """Raise :class:`~wal_engine.errors.PayloadTooLarge` if ``value`` cannot fit in
    ``bytes_max`` encoded bytes; return the bytes counted (plus ``counted``).

    The count is a lower bound of the encoded size (every character of a string or key
    takes at least one byte, every other leaf at least one), taken in one walk without a
    regex or an encoding: it runs before redaction, so that an oversized value is refused
    before any pattern has looked at it. None: no bound.
    """
    if bytes_max is None:
        return counted
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str or kind is bytes:
            counted += len(item)
        elif kind is dict:
            counted += sum(len(key) if type(key) is str else 1 for key in item)
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            counted += 1
            stack.extend(item)
        else:
            counted += 1
        if counted > bytes_max:
            raise PayloadTooLarge(counted, bytes_max)
    return counted


def redact_bounded(redactor: Redactor, value: Any, bytes_max: int | None) -> Any:
    """``redactor(value)``, refused with PayloadTooLarge first if ``value`` is too large."""
    check_size(value, bytes_max)
    return redactor(value)


def redact_event(event: ev.Event, redactor: Redactor, *,
                 bytes_max: int | None = None) -> ev.Event:
    """The event with its user-supplied fields redacted (the same object if none changed).

    With ``bytes_max`` (the engine's payload limit), an event whose user fields cannot fit
    in it is refused (:class:`~wal_engine.errors.PayloadTooLarge`) before any redaction.
    """
    if redactor is no_redaction:
        return event
    if bytes_max is not None:
        counted = 0
        for name in _USER_FIELDS.get(type(event), ()):
            counted = check_size(getattr(event, name), bytes_max, counted)
        if isinstance(event, ev.PlanUpdated):
            check_size([node.action for node in event.nodes], bytes_max)
    if isinstance(event, ev.PlanUpdated):
        nodes = [msgspec.structs.replace(node, action=redactor(node.action))
                 for node in event.nodes]
        return event if nodes == event.nodes else msgspec.structs.replace(event, nodes=nodes)
    fields = _USER_FIELDS.get(type(event))
    if fields is None:
        return event
    changes = {}
    for name in fields:
        before = getattr(event, name)
        if before is None:
            continue
        after = redactor(before)
        if type(before) is str and type(after) is not str:
            after = REDACTED  # A text field stays text whatever the hook returns.
        if after is not before and after != before:
            changes[name] = after
    return msgspec.structs.replace(event, **changes) if changes else event


# ------------------------------------------------------------------------------- references


class SecretUnavailable(WalError):
    """A secret reference could not be resolved (no resolver, or the resolver failed)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"secret {name!r} is unavailable: {reason}")
        self.name = name
        self.reason = reason


def environment_secrets(prefix: str = "") -> SecretResolver:
    """A resolver reading secret ``name`` from the environment variable ``prefix + name``."""

    def resolve(name: str) -> str:
        value = os.environ.get(prefix + name)
        if value is None:
            raise SecretUnavailable(name, f"environment variable {prefix + name} is not set")
        return value

    return resolve


def mapping_secrets(values: Mapping[str, str]) -> SecretResolver:
    """A resolver over a fixed mapping (tests, or secrets loaded once at start-up)."""

    def resolve(name: str) -> str:
        try:
            return values[name]
        except KeyError:
            raise SecretUnavailable(name, "no such secret") from None

    return resolve


def has_secret_refs(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds a secret reference anywhere (cheap test before resolving)."""
    kind = type(value)
    if kind is dict:
        return is_secret_ref(value) or (depth < redaction_depth_max and any(
            has_secret_refs(item, depth + 1) for item in value.values()))
    if kind is list or kind is tuple:
        return depth < redaction_depth_max and any(
            has_secret_refs(item, depth + 1) for item in value)
    return False


async def resolve_secret_refs(
    value: Any, resolver: SecretResolver | None
) -> tuple[Any, tuple[str, ...]]:
    """``value`` with each reference replaced by its secret, and the secrets used.

    Raises :class:`SecretUnavailable` when a reference cannot be resolved.
    """
    if not has_secret_refs(value):
        return value, ()
    used: list[str] = []

    async def walk(item: Any, depth: int) -> Any:
        if is_secret_ref(item):
            name = item[SECRET_REF_KEY]
            if resolver is None:
                raise SecretUnavailable(name, "no secret resolver was given to connect()")
            try:
                secret = resolver(name)
                if inspect.isawaitable(secret):
                    secret = await secret
            except SecretUnavailable:
                raise
            except Exception as error:
                raise SecretUnavailable(name, type(error).__name__) from None
            if not isinstance(secret, str):
                raise SecretUnavailable(name, "the resolver did not return a string")
            used.append(secret)
            return secret
        if depth >= redaction_depth_max:
            return item
        if type(item) is dict:
            return {key: await walk(sub, depth + 1) for key, sub in item.items()}
        if type(item) is list or type(item) is tuple:
            return [await walk(sub, depth + 1) for sub in item]
        return item

    return await walk(value, 0), tuple(used)


def scrub_values(value: Any, secrets: Iterable[str], depth: int = 0) -> Any:
    """``value`` with every occurrence of the given secret strings replaced.

    Used on a call's result and error text, for the secrets resolved for that call: a
    tool that echoes its credentials back does not get them into the log.
    """
    needles = sorted({s for s in secrets if len(s) >= known_secret_length_min},
                     key=len, reverse=True)
    if not needles:
        return value
    return _scrub(value, needles, depth)


def _scrub(value: Any, needles: list[str], depth: int) -> Any:
    kind = type(value)
    if kind is str:
        for needle in needles:
            if needle in value:
                value = value.replace(needle, "[REDACTED:secret_ref]")
        return value
    if depth >= redaction_depth_max:
        return value
    if kind is dict:
        return {key: _scrub(item, needles, depth + 1) for key, item in value.items()}
    if kind is list or kind is tuple:
        return [_scrub(item, needles, depth + 1) for item in value]
    return value


def structlog_processor(redactor: Redactor = default_redactor) -> Callable[..., Any]:
    """A structlog processor that redacts every string field of a log event.

    The library never configures logging; an application adds this to its own processor
    chain (before the renderer) to keep credentials out of its logs as well.
    """

    def process(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        secret_key = redactor.is_secret_key if isinstance(redactor, DefaultRedactor) else None
        redacted: dict[str, Any] = {}
        for key, value in event_dict.items():
            if secret_key is not None and secret_key(key):
                redacted[key] = REDACTED
            elif isinstance(value, str):
                redacted[key] = redact_text(redactor, value)
            else:
                redacted[key] = value
        return redacted

    return process
