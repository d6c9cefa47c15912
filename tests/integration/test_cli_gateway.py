"""``wal-engine gateway --check``: a good file is summarised, a bad one is one error line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gateway_support import to_toml

GOOD = {"store": {"kind": "redis", "url": "redis://127.0.0.1:1/0"},
        "routes": [{"name": "pay", "prefix": "/pay", "upstream": "http://127.0.0.1:1"}]}


def gateway_check(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``wal-engine gateway --config PATH --check``."""
    return subprocess.run([sys.executable, "-m", "wal_engine.cli", "gateway", "--config",
                           str(path), "--check", *extra], capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_good_file_is_summarised(tmp_path: Path) -> None:
    """The check names the routes and the store and exits 0 without serving."""
    path = tmp_path / "gateway.toml"
    path.write_text(to_toml(GOOD))
    result = gateway_check(path, "--listen", "127.0.0.1:9999")
    assert result.returncode == 0, result.stderr
    assert "1 route(s), redis store" in result.stdout


def test_a_bad_file_is_one_error_line(tmp_path: Path) -> None:
    """A route whose lease is shorter than its timeout, or a bad --listen, is refused on one
    line naming the problem, with no traceback."""
    path = tmp_path / "gateway.toml"
    path.write_text(to_toml({**GOOD, "routes": [{**GOOD["routes"][0], "lease_s": 1.0}]}))
    result = gateway_check(path)
    assert result.returncode != 0
    assert result.stderr.startswith("error: gateway config") and "lease_s" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    path.write_text(to_toml(GOOD))
    listen = gateway_check(path, "--listen", "nowhere")
    assert listen.returncode != 0 and "HOST:PORT" in listen.stderr
