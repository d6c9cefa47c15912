"""Which Hypothesis profile the crash machine runs: WAL_ENGINE_CRASH_PROFILE first, then
the test's ``profile=``, then the deep switch, then ``crash-ci``."""

from __future__ import annotations

import pytest

from wal_engine.errors import ConfigurationError
from wal_engine.testing.machine import PROFILES, crash_settings


def test_environment_overrides_an_explicit_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """WAL_ENGINE_CRASH_PROFILE beats profile= (as docs/testing.md says)."""
    monkeypatch.setenv("WAL_ENGINE_CRASH_PROFILE", "crash-quick")
    chosen = crash_settings("crash-ci")
    assert (chosen.max_examples, chosen.stateful_step_count) == PROFILES["crash-quick"]


def test_explicit_profile_without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the variable the explicit profile wins over the deep switch."""
    monkeypatch.delenv("WAL_ENGINE_CRASH_PROFILE", raising=False)
    monkeypatch.setenv("RELIABILITY_DEEP", "1")
    assert crash_settings("crash-quick").max_examples == PROFILES["crash-quick"][0]
    assert crash_settings().max_examples == PROFILES["crash-deep"][0]
    monkeypatch.delenv("RELIABILITY_DEEP")
    assert crash_settings().max_examples == PROFILES["crash-ci"][0]


def test_unknown_profile_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt profile names the built-in ones instead of a Hypothesis traceback."""
    monkeypatch.setenv("WAL_ENGINE_CRASH_PROFILE", "crash-qiuck")
    with pytest.raises(ConfigurationError, match="crash-quick"):
        crash_settings()
