"""S14 at the redactor: 60+ real secret formats and 20+ evasions (case, separators, quoting,
JSON nesting and escaping, URL encoding, line breaks, header lists, dict keys, envelope
look-alikes) never survive redaction, while prose and look-alike keys do."""

from __future__ import annotations

from typing import Any

import pytest

from tests.secret_samples import EVASIONS, FORMATS, STRUCTURED_EVASIONS
from wal_engine.security.redaction import REDACTED, DefaultRedactor, is_envelope

REDACTOR = DefaultRedactor()


def test_the_battery_is_as_large_as_promised() -> None:
    """At least 60 formats and 15 evasions are checked (RELIABILITY.md S14)."""
    assert len(FORMATS) >= 60
    assert len(EVASIONS) + len(STRUCTURED_EVASIONS) >= 15


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_is_redacted_in_text_and_in_json(name: str) -> None:
    """The secret is gone from its text, from that text inside a JSON value, and the
    redaction is idempotent."""
    secret, text = FORMATS[name]
    redacted = REDACTOR.redact_text(text)
    assert secret not in redacted and "[REDACTED" in redacted
    assert REDACTOR.redact_text(redacted) == redacted
    nested = REDACTOR({"result": {"pages": [text]}})
    assert secret not in repr(nested)


@pytest.mark.parametrize("name", sorted(EVASIONS))
def test_each_text_evasion_is_redacted(name: str) -> None:
    """Case, separators, quotes, escaped JSON, URL encoding and line breaks do not hide it."""
    secret, text = EVASIONS[name]
    redacted = REDACTOR.redact_text(text)
    assert secret not in redacted, redacted
    assert REDACTOR.redact_text(redacted) == redacted


@pytest.mark.parametrize("name", sorted(STRUCTURED_EVASIONS))
def test_each_structured_evasion_is_redacted(name: str) -> None:
    """Nested keys in any case, a secret used as a key, header lists, name/value pairs and
    envelope look-alikes do not hide it."""
    secret, value = STRUCTURED_EVASIONS[name]
    redacted = REDACTOR(value)
    assert secret not in repr(redacted), redacted
    assert REDACTOR(redacted) == redacted


@pytest.mark.parametrize("key", ["AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "aws_session_token",
                                 "passphrase", "key", "pass", "pw", "sessionid", "PassWord",
                                 "api-key", "APIKEY", "apiKey", "x_api_key", "X-Auth-Token",
                                 "AccountKey", "client.secret", "Set-Cookie"])
def test_secret_key_names_in_any_case_and_with_any_separators(key: str) -> None:
    """Key names match case- and separator-insensitively, as dict keys and in text."""
    assert REDACTOR({key: "v4lue-xyz"}) == {key: REDACTED}
    assert "v4lue-xyz" not in REDACTOR.redact_text(f"{key}=v4lue-xyz")


@pytest.mark.parametrize("key", ["max_tokens", "next_page_token", "idempotency_key", "monkey",
                                 "keyboard", "passenger", "session_started", "api_key_id",
                                 "token_count", "primary_key"])
def test_look_alike_keys_are_kept(key: str) -> None:
    """Keys that merely contain a secret word are not redacted."""
    assert REDACTOR({key: "kept"}) == {key: "kept"}


@pytest.mark.parametrize("text", [
    "In Asia the key point is basic: a token of thanks, passed on by hand.",
    "The bearer of bad news had a Basic Understanding of the matter.",
    "See https://example.com:8080/a/b?x=1 and mailto:bob@example.com today.",
    "ratio: 3/4, time=12:30, user@example.com, session: started at noon",
    "Error: connection refused (host=db port=5432); retry in 5 s",
])
def test_prose_is_left_alone(text: str) -> None:
    """Ordinary text with triggers, separators and URLs comes back as the same object."""
    assert REDACTOR.redact_text(text) is text


def test_only_real_envelopes_skip_redaction() -> None:
    """A sealed envelope is kept as is; the same shape with an extra key, a text that is
    not base64, a boolean version or a missing tenant is redacted like any value."""
    cryptography = pytest.importorskip("cryptography")
    assert cryptography is not None
    from wal_engine.security.encryption import PayloadCipher

    cipher = PayloadCipher(lambda tenant, version: b"k" * 32)
    envelope: dict[str, Any] = cipher.seal("acme", {"password": "in-the-ciphertext"})
    assert is_envelope(envelope) and REDACTOR(envelope) is envelope
    for changed in ({**envelope, "note": "x"}, {**envelope, "ct": "password=hunter22 x"},
                    {**envelope, "$sealed": True}, {**envelope, "tenant": ""},
                    {**envelope, "key_version": "1"}):
        assert not is_envelope(changed), changed
