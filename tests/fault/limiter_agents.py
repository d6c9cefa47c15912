"""The agent of the limiter fault tests (``python -m wal_engine.testing.worker DSN ID
tests.fault.limiter_agents:register``): LLM calls under one limiter, each start written to
a ledger file (path in ``LIMITER_LEDGER``) with the worker's pid."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Final

from wal_engine.engine import Engine
from wal_engine.runtime.context import LlmResponse

AGENT: Final = "limited"
LIMITER: Final = "fake:llm"
REGISTER: Final = "tests.fault.limiter_agents:register"
LEDGER_ENV: Final = "LIMITER_LEDGER"
CALLS: Final = 2
CALL_S: Final = 0.2
"""How long a call lasts: long enough for a test to kill its worker in the middle."""


async def fake_llm(request: Any) -> LlmResponse:
    """Write the start to the ledger (one append, one line), then answer after CALL_S."""
    line = f"{time.time():.6f} {os.getpid()} {request}\n".encode()
    descriptor = os.open(os.environ[LEDGER_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)
    await asyncio.sleep(CALL_S)
    return LlmResponse(content=request, input_tokens=10, output_tokens=5)


def register(engine: Engine) -> None:
    """Register ``limited``: CALLS LLM calls under LIMITER."""

    @engine.agent(AGENT)
    async def limited(ctx: Any, n: int) -> int:
        for i in range(CALLS):
            await ctx.llm("fake", fake_llm, f"{n}-{i}", limiter=LIMITER, estimate_tokens=15)
        return n
