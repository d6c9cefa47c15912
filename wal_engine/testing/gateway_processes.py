"""Processes for gateway tests and benchmarks: the counting upstream and ``wal-engine
gateway`` itself.

Both are real subprocesses on ports of their own; :class:`GatewayProcess` can be SIGKILLed
and restarted on the same port and configuration.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

import httpx

from wal_engine.testing.redis_server import free_port

start_timeout_s: Final = 30.0


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(config: dict[str, Any]) -> str:
    """The gateway config as TOML (tables, and arrays of tables for routes)."""
    lines: list[str] = []
    for table, content in config.items():
        entries = content if isinstance(content, list) else [content]
        for entry in entries:
            lines.append(f"[[{table}]]" if isinstance(content, list) else f"[{table}]")
            lines += [f"{name} = {_toml_value(value)}" for name, value in entry.items()]
            lines.append("")
    return "\n".join(lines)


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + start_timeout_s
    while True:
        if process.poll() is not None:
            raise AssertionError(f"{what} exited {process.returncode}: {log.read_text()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not answer in {start_timeout_s} s: "
                                 f"{log.read_text()}")
        time.sleep(0.05)


class Upstream:
    """The counting upstream API in a subprocess."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"upstream-{self.port}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "wal_engine.testing.upstream", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT)
        _wait_http(f"{self.url}/_counts", self.process, self.log, "the upstream")

    def counters(self) -> dict[str, dict[str, int]]:
        """``{"counts": {key: n}, "received": {key: n}}``."""
        counters: dict[str, dict[str, int]] = httpx.get(f"{self.url}/_counts", timeout=5).json()
        return counters

    def count(self, key: str) -> int:
        """Finished mutations under the header value ``key``."""
        return self.counters()["counts"].get(key, 0)

    def close(self) -> None:
        """Kill the upstream."""
        self.process.kill()
        self.process.wait(timeout=30)


def route(name: str, upstream: Upstream, **options: Any) -> dict[str, Any]:
    """A ``[[routes]]`` entry for ``/name`` in front of ``upstream``."""
    return {"name": name, "prefix": f"/{name}", "upstream": upstream.url, **options}


class GatewayProcess:
    """``python -m wal_engine.cli gateway --config FILE`` on a port of its own."""

    def __init__(self, store: dict[str, Any], routes: list[dict[str, Any]], log_dir: Path,
                 **gateway: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = log_dir / f"gateway-{self.port}.toml"
        self.config_path.write_text(to_toml({
            "gateway": {"listen": f"127.0.0.1:{self.port}", **gateway}, "store": store,
            "routes": routes}))
        self.log = log_dir / f"gateway-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> GatewayProcess:
        """Start and wait until its health endpoint answers 200."""
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "wal_engine.cli", "gateway", "--config",
                 str(self.config_path)], stdout=out, stderr=subprocess.STDOUT)
        _wait_http(f"{self.url}/_gateway/health", self.process, self.log, "the gateway")
        return self

    def kill(self) -> None:
        """SIGKILL (no drain, no cleanup)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def restart(self) -> GatewayProcess:
        """SIGKILL, then start again on the same port."""
        self.kill()
        return self.start()

    def close(self) -> None:
        """Kill the gateway."""
        self.kill()
