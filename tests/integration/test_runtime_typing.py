"""mypy --strict sees the result types of ctx.tool and ctx.llm (result_type or the tool's).

Without ``result_type``, an async tool whose own parameters are typed ``Any`` gets ``Any``:
mypy resolves a call whose argument types contain ``Any`` to ``Any`` when several
overloads match (the async one and the sync one both do); ``result_type=`` always types.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

USER_CODE = textwrap.dedent('''
    from typing import Any, assert_type

    import msgspec

    from wal_engine.runtime.context import AgentContext


    class Charge(msgspec.Struct):
        charge_id: str


    async def fetch(args: dict[str, str]) -> dict[str, int]:
        return {"n": 1}


    def count(args: Any) -> int:
        return 1


    async def agent(ctx: AgentContext, task_input: Any) -> None:
        assert_type(await ctx.tool("charge", fetch, {}, result_type=Charge), Charge)
        assert_type(await ctx.tool("fetch", fetch, {}), dict[str, int])
        assert_type(await ctx.tool("count", count, None, idempotent=False), int)
        assert_type(await ctx.llm("m", fetch, {}, result_type=Charge), Charge)
''')

WRONG_CODE = textwrap.dedent('''
    from typing import Any

    from wal_engine.runtime.context import AgentContext


    def count(args: Any) -> int:
        return 1


    async def agent(ctx: AgentContext, task_input: Any) -> str:
        return await ctx.tool("count", count)
''')


def _mypy(tmp_path: Path, source: str) -> tuple[str, int]:
    api = pytest.importorskip("mypy.api")
    module = tmp_path / "user_agent.py"
    module.write_text(source)
    root = Path(__file__).resolve().parents[2]
    stdout, stderr, status = api.run([
        "--strict", "--no-error-summary", "--follow-imports=silent",
        "--cache-dir", str(root / ".mypy_cache"), "--python-version", "3.11", str(module)])
    return stdout + stderr, status


def test_the_result_type_follows_result_type_or_the_function(tmp_path: Path) -> None:
    """Every assert_type in a user's agent holds under mypy --strict."""
    output, status = _mypy(tmp_path, USER_CODE)
    assert status == 0, output


def test_a_wrong_use_of_the_result_is_reported(tmp_path: Path) -> None:
    """Returning a tool's int where the agent promises a str is a type error."""
    output, status = _mypy(tmp_path, WRONG_CODE)
    assert status == 1 and "user_agent.py:12: error" in output, output
