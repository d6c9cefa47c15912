"""The sync client (``wal_engine.sync``) from a real Flask app under waitress, started as
a subprocess: submit, signal, approve, cancel, state, history and wait, each through an
HTTP request served by a request thread of the WSGI server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from wal_engine.engine import Engine
from wal_engine.runtime.context import AgentContext

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
STEP_TIMEOUT_S = 30.0
FAST: dict[str, Any] = {"lease_ttl_ms": 600, "heartbeat_ms": 150, "poll_ms": 50, "sweep_ms": 100}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Web:
    """JSON over HTTP to the app (blocking: call it through asyncio.to_thread)."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        sent = urllib.request.Request(self.base + path, data=data, method=method,
                                      headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(sent, timeout=STEP_TIMEOUT_S + 10) as answer:
            return json.loads(answer.read())


@pytest.fixture
def web(database_dsn: str, tmp_path: Path) -> Iterator[Web]:
    """The Flask app of tests/integration/sync_web_app.py under waitress (4 threads)."""
    port = _free_port()
    log = (tmp_path / "waitress.log").open("w")
    env = {**os.environ, "WEB_APP_DSN": database_dsn, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen(
        [sys.executable, "-m", "waitress", "--listen", f"127.0.0.1:{port}", "--threads", "4",
         "tests.integration.sync_web_app:app"], cwd=REPO, env=env, stdout=log, stderr=log)
    client = Web(port)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.call("GET", "/health")
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None, (tmp_path / "waitress.log").read_text()
                assert time.monotonic() < deadline, "waitress did not answer in time"
                time.sleep(0.1)
        yield client
    finally:
        server.terminate()
        server.wait(30)
        log.close()


@pytest_asyncio.fixture
async def running_worker(engine: Engine) -> AsyncIterator[Engine]:
    """The test's engine with the web agent registered and a worker running it."""
    effects: list[dict[str, Any]] = []

    async def ship(args: dict[str, Any]) -> dict[str, Any]:
        effects.append(args)
        return {"shipped": args["items"]}

    @engine.agent("web-order")
    async def order(ctx: AgentContext, task_input: Any) -> Any:
        address = await ctx.wait_for_signal("address", timeout_s=60)
        receipt = await ctx.tool("ship", ship, {"items": task_input["items"],
                                                "to": address["to"]}, approval=True)
        return {"receipt": receipt, "to": address["to"]}

    worker = engine.worker(concurrency=4, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        yield engine
    finally:
        worker.stop()
        await asyncio.wait_for(running, 30)


async def _until(web: Web, task_id: str, check: Any) -> dict[str, Any]:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        view = await asyncio.to_thread(web.call, "GET", f"/tasks/{task_id}")
        if check(view):
            return dict(view)
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.05)


async def test_a_flask_app_steers_tasks_through_the_sync_client(
        web: Web, running_worker: Engine) -> None:
    """A task submitted over HTTP waits for a signal and an approval sent over HTTP, a
    blocked `wait` request returns its output, its history is read back, and a second task
    is cancelled."""
    call = web.call
    task_id = (await asyncio.to_thread(call, "POST", "/tasks",
                                       {"agent": "web-order", "input": {"items": 3}}))["task_id"]
    await _until(web, task_id, lambda v: v["waiting_signal"] == "address")
    waiting = asyncio.create_task(asyncio.to_thread(call, "GET", f"/tasks/{task_id}/wait"))
    await asyncio.to_thread(call, "POST", f"/tasks/{task_id}/signals/address", {"to": "Oslo"})
    view = await _until(web, task_id, lambda v: v["pending_approvals"])
    (call_id,) = view["pending_approvals"]
    await asyncio.to_thread(call, "POST", f"/tasks/{task_id}/approvals/{call_id}",
                            {"approver": "ops"})
    final = await asyncio.wait_for(waiting, STEP_TIMEOUT_S + 15)
    assert final == {"status": "COMPLETED",
                     "output": {"receipt": {"shipped": 3}, "to": "Oslo"}}
    types = (await asyncio.to_thread(call, "GET", f"/tasks/{task_id}/history"))["types"]
    assert types[0] == "task_submitted" and types[-1] == "task_completed"
    assert any("approv" in t for t in types)
    other = (await asyncio.to_thread(call, "POST", "/tasks",
                                     {"agent": "web-order", "input": {"items": 1}}))["task_id"]
    assert (await asyncio.to_thread(call, "POST", f"/tasks/{other}/cancel"))["cancelled"]
    assert (await _until(web, other, lambda v: v["status"] == "FAILED"))["output"] is None
    assert (await asyncio.to_thread(call, "POST", f"/tasks/{other}/cancel"))[
        "cancelled"] is False
