"""Every default credential format is found where it hides in text, whether its quick
trigger test runs on the lower-cased text or, for case-sensitive formats, on the text; and
the quick tests (required characters, triggers) never let a match through."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.secret_samples import FORMATS, LOOK_ALIKES
from wal_engine.security.redaction import DEFAULT_PATTERNS, DefaultRedactor

SAMPLES = {name: secret for name, (secret, _text) in FORMATS.items()}


@pytest.mark.parametrize("pattern", DEFAULT_PATTERNS, ids=lambda p: p.kind)
def test_every_default_format_has_a_sample(pattern: object) -> None:
    """Each default format's regex matches at least one text of the battery (none is dead)."""
    regex = re.compile(pattern.regex)  # type: ignore[attr-defined]
    assert any(regex.search(text) for _secret, text in FORMATS.values())


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_is_redacted_inside_prose(name: str) -> None:
    """The secret, put between two lines of prose, does not survive redaction, and the prose
    does (a header value runs to its line's end, a key cut off before its END line to the
    first character no key holds: here the semicolon)."""
    secret, sample = FORMATS[name]
    text = f"the agent saw\n{sample}\n; and went on"
    redacted = DefaultRedactor().redact_text(text)
    assert "[REDACTED" in redacted
    assert secret not in redacted
    assert redacted.startswith("the agent saw\n") and redacted.endswith("; and went on")


def test_prose_without_credentials_is_returned_as_is() -> None:
    """Words that merely contain a trigger (a key, asia, basic, token) change nothing."""
    text = "In Asia the key point is basic: a token of thanks, passed on by hand. " * 20
    assert DefaultRedactor().redact_text(text) is text


@pytest.mark.parametrize("text", LOOK_ALIKES)
def test_look_alikes_of_vendor_prefixes_are_kept(text: str) -> None:
    """A public key (PostHog's phc_), identifiers and placeholders that start like a vendor
    token, and prose naming the prefixes come back as the same object."""
    assert DefaultRedactor().redact_text(text) is text


# Pieces that make every default format, its gates and its triggers likely to meet, in and
# out of order: the texts below hold near-misses as well as real credentials.
_PIECES = [*SAMPLES.values(), *(text for _s, text in FORMATS.values()),
           "Bearer ", "bearer", "token", "Token", "password", "API_KEY",
           "authorization: basic ", "Authorization", ":", "=", " = ", "@", ".", "-", "_", "A",
           "J", "eyJ", "sk-", "ghp_", "https://", "user:pw@", "0", "7", " ", "\n", "abc",
           "XYZ", "AKIA", "xoxb-", "glpat-", "npm_", "pypi-", "-----BEGIN ", "hooks.slack.com",
           "tskey-auth-", "phx_", "CCIPAT_", *LOOK_ALIKES]


# Cheap examples; near-misses need many draws. Pieces come two draws in three, random
# text the third (a mutated gate was found only with that weight).
@settings(max_examples=400)
@given(st.lists(st.one_of(st.sampled_from(_PIECES), st.sampled_from(_PIECES),
                          st.text(max_size=12)), max_size=24))
def test_quick_tests_never_skip_a_match(pieces: list[str]) -> None:
    """The quick tests only save time: with the one-pass trigger set (google-re2) and with
    the character gates alike, every text is redacted exactly as by a redactor that runs
    every regex on every text."""
    text = "".join(pieces)
    expected = _THOROUGH.redact_text(text)
    assert _MULTI_PATTERN.redact_text(text) == expected
    assert _GATES.redact_text(text) == expected


_THOROUGH = DefaultRedactor(patterns=[
    msgspec.structs.replace(p, triggers=(), requires=()) for p in DEFAULT_PATTERNS])
_MULTI_PATTERN = DefaultRedactor()
_GATES = DefaultRedactor(multi_pattern=False)


def test_the_default_redactor_uses_the_one_pass_trigger_set() -> None:
    """With the re2 extra installed (the test extra has it), the fast path is the trigger
    set; without it, the character gates."""
    assert _MULTI_PATTERN._triggers is not None
    assert _GATES._triggers is None
