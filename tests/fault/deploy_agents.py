"""Two versions of one agent for the rolling-deploy test (issue 17), as worker processes load
them (``tests.fault.deploy_agents:register_v1`` / ``:register_v2``).

Version 1::

    prepare -> notify -> checkpoint -> wait (timer or signal) -> charge {n}

Version 2 (``compatible=("1",)``) makes three changes, each behind ``ctx.patched``:

* ``drop-notify``: removes the ``notify`` call (before the wait);
* ``charge-eur``: changes ``charge``'s arguments to ``{n, currency: EUR}`` (after the wait);
* ``add-receipt``: adds a ``receipt`` call (after the wait).

A task that ran its first half on version 1 keeps ``notify`` (its history has it), and takes
the new branches of the changes it reaches on version 2. :func:`register_v2_unpatched` is
version 2 written without the patches (an incompatible change that claims to be compatible):
the deploy gate must refuse it.

Every call goes to an :class:`~wal_engine.testing.ledger.EffectLedger` fake (``notify`` is a
non-deduplicating service: a second delivery is a violation). ``prepare`` can be gated: it
waits, inside the call, until the test raises a flag, so that the test can stop a version 1
worker while it holds tasks in the middle of their run. Version 2's ``on_resume`` hook writes
what it was told into ``deploy_resumes``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Final

from wal_engine.engine import Engine
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import AgentContext, current_call
from wal_engine.runtime.hooks import AgentHooks, HookEvent, HookFunction
from wal_engine.testing.ledger import EffectLedger

AGENT: Final = "deployed"
TOOLS: Final = {"prepare": "idem", "notify": "unsafe", "charge": "idem", "receipt": "idem"}
PATCHES: Final = ("drop-notify", "charge-eur", "add-receipt")
BEFORE_WAIT: Final = ("drop-notify",)
AFTER_WAIT: Final = ("charge-eur", "add-receipt")

TABLES: Final = (
    "CREATE TABLE IF NOT EXISTS deploy_flags (name text PRIMARY KEY)",
    """CREATE TABLE IF NOT EXISTS deploy_resumes (
        task_id text NOT NULL, reason text NOT NULL, task_version text,
        code_version text, new_version boolean NOT NULL, worker_id text)""",
)
INSIDE_GATE: Final = "INSERT INTO deploy_flags VALUES ($1) ON CONFLICT DO NOTHING"
FLAG_SET: Final = "SELECT 1 FROM deploy_flags WHERE name = $1"
OPEN_GATE: Final = "open-gate"
RESUMED: Final = "INSERT INTO deploy_resumes VALUES ($1, $2, $3, $4, $5, $6)"
QUICK: Final = RetryPolicy(max_attempts=3, initial_delay_s=0.01)


class Services:
    """The fakes both versions call (one set per engine)."""

    def __init__(self, engine: Engine) -> None:
        ledger = EffectLedger.for_engine(engine)
        database = engine.database
        self.prepare_now = ledger.service("prepare", kind="idem",
                                          result=lambda a: {"prepared": a["n"]})
        self.notify = ledger.service("notify", kind="unsafe", result=lambda a: {"sent": a["n"]})
        self.charge = ledger.service(
            "charge", kind="idem",
            result=lambda a: {"charged": a["n"], "currency": a.get("currency", "USD")})
        self.receipt = ledger.service("receipt", kind="idem",
                                      result=lambda a: {"receipt": a["n"]})

        async def prepare(args: dict[str, Any]) -> Any:
            if args.get("gate"):
                claim = current_call()
                assert claim is not None
                await database.fetch(INSIDE_GATE, f"inside:{claim.task_id}")
                # The remote side holds the request until the test opens the gate.
                while not await database.fetch(FLAG_SET, OPEN_GATE):
                    await asyncio.sleep(0.02)
            return await self.prepare_now(args)

        self.prepare = prepare


async def _first_half(ctx: AgentContext, task_input: dict[str, Any], services: Services,
                      notify: Callable[[], Awaitable[bool]]) -> Any:
    n = int(task_input["n"])
    prepared = await ctx.tool("prepare", services.prepare,
                              {"n": n, "gate": bool(task_input.get("gate"))}, retry=QUICK)
    # Asked here, where the call is: a patch applies from the point the code reaches it.
    if await notify():
        await ctx.tool("notify", services.notify, {"n": n}, idempotent=False, retry=QUICK)
    await ctx.checkpoint(next_action="wait")
    if task_input["wait"] == "timer":
        await ctx.sleep(float(task_input["sleep_s"]))
        return prepared, None
    return prepared, await ctx.wait_for_signal("go")


async def _always() -> bool:
    return True


async def _never() -> bool:
    return False


def register_v1(engine: Engine) -> None:
    """Version 1 of ``deployed``."""
    services = Services(engine)

    @engine.agent(AGENT, version="1")
    async def deployed(ctx: AgentContext, task_input: Any) -> Any:
        prepared, approval = await _first_half(ctx, task_input, services, _always)
        charged = await ctx.tool("charge", services.charge, {"n": int(task_input["n"])},
                                 retry=QUICK)
        return {"prepared": prepared, "approval": approval, "charged": charged}


def register_v2(engine: Engine, *, services: Services | None = None,
                on_claim: HookFunction | None = None) -> None:
    """Version 2 of ``deployed``: three changes behind ``ctx.patched``, compatible with 1.
    ``services`` and ``on_claim`` let the golden recording break a connection and a hook."""
    services = services or Services(engine)
    database = engine.database

    async def on_resume(event: HookEvent) -> None:
        await database.fetch(RESUMED, event.task_id, event.reason, event.task_version,
                             event.code_version, event.new_version, event.worker_id)

    hooks = AgentHooks(on_resume=on_resume, on_claim=on_claim)

    @engine.agent(AGENT, version="2", compatible=("1",), hooks=hooks)
    async def deployed(ctx: AgentContext, task_input: Any) -> Any:
        n = int(task_input["n"])

        async def keep_notify() -> bool:
            return not await ctx.patched("drop-notify")

        prepared, approval = await _first_half(ctx, task_input, services, keep_notify)
        args: dict[str, Any] = {"n": n}
        if await ctx.patched("charge-eur"):
            args["currency"] = "EUR"
        charged = await ctx.tool("charge", services.charge, args, retry=QUICK)
        output = {"prepared": prepared, "approval": approval, "charged": charged}
        if await ctx.patched("add-receipt"):
            output["receipt"] = await ctx.tool("receipt", services.receipt, {"n": n},
                                               retry=QUICK)
        return output


def register_v2_unpatched(engine: Engine) -> None:
    """Version 2's changes made without ``ctx.patched``, yet declared compatible with 1."""
    services = Services(engine)

    @engine.agent(AGENT, version="2", compatible=("1",))
    async def deployed(ctx: AgentContext, task_input: Any) -> Any:
        n = int(task_input["n"])
        prepared, approval = await _first_half(ctx, task_input, services, _never)
        charged = await ctx.tool("charge", services.charge, {"n": n, "currency": "EUR"},
                                 retry=QUICK)
        receipt = await ctx.tool("receipt", services.receipt, {"n": n}, retry=QUICK)
        return {"prepared": prepared, "approval": approval, "charged": charged,
                "receipt": receipt}


async def prepare_tables(engine: Engine) -> None:
    """Create the ledger and the test's own tables (idempotent)."""
    await EffectLedger.for_engine(engine).prepare()
    for statement in TABLES:
        await engine.database.fetch(statement)


async def setup_v1(engine: Engine) -> None:
    """The version 1 workers' register function."""
    register_v1(engine)
    await prepare_tables(engine)


async def setup_v2(engine: Engine) -> None:
    """The version 2 workers' register function."""
    register_v2(engine)
    await prepare_tables(engine)
