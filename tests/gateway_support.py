"""The gateway test processes (they live in :mod:`wal_engine.testing.gateway_processes`,
shared with the benchmark), and the repository root the worker subprocesses run in."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from wal_engine.testing.gateway_processes import GatewayProcess, Upstream, route, to_toml

REPO: Final = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "GatewayProcess", "Upstream", "route", "to_toml"]
