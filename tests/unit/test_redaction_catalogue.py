"""The default redactor measured against a maintained catalogue (detect-secrets' regex
detectors, the ``catalogue`` extra): nothing the catalogue finds in the battery survives."""

from __future__ import annotations

import pytest

from tests.secret_samples import EVASIONS, FORMATS
from wal_engine.security.redaction import DefaultRedactor
from wal_engine.security.secret_catalogue import catalogue_available, catalogue_findings, missed_by

pytestmark = pytest.mark.skipif(not catalogue_available(),
                                reason="detect-secrets (the catalogue extra) is not installed")


def test_the_catalogue_finds_secrets_in_the_battery() -> None:
    """Control: the catalogue's detectors do find secrets in the battery's texts."""
    texts = [text for _, text in FORMATS.values()]
    assert sum(len(catalogue_findings(text)) for text in texts) >= 15


def test_nothing_the_catalogue_finds_survives_redaction() -> None:
    """Every value a catalogue detector finds in a battery text is gone once redacted."""
    texts = [text for _, text in {**FORMATS, **EVASIONS}.values()]
    assert missed_by(DefaultRedactor().redact_text, texts) == []


def test_the_measure_sees_a_redactor_that_misses() -> None:
    """Control: a redactor that changes nothing misses what the catalogue finds."""
    texts = [FORMATS["github_classic"][1], FORMATS["aws_access_key_id"][1]]
    assert missed_by(lambda text: text, texts) != []
