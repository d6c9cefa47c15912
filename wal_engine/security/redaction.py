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
(:mod:`wal_engine.security.encryption`) where the log must hold sensitive data.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

try:  # The `re2` extra: one linear-time pass finds which formats' triggers a text holds.
    import re2 as _re2
except ImportError:  # pragma: no cover - the character gates below are the fallback
    _re2 = None

import msgspec

from wal_engine import events as ev
from wal_engine.errors import PayloadTooLarge
from wal_engine.errors import SecretUnavailable as SecretUnavailable
from wal_engine.security.encryption import ENVELOPE_VERSION, SEALED_KEY
from wal_engine.security.secret_formats import DEFAULT_PATTERNS, CredentialPattern
from wal_engine.security.secret_keys import SECRET_KEY_NAMES as SECRET_KEY_NAMES
from wal_engine.security.secret_keys import SECRET_KEY_SUFFIXES as SECRET_KEY_SUFFIXES
from wal_engine.security.secret_keys import KeyRules
from wal_engine.security.secret_keys import normalise_key as normalise_key

Redactor = Callable[[Any], Any]
"""A deterministic function from a plain JSON value to the plain JSON value to store."""

SecretResolver = Callable[[str], str | Awaitable[str]]
"""Returns the value of the named secret (sync or async); raises if it has none."""

REDACTED: Final = "[REDACTED]"
SECRET_REF_KEY: Final = "$secret"
redaction_depth_max: Final = 256
"""Deeper values are replaced whole (payloads are refused beyond 64 levels anyway)."""
trigger_set_memory_bytes: Final = 64 * 1024 * 1024
"""google-re2's memory budget for the trigger set (its DFA)."""
gated_cache_max: Final = 4096
"""Distinct sets of gate characters whose matching formats a redactor remembers."""
known_secret_length_min: Final = 4
"""Resolved secret values shorter than this are not scrubbed from results (too many false
matches); such a value is not a secret worth the name."""


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
        multi_pattern: bool | None = None,
    ) -> None:
        """Build a redactor from the default rules and these changes.

        Args:
            extra_keys: More key names whose values are always redacted.
            keep_keys: Key names never redacted by name (their strings still are by pattern).
            extra_patterns: More credential formats, after the default ones.
            patterns: Replace the default formats altogether.
            multi_pattern: Find the formats a text may hold in one pass of google-re2's
                ``Set`` (the ``re2`` extra) instead of the character gates and a scan per
                format: a 1 KB string in about 2 us instead of about 6. None: when
                google-re2 is installed and every format has triggers.
        """
        self.keys = KeyRules(extra_keys, keep_keys)
        chosen = (*(DEFAULT_PATTERNS if patterns is None else patterns), *extra_patterns)
        # Every character some format requires gets a bit; a format's groups become masks,
        # so that its gate is a few integer ANDs once the text's characters are known.
        gate_chars = sorted({c for p in chosen for group in p.requires for c in group}
                            | set(_ASSIGNMENT_GATE))
        bits = {c: 1 << index for index, c in enumerate(gate_chars)}
        self._gate_bits = tuple(bits.items())
        self._assignment_mask = sum(bits[c] for c in _ASSIGNMENT_GATE)
        self._gated: dict[int, tuple[_Format, ...]] = {}
        """The formats whose gates pass, by the set of gate characters a text holds."""
        self.patterns = tuple(
            _Format(re.compile(p.regex), p.replacement,
                    tuple(sum(bits[c] for c in set(group)) for group in p.requires),
                    _trigger_check(p), p.exact)
            for p in chosen)
        self._key_texts: dict[str, str] = {}
        usable = _re2 is not None and all(p.triggers for p in chosen)
        self._triggers = _TriggerSet(chosen, self.keys.triggers) if (
            usable if multi_pattern is None else multi_pattern and usable) else None

    def __call__(self, value: Any) -> Any:
        """The value with secrets replaced; ``value`` itself is never changed, and is
        returned as is when nothing in it was redacted."""
        return self._walk(value, 0)

    def is_secret_key(self, key: str) -> bool:
        """Whether the value under ``key`` is redacted whole."""
        return self.keys.is_secret(key)

    def redact_text(self, text: str) -> str:
        """``text`` with every credential-looking substring replaced."""
        if len(text) < 8:
            return text
        if self._triggers is not None:
            return self._redact_by_triggers(text)
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
        if present & self._assignment_mask:
            if lowered is None:
                lowered = text.lower()
            if self.keys.may_assign(lowered):
                redacted = self.keys.redact_assignments(redacted)
        return redacted

    def _redact_by_triggers(self, text: str) -> str:
        """:meth:`redact_text` with the formats chosen by one pass over ``text`` (the
        triggers looked at in the original text, as the scans per format do)."""
        assert self._triggers is not None
        formats, assignments = self._triggers.present(text)
        redacted = text
        for index in formats:
            regex, replacement, _groups, _check, _exact = self.patterns[index]
            redacted = regex.sub(replacement, redacted)
        if assignments and any(char in text for char in _ASSIGNMENT_GATE):
            redacted = self.keys.redact_assignments(redacted)
        return redacted

    def redact_key(self, key: str) -> str:
        """A dict key as stored: a credential used as a key is replaced like any text."""
        if len(key) < 8:
            return key
        known = self._key_texts.get(key)
        if known is None:
            known = self.redact_text(key)
            if len(self._key_texts) < 10_000:
                self._key_texts[key] = known
        return known

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
            if is_secret_ref(value) or is_envelope(value):
                return value  # A reference names a secret; an envelope is ciphertext.
            return self._walk_dict(value, depth)
        if kind is list or kind is tuple:
            if depth >= redaction_depth_max:
                return REDACTED
            if (len(value) == 2 and type(value[0]) is str and value[1] is not None
                    and self.keys.is_secret(value[0])):
                return [value[0], REDACTED]  # A header list: [["X-Api-Key", "..."], ...]
            items = [self._walk(item, depth + 1) for item in value]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        return value

    def _walk_dict(self, value: dict[Any, Any], depth: int) -> dict[Any, Any]:
        # Unchanged values come back as the same object: callers test identity, not
        # equality (a deep comparison costs as much as the walk). A copy is made at the
        # first change only.
        redacted: dict[Any, Any] | None = None
        named = _named_value(value, self.keys)
        for key, item in value.items():
            if type(key) is not str:
                after, new_key = self._walk(item, depth + 1), key
            else:
                new_key = self.redact_key(key)
                if item is not None and (self.keys.is_secret(key) or (named and key == "value")):
                    after = REDACTED
                elif type(item) is str:
                    after = self.redact_text(item)
                else:
                    after = self._walk(item, depth + 1)
            if after is not item or new_key is not key:
                if redacted is None:
                    redacted = dict(value)
                if new_key is not key:
                    redacted.pop(key, None)
                    # Two keys that redact alike would collide: mark the later ones.
                    while new_key in redacted:
                        new_key += "'"
                redacted[new_key] = after
        return value if redacted is None else redacted


_ASSIGNMENT_GATE: Final = ":=%"
"""A secret assignment in text holds one of these (``password=...``, ``token: ...``,
``token%3D...``)."""

_NAME_FIELDS: Final = ("name", "key", "header", "field")


def _named_value(value: dict[Any, Any], keys: KeyRules) -> bool:
    """Whether ``value`` is a name/value pair naming a secret (``{"name": "Authorization",
    "value": "..."}``, as in HAR files and many HTTP clients' header lists)."""
    if "value" not in value:
        return False
    return any(type(value.get(field)) is str and keys.is_secret(value[field])
               for field in _NAME_FIELDS)


_ENVELOPE_KEYS: Final = frozenset({SEALED_KEY, "tenant", "key_version", "ct"})
_base64: Final = re.compile(r"(?:[A-Za-z0-9+/]{4})*+(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
envelope_ciphertext_bytes_min: Final = 17
"""The shortest ciphertext of an envelope: the AEAD's 16-byte tag and a byte of JSON."""


def is_envelope(value: Any) -> bool:
    """Whether ``value`` has exactly the shape of a sealed envelope
    (:meth:`wal_engine.security.encryption.PayloadCipher.seal`): its four keys and no other, a
    tenant, an integer key version, and base64 ciphertext of a possible length.

    Redaction skips envelopes (ciphertext holds nothing to find), so it must not skip a
    look-alike: a value with an extra key, a ``ct`` that is not base64, or a plain text
    dressed up as one is redacted like any other."""
    if type(value) is not dict or value.keys() != _ENVELOPE_KEYS:
        return False
    ct, tenant, version = value["ct"], value["tenant"], value["key_version"]
    return (value[SEALED_KEY] == ENVELOPE_VERSION and value[SEALED_KEY] is not True
            and type(ct) is str and type(tenant) is str and bool(tenant)
            and type(version) is int and len(ct) * 3 // 4 >= envelope_ciphertext_bytes_min
            and _base64.fullmatch(ct) is not None)


class _TriggerSet:
    """Every format's triggers (and the key names of secret assignments) in one google-re2
    ``Set``: one linear-time pass over a text says which formats to run."""

    def __init__(self, patterns: Sequence[CredentialPattern], key_triggers: Sequence[str]):
        assert _re2 is not None
        options = _re2.Options()
        # A set matches on RE2's DFA alone, which gives up past its memory budget: ample
        # room here (measured: 2,387 hostile 1 MiB texts matched exactly as the gates do).
        options.max_mem = trigger_set_memory_bytes
        self._set = _re2.Set.SearchSet(options)
        owners: list[int] = []
        for index, pattern in enumerate(patterns):
            for trigger in pattern.triggers:
                # A format that is not exact is triggered in the lower-cased text.
                self._set.Add(("" if pattern.exact else "(?i)") + re.escape(trigger))
                owners.append(index)
        for trigger in key_triggers:
            self._set.Add("(?i)" + re.escape(trigger))
            owners.append(-1)
        self._set.Compile()
        self._owners = tuple(owners)

    def present(self, text: str) -> tuple[list[int], bool]:
        """The indices of the formats whose triggers ``text`` holds (in order), and
        whether it holds the name of a secret assignment."""
        hits = self._set.Match(text)
        if not hits:
            return [], False
        owners = {self._owners[hit] for hit in hits}
        assignments = -1 in owners
        owners.discard(-1)
        return sorted(owners), assignments


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
    if len(triggers) == 1:
        trigger = triggers[0]
        return lambda text: trigger in text
    # Triggers with a common start ("xoxb-", "xoxp-", ...; "hvs.", "hvb.") are tested for
    # that start first: one memchr-speed scan that ordinary text fails.
    # The character-wise common prefix is meant here (these are not paths).
    common = os.path.commonprefix(list(triggers))  # noqa: RUF071
    if pattern.exact and len(common) == 1:
        # Triggers sharing only their first character (the AWS prefixes): one scan, in
        # which the regex engine skips to that character.
        candidates = re.compile("|".join(re.escape(t) for t in triggers))
        return lambda text: candidates.search(text) is not None

    def check(text: str) -> bool:
        if common and common not in text:
            return False
        for trigger in triggers:
            if trigger in text:
                return True
        return False

    return check


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
    ev.TaskCancelled: ("reason", "requested_by"),
    ev.ToolCallIntended: ("args",),
    ev.ApprovalRequested: ("args",),
    ev.ToolCallCompleted: ("result",),
    ev.ToolCallFailed: ("error",),
    ev.LlmCallIntended: ("request",),
    ev.LlmCallCompleted: ("response",),
    ev.LlmCallFailed: ("error",),
    ev.MessageAppended: ("content",),
    ev.SignalReceived: ("payload",),
    ev.ApprovalDecided: ("approver", "comment"),
    ev.ValueRecorded: ("value",),
    ev.EnvironmentSet: ("values",),
}
"""The fields of each event type that hold values from outside the engine."""

_EVENT_NAMES: Final[dict[type[ev.Event], tuple[str, ...]]] = {
    ev.ToolCallIntended: ("tool",),
    ev.LlmCallIntended: ("model",),
    ev.SignalAwaited: ("name",),
    ev.SignalReceived: ("name",),
    ev.MessageAppended: ("name",),
    ev.ApprovalRequested: ("tool",),
    ev.ValueRecorded: ("kind",),
}
"""The names agent code gives that the journal matches on replay (a tool's, a model's, the
signal a task waits for, a message's, an approval's). They are stored redacted as text, and
the journal compares a recorded name with the redacted form of the name the code asks for
(:class:`NameForms`), so that both sides meet."""

name_forms_cached_max: Final = 1024
"""Distinct names a :class:`NameForms` remembers (a task's code names few)."""
name_cached_length_max: Final = 1024
"""Longer names are redacted each time rather than remembered."""


class NameForms:
    """A name as the log records it (redacted as text with ``redactor``), remembered per
    name: the journal and the event builders ask for the same few names on every call, so
    after the first time a name costs one dictionary lookup."""

    __slots__ = ("_forms", "redactor")

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor
        self._forms: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        form = self._forms.get(name)
        if form is None:
            form = name if self.redactor is no_redaction else redact_text(self.redactor, name)
            if len(self._forms) < name_forms_cached_max and len(name) <= name_cached_length_max:
                self._forms[name] = form
        return form


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


def user_bytes(event: ev.Event, bytes_max: int | None) -> int:
    """A lower bound of the encoded size of ``event``'s user-supplied fields (the fields
    :func:`redact_event` redacts); PayloadTooLarge past ``bytes_max``. One walk, no regex:
    how the runtime decides that a value is large enough to be redacted off the event
    loop (decision 61)."""
    counted = 0
    for name in _USER_FIELDS.get(type(event), ()):
        counted = check_size(getattr(event, name), bytes_max, counted)
    return counted


def redact_bounded(redactor: Redactor, value: Any, bytes_max: int | None) -> Any:
    """``redactor(value)``, refused with PayloadTooLarge first if ``value`` is too large."""
    check_size(value, bytes_max)
    return redactor(value)


def redact_event(event: ev.Event, redactor: Redactor, *,
                 bytes_max: int | None = None,
                 names: Callable[[str], str] | None = None) -> ev.Event:
    """The event with its user-supplied fields and its names redacted (the same object if
    none changed).

    With ``bytes_max`` (the engine's payload limit), an event whose user fields cannot fit
    in it is refused (:class:`~wal_engine.errors.PayloadTooLarge`) before any redaction.
    ``names`` gives a name's redacted form (a run's :class:`NameForms`, which remembers
    them); by default the name is redacted as text with ``redactor``.
    """
    if redactor is no_redaction:
        return event
    named = _EVENT_NAMES.get(type(event))
    if named is not None:
        event = _redact_names(event, named, redactor, names)
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


def _redact_names(event: ev.Event, fields: tuple[str, ...], redactor: Redactor,
                  names: Callable[[str], str] | None) -> ev.Event:
    changes = {}
    for field in fields:
        name = getattr(event, field)
        if name is None:
            continue
        form = names(name) if names is not None else redact_text(redactor, name)
        if form != name:
            changes[field] = form
    return msgspec.structs.replace(event, **changes) if changes else event


# ------------------------------------------------------------------------------- references


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
    if not secrets:
        return value  # The call resolved no secret (nearly every call): nothing to look for.
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
