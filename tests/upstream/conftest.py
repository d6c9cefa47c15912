"""The deep tier switch for the upstream suites (as tests/fault/conftest.py has it)."""

from __future__ import annotations

import os

import pytest


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``deep`` run only with RELIABILITY_DEEP=1 (the whole suites take hours)."""
    if item.get_closest_marker("deep") is not None and os.environ.get("RELIABILITY_DEEP") != "1":
        pytest.skip("deep test: set RELIABILITY_DEEP=1 to run it")
