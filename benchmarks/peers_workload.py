"""The logical agent workload every contender of the suite runs, and the plumbing they share.

A task of N steps; step ``i`` adds one message of about 500 bytes (``message(i)``) and one
tool result of about 1 KB (``result(i)``); the state after step k is every message so far.
The texts are prose-like words drawn from a seeded generator, different at every step, so
that compression (TOAST, pglz) sees what it would see in a real conversation, not a
repeated letter.

Every contender runs in a child process of its own, started with ``python -m
benchmarks.peers_workload <peer> <command> <json>`` (``<peer>`` names the module
``benchmarks.peers_<peer>``): ``serve`` keeps a live contender (pools, workers, graphs,
DBOS) stepping round by round on the parent's request (:class:`RemotePeer`), so that the
contenders share no interpreter, event loop, garbage collector or threads and each has its
own peak memory; other commands (``build`` a long history while the table growth is
measured; ``recover`` DBOS's workflow in a fresh process) print one JSON result, which
:func:`run_child` reads.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import importlib
import json
import os
import random
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import asyncpg

MESSAGE_BYTES: Final = 500
RESULT_BYTES: Final = 1000
TEXT_VARIANTS: Final = 1024
"""Distinct message and result texts; step i uses variant i mod TEXT_VARIANTS."""
CONCURRENT_TASKS: Final = 64
CHECKPOINT_EVERY_STEPS: Final = 100
"""wal-engine's benchmark agent marks a step boundary (``ctx.checkpoint``) every this many
tool steps, so that its snapshot policy applies; the other contenders persist their state
at every step by construction."""
CHILD_TIMEOUT_S: Final = 900.0
ROUND_TIMEOUT_S: Final = 600.0
CLOSE_TIMEOUT_S: Final = 120.0
STEP_TIMEOUT_S: Final = 120.0
"""A step that takes longer means the contender's run died: the suite fails, never hangs."""
STDERR_TAIL_LINES: Final = 30
RESULT_PREFIX: Final = "@@result "
REPOSITORY: Final = Path(__file__).resolve().parents[1]

_WORDS: Final = (
    "the agent tool result search query page found returned error retry value table row "
    "user asked answer because which should could would first second third file open read "
    "write list item price order date time city weather report summary plan next step done "
    "forecast Lisbon tomorrow rain wind museum visit indoor ten flight hotel budget total"
).split()


def _text(seed: str, length: int) -> str:
    generator = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < length:
        word = generator.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:length]


_MESSAGES: Final = [_text(f"message/{i}", MESSAGE_BYTES) for i in range(TEXT_VARIANTS)]
_RESULTS: Final = [_text(f"result/{i}", RESULT_BYTES) for i in range(TEXT_VARIANTS)]


def message(step: int) -> str:
    """The ~500-byte message step ``step`` adds (deterministic: a re-run asks the same)."""
    return _MESSAGES[step % TEXT_VARIANTS]


def result(step: int) -> str:
    """The ~1 KB tool result step ``step`` adds."""
    return _RESULTS[step % TEXT_VARIANTS]


class Driver:
    """Hands step tokens to in-process agents (one queue pair per task) and awaits each
    step's end, so that one step of a live contender is one awaitable."""

    def __init__(self) -> None:
        self.go: dict[str, asyncio.Queue[bool]] = {}
        self.done: dict[str, asyncio.Queue[None]] = {}

    def add(self, task_id: str) -> None:
        """Prepare the queues of a task before its run starts."""
        self.go[task_id] = asyncio.Queue()
        self.done[task_id] = asyncio.Queue()

    async def step(self, task_id: str) -> None:
        """Let the task make one step and wait until that step is durable."""
        self.go[task_id].put_nowait(True)
        await self.done[task_id].get()

    async def stop(self, task_id: str) -> None:
        """Let the task's run end."""
        self.go[task_id].put_nowait(False)


# ----------------------------------------------------------------------------- measuring


TABLES_BYTES: Final = """
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8 AS bytes
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE c.relkind = 'r' AND n.nspname = $1 AND c.relname LIKE ANY($2::text[])
"""


async def tables_bytes(connection: asyncpg.Connection, schema: str,
                       patterns: Sequence[str]) -> int:
    """Bytes on disk (heap, indexes, TOAST) of the tables of ``schema`` matching ``patterns``."""
    value = await connection.fetchval(TABLES_BYTES, schema, list(patterns), timeout=30)
    return int(value)


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB.

    ``VmHWM`` (Linux) belongs to the process's own address space, so a child started by
    fork and exec does not inherit its parent's peak, as it would with ``ru_maxrss``.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class StepClock:
    """Steps and wall-clock time of a history build, overall and over its last window."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.window_started: float | None = None
        self.steps = 0

    def mark_window(self) -> None:
        """The measured last window of steps starts now."""
        self.window_started = time.perf_counter()

    def rates(self, window: int, *, whole: bool = True) -> tuple[float | None, float | None]:
        """Steps/s over the whole build (None if ``whole`` is False) and over the window."""
        now = time.perf_counter()
        overall = self.steps / (now - self.started) if whole else None
        last = None if self.window_started is None else window / (now - self.window_started)
        return overall, last


def history_figures(*, steps: int, window: int, before: int, middle: int, after: int,
                    clock: StepClock, whole: bool = True,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figures of a history build: bytes per step (average over all ``steps``, and over
    the last ``window`` steps), steps/s (the same two ways), peak RSS. ``before``,
    ``middle`` and ``after`` are table bytes before the build, ``window`` steps before its
    end, and at its end. ``whole=False``: the build did not write every step one by one,
    so there is no whole-build average."""
    overall, last = clock.rates(window, whole=whole)
    return {
        "steps": steps,
        "window_steps": window,
        "bytes_total": after - before if whole else None,
        "bytes_per_step": (after - before) / steps if whole else None,
        "bytes_per_step_last": (after - middle) / window,
        "steps_per_s": overall,
        "steps_per_s_last": last,
        "peak_rss_mib": peak_rss_mib(),
        **(extra or {}),
    }


# ----------------------------------------------------------------------------- children


class ChildFailed(RuntimeError):
    """A child process exited (or stopped answering) without printing its result."""


def _spawn(peer: str, command: str, arguments: dict[str, Any], *,
           stdin: bool = False) -> Awaitable[asyncio.subprocess.Process]:
    return asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.peers_workload", peer, command, json.dumps(arguments),
        cwd=REPOSITORY, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )


class _Tail:
    """Drains a child's stderr (so that it never blocks on a full pipe), keeping its end."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[str] = []
        self.task = asyncio.create_task(self._drain(stream))

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.lines = [*self.lines[-(STDERR_TAIL_LINES - 1):],
                          line.decode(errors="replace").rstrip()]

    def text(self) -> str:
        return "\n".join(self.lines)


async def run_child(peer: str, command: str, arguments: dict[str, Any], *,
                    timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """Run ``command`` of ``benchmarks.peers_<peer>`` in a fresh interpreter; return its
    result. The child is killed as soon as its result is read (a DBOS child leaves its
    workflow PENDING on purpose, as a crash would)."""
    process = await _spawn(peer, command, arguments)
    assert process.stdout is not None and process.stderr is not None
    tail = _Tail(process.stderr)
    try:
        found = await asyncio.wait_for(_result_line(process.stdout), timeout_s)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await tail.task
    if found is None:
        raise ChildFailed(f"{peer} {command} exited {process.returncode} without a result:\n"
                          f"{tail.text()}")
    return found


async def _result_line(stream: asyncio.StreamReader) -> dict[str, Any] | None:
    while True:
        line = await stream.readline()
        if not line:
            return None
        text = line.decode(errors="replace")
        if text.startswith(RESULT_PREFIX):
            document: dict[str, Any] = json.loads(text[len(RESULT_PREFIX):])
            return document


def print_result(document: dict[str, Any]) -> None:
    """Print a child's result as the line the parent waits for."""
    print(RESULT_PREFIX + json.dumps(document), flush=True)


# ----------------------------------------------------------------------------- live peers


class RemotePeer:
    """A contender living in a child process of its own (its own interpreter, event loop,
    garbage collector and threads, as in a deployment), stepped round by round on request.

    The child runs ``serve``: it opens ``benchmarks.peers_<key>.live_peer(arguments)``, then
    for each request runs one round (untimed warm-up steps, a collection, then timed steps,
    each timed there) and answers with the latencies.
    """

    def __init__(self, key: str, name: str) -> None:
        self.key, self.name = key, name
        self.process: asyncio.subprocess.Process | None = None
        self.tail: _Tail | None = None

    async def start(self, arguments: dict[str, Any]) -> None:
        """Start the child and wait until its contender is open."""
        self.process = await _spawn(self.key, "serve", arguments, stdin=True)
        assert self.process.stderr is not None
        self.tail = _Tail(self.process.stderr)
        await self._answer(CHILD_TIMEOUT_S)

    async def _answer(self, timeout_s: float) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        found = await asyncio.wait_for(_result_line(self.process.stdout), timeout_s)
        if found is None or "error" in found:
            detail = "" if found is None else found["error"]
            tail = "" if self.tail is None else self.tail.text()
            raise ChildFailed(f"{self.name} failed: {detail}\n{tail}")
        return found

    async def request(self, command: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request; return the child's answer."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()
        return await self._answer(timeout_s)

    async def round(self, method: str, warmup: int, ops: int) -> list[int]:
        """One round of ``method`` (``step_one`` or ``step_all``); per-step latencies, ns."""
        answer = await self.request({"op": "round", "method": method, "warmup": warmup,
                                     "ops": ops}, ROUND_TIMEOUT_S)
        latencies: list[int] = answer["latencies"]
        return latencies

    async def close(self) -> dict[str, Any]:
        """Close the contender, stop the child; return its figures (peak RSS, extras)."""
        if self.process is None:
            return {}
        try:
            if self.process.returncode is None:
                return await self.request({"op": "close"}, CLOSE_TIMEOUT_S)
            return {}
        finally:
            if self.process.returncode is None:
                self.process.kill()
            await self.process.wait()
            if self.tail is not None:
                await self.tail.task


def remote_contender(peer: RemotePeer, name: str, method: str, *, ops: int, warmup: int,
                     events_per_op: int = 1, reference: bool = False) -> Any:
    """A harness contender whose steps run in ``peer``'s process: the round is run there
    when it starts (``before_round``), and each operation hands the harness the next
    latency the child measured (the harness's own warm-up must therefore be 0)."""
    from benchmarks import harness

    pending: collections.deque[int] = collections.deque()

    async def before_round(_round: int) -> None:
        pending.extend(await peer.round(method, warmup, ops))

    async def operation() -> int:
        return pending.popleft()

    return harness.Contender(name, operation, events_per_op=events_per_op,
                             reference=reference, before_round=before_round)


async def serve(module: Any, arguments: dict[str, Any]) -> None:
    """(Child) Open the module's live contender and run rounds on request (see RemotePeer)."""
    peer = module.live_peer(arguments)
    await peer.open()
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print_result({"ready": True})
    while line := await reader.readline():
        command = json.loads(line)
        if command["op"] == "close":
            extra = await peer.extra()
            await peer.close()
            print_result({"peak_rss_mib": peak_rss_mib(), **extra})
            return
        step = getattr(peer, command["method"])
        try:
            latencies = await _round(step, int(command["warmup"]), int(command["ops"]))
        except Exception as error:  # Reported to the parent, which fails the suite.
            print_result({"error": f"{type(error).__name__}: {error}"})
            return
        print_result({"latencies": latencies})


async def _round(step: Callable[[], Awaitable[None]], warmup: int, ops: int) -> list[int]:
    for _ in range(warmup):
        await asyncio.wait_for(step(), STEP_TIMEOUT_S)
    # Collect now so that garbage from the warm-up is not charged to the timed steps.
    gc.collect()
    latencies = []
    for _ in range(ops):
        start = time.perf_counter_ns()
        await asyncio.wait_for(step(), STEP_TIMEOUT_S)
        latencies.append(time.perf_counter_ns() - start)
    return latencies


def child_main(argv: list[str]) -> None:
    """Entry of a child: run ``benchmarks.peers_<peer>.<command>(arguments)`` (or ``serve``),
    print the result, and leave at once (no interpreter teardown: a DBOS child must not
    clean up after itself)."""
    peer, command, arguments = argv[0], argv[1], json.loads(argv[2])
    module = importlib.import_module(f"benchmarks.peers_{peer}")
    if command == "serve":
        asyncio.run(serve(module, arguments))
    else:
        function: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] = getattr(module,
                                                                                  command)
        print_result(asyncio.run(function(arguments)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    child_main(sys.argv[1:])
