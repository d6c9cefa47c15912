"""The public API type-checks for its users: ``mypy --strict`` on a user module outside the
package (the README's agent example as written, plus ``assert_type``s of what the engine
hands back) reports nothing, and on a module that misuses the API reports each misuse.

One mypy run checks both modules (its cold start is most of this test's time)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MYPY_TIMEOUT_S = 300

CHECKS = '''
from collections.abc import Callable, Coroutine
from typing import Any, assert_type, reveal_type

import msgspec

import replay
import triage
import wal_engine
from wal_engine.ids import TaskId


class Order(msgspec.Struct):
    item: str
    quantity: int


async def uses_the_api() -> None:
    engine = await wal_engine.connect()
    assert_type(engine, wal_engine.Engine)
    configured = await wal_engine.connect("postgresql:///x",
                                          config=wal_engine.EngineConfig(pool_size_max=4))
    assert_type(configured, wal_engine.Engine)
    assert_type(await wal_engine.connect(tenant="t", migrate=False), wal_engine.Engine)
    reveal_type(triage.register)
    assert_type(triage.main, Callable[[], Coroutine[Any, Any, None]])

    async def orders(ctx: wal_engine.AgentContext, order: Order) -> int:
        return order.quantity

    decorated = engine.agent("orders")(orders)
    reveal_type(decorated)

    @engine.agent("also", version="2")
    async def also(ctx: wal_engine.AgentContext, order: Order) -> str:
        return order.item

    reveal_type(also)
    task_id = await engine.submit("orders", {"item": "x", "quantity": 1},
                                  budget=wal_engine.Budget(max_steps=3))
    assert_type(task_id, TaskId)
    assert_type(await engine.state(task_id), replay.AgentState)
    assert_type(await engine.wait(task_id, timeout_s=5), replay.AgentState)
    assert_type(await engine.head(task_id), wal_engine.TaskHead)
    assert_type(await engine.history(task_id), list[wal_engine.EventRecord])
    assert_type(engine.worker(wal_engine.WorkerConfig(concurrency=2)), wal_engine.Worker)
    worker = engine.worker(concurrency=2, poll_ms=10, worker_id="w")
    assert_type(worker, wal_engine.Worker)
    assert_type(worker.config, wal_engine.WorkerConfig)
    assert_type(await worker.run(until_idle=True), None)
'''

MISUSE = '''
import wal_engine


async def misuses(engine: wal_engine.Engine) -> None:
    await engine.submit(123, budget=5)
    engine.worker(wal_engine.WorkerConfig(), concurency=3)
    await wal_engine.connect(pool_size_max="many")

    @engine.agent("bad")
    async def bad(ctx: int, value: str) -> None:
        return None
'''

EXPECTED_ERRORS = [
    (5, r'Argument 1 to "submit" of "Engine" has incompatible type "int"; expected "str"'),
    (5, r'Argument "budget" to "submit" of "Engine" has incompatible type "int"; '
        r'expected "Budget \| None"'),
    (6, r'Unexpected keyword argument "concurency" for "worker" of "Engine"'),
    (7, r'Argument "pool_size_max" to "connect" has incompatible type "str"; expected "int"'),
    (9, r'Value of type variable "F" of function cannot be "Callable\[\[int, str\], '
         r'Coroutine\[Any, Any, None\]\]"'),
]


REVEALED = [
    "def (engine: wal_engine.engine.Engine)",
    "def (ctx: wal_engine.runtime.context.AgentContext, order: checks.Order) -> "
    "typing.Coroutine[Any, Any, int]",
    "def (ctx: wal_engine.runtime.context.AgentContext, order: checks.Order) -> "
    "typing.Coroutine[Any, Any, str]",
]
"""What ``reveal_type`` shows for ``triage.register`` and the two decorated agents: the
functions' own types (an ``assert_type`` against ``Callable`` would not match a ``def``)."""


def _readme_agent_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (block,) = [text for text in blocks if "async def main()" in text]
    return block


def test_the_readme_example_and_the_api_type_check_under_strict(tmp_path: Path) -> None:
    """No error in the README example nor in the assert_types; each misuse is reported."""
    (tmp_path / "triage.py").write_text(_readme_agent_example())
    (tmp_path / "checks.py").write_text(textwrap.dedent(CHECKS).lstrip())
    (tmp_path / "misuse.py").write_text(textwrap.dedent(MISUSE).lstrip())
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--python-version", "3.11",
         "--cache-dir", str(tmp_path / "mypy-cache"), "--no-error-summary",
         "--hide-error-context", "--show-error-codes", "--config-file", os.devnull,
         "triage.py", "checks.py", "misuse.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=MYPY_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert done.returncode == 1, (done.stdout, done.stderr)
    unexpected = [line for line in lines if not line.startswith("misuse.py:")]
    assert unexpected == [], done.stdout
    revealed = [line.split("Revealed type is ", 1)[1].strip('"') for line in
                done.stdout.splitlines() if line.startswith("checks.py:") and "Revealed" in line]
    assert revealed == REVEALED, done.stdout
    misuse = [line for line in lines if line.startswith("misuse.py:")]
    for line_number, pattern in EXPECTED_ERRORS:
        assert any(re.match(rf"misuse\.py:{line_number}: error: {pattern}", line)
                   for line in misuse), (pattern, misuse)
    assert len(misuse) == len(EXPECTED_ERRORS), misuse
