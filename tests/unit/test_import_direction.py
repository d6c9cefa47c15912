"""Imports point down: the pure layers never load the I/O side."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["replay", "wal_engine", "wal_engine.events", "wal_engine.chain", "wal_engine.payloads"],
)
def test_pure_modules_do_not_load_asyncpg(module: str) -> None:
    """Importing a pure module loads neither asyncpg nor structlog nor the store."""
    code = (
        f"import sys, {module}; "
        "bad = [m for m in ('asyncpg', 'structlog', 'wal_engine.store') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
