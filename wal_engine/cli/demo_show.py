"""``wal-engine demo``: a worker SIGKILLed mid-task, another takes over, a human approves.

1. submit a research task to the demo agent on the embedded PostgreSQL;
2. start worker A (a subprocess) armed to SIGKILL itself right after a tool's side effect and
   before its result is recorded (the hardest crash window);
3. wait until A is dead, start worker B: it breaks A's lease once it expires, resumes the
   task from the log, retries the in-doubt call with the same idempotency key (the gateway
   returns the first result, the effect does not happen again), and stops at the approval;
4. approve the exact planned call; B finishes the task;
5. print the history, the verification of the hash chain, and the side-effect counts.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from wal_engine.cli import demo
from wal_engine.cli.common import EXIT_FINDING, CliError
from wal_engine.cli.render import summary
from wal_engine.engine import Engine, connect
from wal_engine.state_machine import TERMINAL, Status

poll_s: Final = 0.05


def _spawn_worker(dsn: str, worker_id: str, failpoint: str | None,
                  logs: Path) -> subprocess.Popen[bytes]:
    """A demo worker subprocess; its output goes to ``logs/WORKER_ID.log`` (a directory of
    this run's own: concurrent demos do not share files)."""
    env = {**os.environ, "WAL_ENGINE_LOG_LEVEL": "warning"}
    env.pop("ENGINE_FAILPOINT", None)
    if failpoint:
        env["ENGINE_FAILPOINT"] = failpoint
    with (logs / f"{worker_id}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "wal_engine.cli.demo", "worker", dsn, worker_id],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )


async def _until(predicate: Any, what: str, timeout_s: float = demo.phase_timeout_s) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(poll_s)
    raise CliError(f"demo: timed out after {timeout_s:.0f} s waiting for {what}", EXIT_FINDING)


async def _status(engine: Engine, task_id: str) -> Status:
    return (await engine.head(task_id)).status


async def _exited(process: subprocess.Popen[bytes]) -> int | None:
    return process.poll()


async def run_demo(console: Console | None = None, dsn: str | None = None) -> bool:
    """Run the whole demo; return whether every check passed."""
    console = console or Console()
    engine = await connect(dsn)
    workers: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp(prefix="wal-engine-demo-"))
    passed = False
    try:
        demo.register(engine)
        await demo.prepare(engine)
        started = time.monotonic()
        task_id = await engine.submit(demo.AGENT_NAME,
                                      {"question": "How do agents survive crashes?"})
        console.print(f"[bold]submitted[/] task {task_id}")
        worker_a = _spawn_worker(engine.database.dsn, "worker-A",
                                 "after_effect_before_result:2:sigkill", logs)
        workers.append(worker_a)
        console.print("worker-A started; it will be SIGKILLed between a side effect and its result")
        code = await _until(lambda: _exited(worker_a), "worker-A to die")
        console.print(f"worker-A exited with {code} (SIGKILL is -9) at seq "
                      f"{(await engine.head(task_id)).head_seq}")
        worker_b = _spawn_worker(engine.database.dsn, "worker-B", None, logs)
        workers.append(worker_b)
        console.print(f"worker-B started; A's lease expires after {demo.lease_ttl_ms} ms")
        await _until(lambda: _waiting(engine, task_id), "the approval request")
        state = await engine.state(task_id)
        (call_id, request), = state.approvals.items()
        console.print(f"task waits for approval of [bold]{request.tool}[/] ({call_id}); approving")
        await engine.approve(task_id, call_id, approver="demo-operator")
        await _until(lambda: _finished(engine, task_id), "the task to finish")
        worker_b.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker_b.wait, 30)
        elapsed = time.monotonic() - started
        passed = await _report(console, engine, task_id, code, elapsed)
        return passed
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
        await engine.close()
        if passed:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            console.print(f"the workers' logs are in {logs}", soft_wrap=True)


async def _waiting(engine: Engine, task_id: str) -> bool:
    state = await engine.state(task_id)
    return state.status is Status.WAITING and bool(state.approvals)


async def _finished(engine: Engine, task_id: str) -> bool:
    return await _status(engine, task_id) in TERMINAL


async def _report(console: Console, engine: Engine, task_id: str, killed_code: int | None,
                  elapsed_s: float) -> bool:
    history = await engine.history(task_id)
    table = Table(title=f"history of {task_id}")
    for column in ("seq", "epoch", "type", "what (tool, call, idempotency key, ...)",
                   "recorded at"):
        table.add_column(column)
    for record in history:
        stamp = "" if record.recorded_at is None else record.recorded_at.strftime("%H:%M:%S.%f")
        table.add_row(str(record.seq), str(record.epoch), record.type,
                      escape(summary(record)), stamp[:-3])
    console.print(table)
    report = await engine.store.verify_task(task_id)
    console.print(f"hash chain: {'verified' if report.ok else 'BROKEN'} "
                  f"({report.events} events, head {report.head_hash.hex()[:16]}...)")
    effects = await engine.database.fetch(demo.EFFECT_TOTALS, task_id)
    applied = sum(row["applied"] for row in effects)
    deliveries = sum(row["deliveries"] for row in effects)
    exactly_once = all(row["applied"] == 1 for row in effects) and len(effects) == 3
    console.print("each tool's service: 'reached' counts deliveries (retries included: the "
                  "first fetch fails on purpose, and the call in doubt when worker A was "
                  "killed is sent again by B with the same idempotency key); 'acted' counts "
                  "the times the service really applied it (it answers a repeated key from "
                  "its record)", soft_wrap=True)
    for row in effects:
        console.print(f"  {row['tool']}: reached {row['deliveries']}x, acted {row['applied']}x")
    console.print(f"side effects: {applied} ran for {len(effects)} tool calls "
                  f"({deliveries} deliveries), "
                  f"{'each exactly once' if exactly_once else 'NOT exactly once'}")
    state = await engine.state(task_id)
    answer = state.output["answer"] if state.output else None
    console.print(f"final status {state.status}; answer: {answer}")
    ok = report.ok and exactly_once and killed_code == -signal.SIGKILL and \
        state.status is Status.COMPLETED
    console.print(f"demo {'passed' if ok else 'FAILED'} in {elapsed_s:.1f} s")
    return ok
