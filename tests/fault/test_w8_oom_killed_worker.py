"""W8 (RELIABILITY.md): a worker OOM-killed while it holds a huge payload.

A memory watchdog plays the kernel's OOM killer: it reads the worker's resident set from
``/proc`` and SIGKILLs the process once it passes a cap, as a cgroup memory limit would. The
worker is receiving a huge answer from a tool at that moment (built in memory, then held).
Expected as for W1: the lease runs out within its TTL (database clock), another worker
resumes every task of the dead one, the huge call is delivered again under its key, and
every effect acts once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Final

import pytest

from tests.fault.conftest import FaultHarness, wait_for
from tests.fault.support import FIGURES
from wal_engine.state_machine import TERMINAL, Status

ROUNDS: Final = 5
HUGE_MIB: Final = 192
RSS_CAP_MIB: Final = 160
LEASE_TTL_S: Final = 1.0
SWEEP_SLACK_S: Final = 2.0
"""The sweeper runs every 200 ms and a poll every 100 ms; the rest is a loaded machine."""


def rss_mib(pid: int) -> float:
    """The resident set of ``pid`` in MiB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0.0


async def oom_killer(pid: int, cap_mib: float, deadline_s: float) -> float:
    """SIGKILL ``pid`` once its RSS passes ``cap_mib``; returns the RSS seen at the kill."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        rss = rss_mib(pid)
        if rss > cap_mib:
            os.kill(pid, signal.SIGKILL)
            return rss
        await asyncio.sleep(0.005)
    raise AssertionError(f"worker {pid} never passed {cap_mib} MiB")


@pytest.mark.timeout(240)
async def test_w8_oom_killed_worker_during_a_huge_payload(harness: FaultHarness) -> None:
    """Five rounds: a worker running a hog task and three ordinary tasks is killed by the
    memory watchdog; the next worker finishes all four, each effect acting once."""
    kills: list[float] = []
    orphaned_after: list[float] = []
    for round_ in range(ROUNDS):
        rss, after = await _oom_round(harness, round_)
        kills.append(rss)
        orphaned_after.append(after)
    rows = await harness.assert_effects_once_and_intended()
    hogged = [r for r in rows if r["tool"] == "hog"]
    assert len(hogged) == ROUNDS and all(r["applied"] == 1 for r in hogged)
    slowest = max(orphaned_after)
    assert slowest < LEASE_TTL_S + SWEEP_SLACK_S + 5, orphaned_after
    line = (f"W8: tasks {ROUNDS * 4}, OOM kills {len(kills)} at RSS "
            f"{min(kills):.0f}-{max(kills):.0f} MiB (cap {RSS_CAP_MIB}), orphaned "
            f"{min(orphaned_after):.1f}-{slowest:.1f} s after the kill (lease TTL "
            f"{LEASE_TTL_S:.0f} s, includes the next worker's start), side effects "
            f"{len(rows)} keys, {sum(r['applied'] for r in rows)} applied, violations 0")
    print(line)
    FIGURES.append(line)


async def _oom_round(harness: FaultHarness, round_: int) -> tuple[float, float]:
    """One round; returns the RSS at the kill and how long the hog task stayed leased."""
    engine = harness.engine
    hog = await engine.submit("hog", {"mib": HUGE_MIB}, task_id=f"w8-hog-{round_}")
    others = [await engine.submit("steps", {"tools": 2}, task_id=f"w8-steps-{round_}-{n}")
              for n in range(3)]
    victim = await harness.spawn(f"w8-victim-{round_}")
    rss = await oom_killer(victim.process.pid, RSS_CAP_MIB, 60)
    killed_at = time.monotonic()
    await wait_for(lambda: victim.process.poll() is not None, "the kill to land", 10)
    assert victim.process.returncode == -signal.SIGKILL
    # No lease outlives its TTL: the sweeper of the next worker orphans the hog task.
    survivor = await harness.spawn(f"w8-survivor-{round_}")
    await wait_for(lambda: _orphaned(harness, hog), "the hog task to be orphaned", 30)
    orphaned_after = time.monotonic() - killed_at
    for task_id in (hog, *others):
        await wait_for(lambda t=task_id: _terminal(harness, t), f"{task_id} to end", 60)
    survivor.kill(signal.SIGTERM)
    await wait_for(lambda: survivor.process.poll() is not None, "the survivor to stop", 30)
    state = await engine.state(hog)
    assert state.status is Status.COMPLETED and state.output == 1 + HUGE_MIB, state
    for task_id in others:
        assert (await engine.state(task_id)).output == 3
        assert (await engine.store.verify_task(task_id)).ok
    assert (await engine.store.verify_task(hog)).ok
    return rss, orphaned_after


async def _orphaned(harness: FaultHarness, task_id: str) -> bool:
    history = await harness.engine.history(task_id)
    return any(r.type == "task_orphaned" for r in history)


async def _terminal(harness: FaultHarness, task_id: str) -> bool:
    return (await harness.engine.head(task_id)).status in TERMINAL
