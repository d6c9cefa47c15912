"""The HTTP tool helper inside ``ctx.tool``: the call's idempotency key goes out as the
``Idempotency-Key`` header, the same on every attempt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway_support import Upstream
from wal_engine.engine import Engine
from wal_engine.gateway.client import HttpToolError, HttpToolRetry, http_tool, idempotent_client
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import AgentContext
from wal_engine.state_machine import Status
from wal_engine.testing import run_worker_until_idle


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[Upstream]:
    """The counting upstream (no gateway: it shows what arrives)."""
    server = Upstream(tmp_path)
    yield server
    server.close()


async def test_tool_requests_carry_the_call_key_on_every_attempt(
        engine: Engine, upstream: Upstream) -> None:
    """http_tool and idempotent_client send ``"idem:<task>:<seq>"``; a retried attempt sends
    the same key; a GET and a request outside a tool send none."""
    attempts: list[int] = []

    @engine.agent("posts")
    async def posts(ctx: AgentContext, task_input: Any) -> Any:
        async def flaky(args: Any) -> Any:
            answer = await http_tool("POST", f"{upstream.url}/charges", json=args)
            attempts.append(1)
            if len(attempts) == 1:
                raise ConnectionError("the answer was lost")  # Transient: retried.
            return answer["body"]["key"]

        async def with_client(args: Any) -> Any:
            async with idempotent_client() as http:
                await http.get(f"{upstream.url}/read")
                return (await http.patch(f"{upstream.url}/p", json=args)).json()["key"]

        first = await ctx.tool("charge", flaky, {"n": 1},
                               retry=RetryPolicy(max_attempts=3, initial_delay_s=0.01))
        return [first, await ctx.tool("patch", with_client, {"n": 2})]

    task_id = await engine.submit("posts")
    await run_worker_until_idle(engine)
    state = await engine.state(task_id)
    assert state.status is Status.COMPLETED, state
    charge_key, patch_key = state.output
    assert charge_key.startswith(f'"idem:{task_id}:') and patch_key != charge_key
    assert upstream.counters()["received"][charge_key] == 2  # One key for both attempts.
    async with idempotent_client() as http:
        outside = (await http.post(f"{upstream.url}/x", content=b"")).json()["key"]
    assert outside == "-"


async def test_error_statuses_are_typed(upstream: Upstream) -> None:
    """A 4xx answer is HttpToolError with the status, a 503 the transient HttpToolRetry;
    never a raw httpx error for a status."""
    with pytest.raises(HttpToolError) as raised:
        await http_tool("POST", f"{upstream.url}/x", headers={"x-status": "404"})
    assert raised.value.status == 404
    with pytest.raises(HttpToolRetry):
        await http_tool("POST", f"{upstream.url}/x", headers={"x-status": "503"})
