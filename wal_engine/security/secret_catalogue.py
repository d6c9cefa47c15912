"""A maintained catalogue of secret formats to measure the default redactor against.

Yelp's ``detect-secrets`` (the ``catalogue`` extra) keeps regex detectors for the formats of
many vendors, used here as a library: :func:`catalogue_findings` runs its regex detectors
over a text, and :func:`missed_by` lists what they find that a redactor leaves in place. The
tests run it over the battery of formats and evasions (RELIABILITY.md S14), so a format the
catalogue learns and our own formats lack shows up as a failing test after an upgrade.

The detectors are not run on the write path: several of their regexes backtrack on hostile
text (the OpenAI one takes time quadratic in a run of ``"sk-"``), and redaction must stay
linear (B10). :mod:`wal_engine.security.secret_formats` holds linear formats for what they cover.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Final

NOT_SECRETS: Final = frozenset({"Public IP (ipv4)"})
"""Detector types that find something other than a credential."""


def catalogue_available() -> bool:
    """Whether ``detect-secrets`` is installed (``pip install 'wal-engine[catalogue]'``)."""
    try:
        importlib.import_module("detect_secrets")
    except ImportError:
        return False
    return True


def catalogue_detectors() -> dict[str, Any]:
    """The catalogue's regex detectors by secret type (raises ImportError without it)."""
    util = importlib.import_module("detect_secrets.core.plugins.util")
    base = importlib.import_module("detect_secrets.plugins.base")
    mapping = util.get_mapping_from_secret_type_to_class()
    return {kind: plugin() for kind, plugin in sorted(mapping.items())
            if issubclass(plugin, base.RegexBasedDetector) and kind not in NOT_SECRETS}


def catalogue_findings(text: str, detectors: dict[str, Any] | None = None
                       ) -> list[tuple[str, str]]:
    """``(secret type, value)`` for every secret the catalogue finds in ``text``."""
    chosen = catalogue_detectors() if detectors is None else detectors
    return [(kind, value) for kind, detector in chosen.items()
            for value in detector.analyze_string(text)]


def missed_by(redact: Callable[[str], str], texts: Iterable[str]) -> list[tuple[str, str]]:
    """What the catalogue finds in ``texts`` that is still in ``redact(text)``."""
    detectors = catalogue_detectors()
    missed = []
    for text in texts:
        redacted = redact(text)
        missed += [(kind, value) for kind, value in catalogue_findings(text, detectors)
                   if value in redacted]
    return missed
