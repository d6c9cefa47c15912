"""The whole benchmark suite, side by side: the physical limit, wal-engine, LangGraph, DBOS.

``python -m benchmarks [--quick] [--dsn DSN]`` runs one logical agent workload (a task of N
steps, each adding a ~500-byte message and a ~1 KB tool result; see
:mod:`benchmarks.peers_workload`) through every contender, against one PostgreSQL:

1. **raw asyncpg**, the reference: two one-row INSERT commits per step, equally sized rows
   (:mod:`benchmarks.peers_raw`);
2. **wal-engine**: a tool step through the runtime (intent and result, two fenced,
   hash-chained appends), concurrent tasks group-committed (:mod:`benchmarks.peers_wal`);
3. **LangGraph** ``AsyncPostgresSaver`` under a compiled one-node StateGraph
   (:mod:`benchmarks.peers_langgraph`), if installed;
4. **DBOS Transact**, one ``@DBOS.step`` per step in a workflow
   (:mod:`benchmarks.peers_dbos`), if installed.

Workloads, each running its contenders interleaved in rounds (A B C D, B C D A, ...):

* ``step``: one step of one task at a time (latency p50/p99, steps/s); at least
  ``P99_SAMPLES_MIN`` (2,000) timed steps per contender outside ``--quick``, so that its
  p99 is the 20th-worst sample or deeper (``--ops`` is raised to reach it);
* ``step64``: one step of each of 64 tasks at once (steps/s; events/s counts steps);
* ``resume@N`` for each history size (1,000, 10,000 and 100,000 steps; ``--quick``: 100
  and 1,000): the floor (reading and decoding one row holding the task's state; the
  reference), then wal-engine ``resume`` on a fresh connection, LangGraph ``aget_tuple`` on
  a fresh saver, DBOS recovery in a fresh process. LangGraph and DBOS skip histories
  longer than ``PEER_HISTORY_STEPS_MAX`` (10,000; the run says so): DBOS recovers a
  10,000-step workflow in ~14 s by re-running it, so 100,000 steps would take 20 minutes
  of resume rounds alone, and LangGraph's last checkpoint would hold the whole 150 MB
  conversation in one row.

Agent rows, each an agent framework's own in-memory run (the reference) against the same
agent made durable by wal-engine's integration and by DBOS's (all three in one child
process; DBOS on a database of its own, ``<suite database>_dbos_<row>``), interleaved:

* ``pydantic-ai``: one run of :mod:`benchmarks.pydantic_ai_agent`'s agent (4 tool calls
  and a structured answer: 9 model requests and tool calls), per step = p50 / 9
  (:mod:`benchmarks.peers_pydantic_ai`); needs the ``pydantic-ai`` extra, DBOS
  ``pydantic-ai-slim[dbos]``;
* ``openai-agents``: runs of 1 and of S steps (20; ``--quick`` 5) of
  :mod:`benchmarks.openai_agents`' agent, per step = the marginal cost of one model turn and
  tool call, (p50 at S - p50 at 1) / (S - 1) (:mod:`benchmarks.peers_openai_agents`); needs
  the ``openai-agents`` extra, DBOS ``dbos-openai-agents``.

A row whose framework is not installed is skipped with a line saying so; its DBOS contender
likewise. Temporal's integrations are measured nowhere: their test server is a binary that
``temporalio`` downloads at run time, which this machine cannot fetch.

Between the two, every contender builds its N-step task in a child process (one at a
time), which reports the growth of the contender's tables (``pg_total_relation_size``:
heap, indexes, TOAST) per step, on average and over the last tenth of the steps, its
steps/s, and its peak RSS.

Without ``--dsn`` the suite uses its own databases on the server of ``WAL_ENGINE_DSN`` or on
the embedded server: ``wal_bench_suite`` (recreated each run) and ``wal_bench_suite_dbos_sys``
(DBOS's system database), recreated at the start of a run and dropped at its end (a full
run leaves about a gigabyte; ``--keep`` keeps them for inspection). With ``--dsn`` the
database is used as given and DBOS gets ``<database>_dbos_sys`` beside it (recreated each
run, dropped at the end unless ``--keep``).

Results: a Markdown report on stdout (machine, the interleaved table, a summary per
contender, the targets) and ``benchmarks/results/latest.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

import asyncpg

from benchmarks import harness, peers_report
from benchmarks.peers_workload import (
    CONCURRENT_TASKS,
    RemotePeer,
    remote_contender,
    run_child,
)
from wal_engine import limits
from wal_engine.store.connection import DSN_ENV, redact_dsn, resolve_dsn, with_database

NAME: Final = "latest"
SUITE_DATABASE: Final = "wal_bench_suite"
DBOS_DATABASE_SUFFIX: Final = "_dbos_sys"
SIZES: Final = (1_000, 10_000, 100_000)
QUICK_SIZES: Final = (100, 1_000)
QUICK_LANGGRAPH_REAL_STEPS_MAX: Final = 200
"""In --quick, LangGraph writes histories longer than this partly as one state update
(its per-step cost grows with the history: 1,000 real steps take half a minute)."""
PEER_HISTORY_STEPS_MAX: Final = 10_000
"""LangGraph and DBOS build and resume histories up to this many steps (see the docstring)."""
P99_SAMPLES_MIN: Final = 2_000
"""Timed steps per contender of ``step`` (full runs): its p99 is then the 20th-worst."""
RESUME_OPS: Final = 2
RESUME_ROUNDS_MIN: Final = 2
WINDOW_FRACTION: Final = 10
"""Bytes per step over the last 1/10 of a history show whether the cost grows."""
LANGGRAPH_BULK_WINDOW: Final = 10
LIVE_WARMUP_OPS: Final = 2


@dataclasses.dataclass(frozen=True, slots=True)
class PeerSpec:
    """A contender of the suite: its module suffix, display name and required modules."""

    key: str
    name: str
    modules: tuple[str, ...]
    optional: bool


PEERS: Final = (
    PeerSpec("raw", "raw asyncpg", ("asyncpg",), optional=False),
    PeerSpec("wal", "wal-engine", ("wal_engine",), optional=False),
    PeerSpec("langgraph", "LangGraph AsyncPostgresSaver",
             ("langgraph.checkpoint.postgres.aio", "langgraph.graph", "psycopg_pool"),
             optional=True),
    PeerSpec("dbos", "DBOS Transact", ("dbos",), optional=True),
)
PEER_PACKAGES: Final = {
    "langgraph": ("langgraph", "langgraph-checkpoint", "langgraph-checkpoint-postgres",
                  "langchain-core", "psycopg", "psycopg-pool"),
    "dbos": ("dbos", "sqlalchemy", "psycopg"),
    "pydantic-ai": ("pydantic-ai-slim",),
    "openai-agents": ("openai-agents", "dbos-openai-agents"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class AgentRow:
    """An agent framework's row: its child module, and what its contenders need."""

    key: str
    """The workload name (``--only``)."""
    child: str
    """``benchmarks.peers_<child>`` holds the row's contenders."""
    framework: str
    modules: tuple[str, ...]
    extra: str
    dbos_modules: tuple[str, ...]
    dbos_install: str


AGENT_ROWS: Final = (
    AgentRow("pydantic-ai", "pydantic_ai", "Pydantic AI",
             ("pydantic_ai.durable_exec",), "pip install -e '.[pydantic-ai]'",
             ("dbos",), "pip install -e '.[pydantic-ai,bench]'"),
    AgentRow("openai-agents", "openai_agents", "OpenAI Agents SDK",
             ("agents",), "pip install -e '.[openai-agents]'",
             ("dbos", "dbos_openai_agents"), "pip install -e '.[openai-agents,bench]'"),
)
AGENT_ROUNDS_MIN: Final = 2
AGENT_OPS_MIN: Final = 2
AGENT_OPS_DIVISOR: Final = 10
"""An agent run is a few hundred ms, not one step: the rows take a tenth of --ops."""
AGENT_WARMUP_OPS: Final = 1
OPENAI_AGENTS_STEPS: Final = 20
OPENAI_AGENTS_QUICK_STEPS: Final = 5


def missing_module(spec: PeerSpec) -> str | None:
    """The first module of ``spec`` that cannot be imported, or None."""
    return first_missing(spec.modules)


def first_missing(modules: tuple[str, ...]) -> str | None:
    """The first of ``modules`` that cannot be imported, or None."""
    for module in modules:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ModuleNotFoundError:
            return module
    return None


@dataclasses.dataclass(slots=True)
class Run:
    """What one run of the suite knows: settings, databases, peers, and what it measured."""

    settings: harness.RunSettings
    sizes: tuple[int, ...]
    dsn: str
    dbos_url: str
    run_id: str
    peers: list[PeerSpec]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    results: list[harness.WorkloadResult] = dataclasses.field(default_factory=list)
    builds: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    recoveries: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    live: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    agent_dbos: bool = True
    """Whether the agent rows take their DBOS contender (not when --peers leaves dbos out)."""
    keep: bool = False

    def active(self, key: str) -> bool:
        """Whether the peer ``key`` takes part (installed, selected, not failed)."""
        return any(peer.key == key for peer in self.peers) and key not in self.skipped

    def skip(self, key: str, reason: str) -> None:
        """Drop the peer ``key`` from the rest of the run, saying why."""
        name = next(peer.name for peer in PEERS if peer.key == key)
        self.skipped[key] = reason
        print(f"skipping {name}: {reason}", file=sys.stderr, flush=True)

    def task_id(self, key: str, steps: int) -> str:
        """The id of the ``steps``-step history task of peer ``key`` in this run."""
        return f"suite-{key}-{steps}-{self.run_id}"


# ----------------------------------------------------------------------------- databases


async def prepare_databases(dsn: str | None) -> tuple[str, str]:
    """The suite's DSN and DBOS's system database URL, both databases ready."""
    if dsn:
        suite_dsn = dsn
    else:
        server = os.environ.get(DSN_ENV) or await resolve_dsn()
        suite_dsn = with_database(server, SUITE_DATABASE)
        await recreate_database(server, SUITE_DATABASE)
    name = urllib.parse.urlsplit(suite_dsn).path.lstrip("/") or "postgres"
    dbos_database = f"{name}{DBOS_DATABASE_SUFFIX}"
    await recreate_database(suite_dsn, dbos_database)
    return suite_dsn, with_database(suite_dsn, dbos_database)


async def recreate_database(server_dsn: str, database: str, *, create: bool = True) -> None:
    """Drop the benchmark-owned ``database`` (closing its sessions) and create it anew."""
    connection = await asyncpg.connect(server_dsn, timeout=limits.connect_timeout_s)
    try:
        # Identifiers cannot be parameters; the names are this module's constants plus the
        # name of the database the caller gave.
        quoted = '"' + database.replace('"', '""') + '"'
        await connection.execute(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)")
        if create:
            await connection.execute(f"CREATE DATABASE {quoted}")
    finally:
        await connection.close()


# ----------------------------------------------------------------------------- live steps

STEP_NAMES: Final = {"raw": "raw asyncpg: 2 INSERT commits", "wal": "wal-engine tool step",
                     "langgraph": "LangGraph graph step", "dbos": "DBOS step"}


async def start_live_peers(run: Run) -> dict[str, RemotePeer]:
    """Start every active contender in a process of its own, each ready to step."""
    live: dict[str, RemotePeer] = {}
    for spec in run.peers:
        if not run.active(spec.key):
            continue
        peer = RemotePeer(spec.key, spec.name)
        try:
            await peer.start({"dsn": run.dsn, "system_url": run.dbos_url})
        except Exception as error:
            await peer.close()
            if not spec.optional:
                raise
            run.skip(spec.key, f"failed to start: {error}")
            continue
        live[spec.key] = peer
    return live


def step_workloads(run: Run, live: dict[str, RemotePeer]) -> list[harness.Workload]:
    """The ``step`` and ``step64`` workloads over the live contenders."""
    n = CONCURRENT_TASKS

    def workload(name: str, description: str, method: str, events: int,
                 ops: int) -> harness.Workload:
        contenders = [
            remote_contender(peer, STEP_NAMES[key] + ("" if events == 1 else f" x{n}"),
                             method, ops=ops, warmup=LIVE_WARMUP_OPS, events_per_op=events,
                             reference=key == "raw")
            for key, peer in live.items()
        ]
        return harness.Workload(name, description, contenders, ops, warmup_ops=0)

    ops = run.settings.ops
    step_ops = ops if run.settings.quick else max(ops, math.ceil(P99_SAMPLES_MIN
                                                              / run.settings.rounds))
    return [
        workload("step", "one step of one task: its message and tool result durable before "
                 "the next step (the task's history grows over the rounds)", "step_one", 1,
                 step_ops),
        workload(f"step{n}", f"one step of each of {n} tasks at once (events/s = steps/s)",
                 "step_all", n, max(2, ops // 8)),
    ]


async def run_live_workloads(run: Run, names: list[str]) -> None:
    """Phase 1: the live workloads, contenders in their own processes, interleaved."""
    live = await start_live_peers(run)
    try:
        for workload in step_workloads(run, live):
            if workload.name in names:
                run.results.append(await harness.run_workload(workload,
                                                              rounds=run.settings.rounds))
    finally:
        for key, peer in live.items():
            try:
                figures = await peer.close()
            except Exception as error:  # Report it; the other contenders still close.
                print(f"closing {peer.name}: {error}", file=sys.stderr, flush=True)
                continue
            run.live[key] = figures
            run.notes.update({name: value for name, value in figures.items()
                              if name != "peak_rss_mib"})


# ----------------------------------------------------------------------------- histories


def build_arguments(run: Run, key: str, steps: int) -> dict[str, Any]:
    """What the build child of peer ``key`` needs for a history of ``steps`` steps."""
    window = max(1, steps // WINDOW_FRACTION)
    arguments: dict[str, Any] = {"dsn": run.dsn, "steps": steps, "window": window,
                                 "task_id": run.task_id(key, steps)}
    if key == "langgraph":
        from benchmarks.peers_langgraph import REAL_STEPS_MAX

        real_max = QUICK_LANGGRAPH_REAL_STEPS_MAX if run.settings.quick else REAL_STEPS_MAX
        arguments["real_steps_max"] = real_max
        if steps > real_max:
            arguments["window"] = min(window, LANGGRAPH_BULK_WINDOW)
    if key == "dbos":
        arguments.update(system_url=run.dbos_url, system_dsn=run.dbos_url)
    return arguments


async def build_histories(run: Run) -> None:
    """Phase 2: every contender writes its history of each size, one child at a time."""
    from benchmarks import peers_raw, peers_wal

    for steps in run.sizes:
        for peer in run.peers:
            if not run.active(peer.key):
                continue
            if peer.optional and steps > PEER_HISTORY_STEPS_MAX:
                reason = (f"{peer.name} skips the {steps:,}-step history (more than "
                          f"{PEER_HISTORY_STEPS_MAX:,} steps would take too long)")
                run.notes.setdefault("history_skips", []).append(reason)
                print(reason, file=sys.stderr, flush=True)
                continue
            started = time.monotonic()
            try:
                figures = await run_child(peer.key, "build", build_arguments(run, peer.key,
                                                                             steps))
            except Exception as error:
                if not peer.optional:
                    raise
                run.skip(peer.key, f"history build failed: {error}")
                continue
            figures["build_s"] = round(time.monotonic() - started, 1)
            run.builds.setdefault(peer.key, {})[str(steps)] = figures
            print(f"built {peer.name} history of {steps:,} steps in {figures['build_s']} s",
                  file=sys.stderr, flush=True)
        state = await peers_wal.encoded_state(run.dsn, run.task_id("wal", steps))
        await peers_raw.store_state(run.dsn, run.task_id("raw", steps), state)
        run.notes.setdefault("state_bytes", {})[str(steps)] = len(state)


def _warm(operation: harness.Operation) -> Callable[[int], Awaitable[None]]:
    async def before_round(_round: int) -> None:
        await operation()  # Untimed: the pages this contender reads are cached again.
    return before_round


def resume_workload(run: Run, steps: int, ops: int) -> harness.Workload:
    """The floor and every contender's resume of its ``steps``-step task."""
    from benchmarks import peers_raw, peers_wal

    floor = peers_raw.floor_operation(run.dsn, run.task_id("raw", steps), steps)
    contenders = [
        harness.Contender("floor: state row + decode", floor, reference=True,
                          before_round=_warm(floor)),
    ]
    resume = peers_wal.resume_operation(run.dsn, run.task_id("wal", steps), steps)
    contenders.append(harness.Contender("wal-engine resume", resume,
                                        before_round=_warm(resume)))
    if run.active("langgraph") and str(steps) in run.builds.get("langgraph", {}):
        from benchmarks import peers_langgraph

        get = peers_langgraph.resume_operation(run.dsn, run.task_id("langgraph", steps), steps)
        contenders.append(harness.Contender("LangGraph aget_tuple", get,
                                            before_round=_warm(get)))
    if run.active("dbos") and str(steps) in run.builds.get("dbos", {}):
        contenders.append(harness.Contender("DBOS recovery", _dbos_recovery(run, steps)))
    return harness.Workload(
        f"resume@{steps:,}", f"resume a task of {steps:,} steps from a fresh connection "
        "(DBOS: a fresh process)", contenders, ops, warmup_ops=0)


def _dbos_recovery(run: Run, steps: int) -> harness.Operation:
    """Recover the DBOS workflow in a fresh process; time reported by the child."""
    samples = run.recoveries.setdefault(str(steps), [])

    async def operation() -> int:
        executor = (samples[-1] if samples else run.builds["dbos"][str(steps)])["executor_id"]
        figures = await run_child("dbos", "recover", {
            "system_url": run.dbos_url, "steps": steps, "from_executor": executor})
        if figures["recovered"] != 1:
            raise RuntimeError(f"DBOS recovered {figures['recovered']} workflows, not 1")
        samples.append(figures)
        return int(figures["recovery_ns"])

    return operation


async def run_resume_workloads(run: Run) -> None:
    """Phase 3: resume of each history size, contenders interleaved in rounds."""
    rounds = max(RESUME_ROUNDS_MIN, run.settings.rounds // 4)
    ops = 1 if run.settings.quick else RESUME_OPS
    for steps in run.sizes:
        run.results.append(await harness.run_workload(resume_workload(run, steps, ops),
                                                      rounds=rounds))


# ----------------------------------------------------------------------------- agent rows


def agent_dbos_database(run: Run, row: AgentRow) -> str:
    """The name of the DBOS system database of ``row``."""
    name = urllib.parse.urlsplit(run.dsn).path.lstrip("/") or "postgres"
    return f"{name}_dbos_{row.child}"


async def run_agent_rows(run: Run, names: list[str]) -> None:
    """Phase 4: each selected agent row, its contenders in one child process, interleaved."""
    for row in AGENT_ROWS:
        if row.key not in names:
            continue
        missing = first_missing(row.modules)
        if missing is not None:
            reason = f"not installed (no module {missing!r}; {row.extra})"
            run.skipped[row.key] = reason
            print(f"skipping {row.key}: {reason}", file=sys.stderr, flush=True)
            continue
        arguments: dict[str, Any] = {"dsn": run.dsn}
        database = None
        dbos_missing = first_missing(row.dbos_modules)
        if not run.agent_dbos:
            run.skipped[f"{row.key} DBOS"] = "not selected (--peers)"
        elif dbos_missing is not None:
            reason = f"not installed (no module {dbos_missing!r}; {row.dbos_install})"
            run.skipped[f"{row.key} DBOS"] = reason
            print(f"skipping {row.key}'s DBOS contender: {reason}", file=sys.stderr,
                  flush=True)
        else:
            database = agent_dbos_database(run, row)
            await recreate_database(run.dsn, database)
            arguments["system_url"] = with_database(run.dsn, database)
        try:
            await _run_agent_row(run, row, arguments)
        finally:
            if database is not None and not run.keep:
                await recreate_database(run.dsn, database, create=False)


async def _run_agent_row(run: Run, row: AgentRow, arguments: dict[str, Any]) -> None:
    dbos = "system_url" in arguments
    rounds = max(AGENT_ROUNDS_MIN, run.settings.rounds)
    ops = max(AGENT_OPS_MIN, run.settings.ops // AGENT_OPS_DIVISOR)
    steps = OPENAI_AGENTS_QUICK_STEPS if run.settings.quick else OPENAI_AGENTS_STEPS
    arguments["steps"] = steps
    peer = RemotePeer(row.child, row.framework)
    await peer.start(arguments)
    try:
        if row.key == "pydantic-ai":
            await _pydantic_ai_row(run, peer, dbos, rounds, ops)
        else:
            await _openai_agents_row(run, peer, dbos, rounds, ops, steps)
    finally:
        figures = await peer.close()
        run.notes.setdefault("agent_rows", {}).setdefault(row.key, {}).update(figures)


def _agent_contenders(peer: RemotePeer, names: dict[str, str], *, ops: int,
                      events: int) -> list[harness.Contender]:
    return [remote_contender(peer, name, method, ops=ops, warmup=AGENT_WARMUP_OPS,
                             events_per_op=events, reference=index == 0)
            for index, (method, name) in enumerate(names.items())]


PYDANTIC_AI_NAMES: Final = {"in_memory": "Pydantic AI in-memory",
                            "wal": "Pydantic AI + wal-engine WalDurability",
                            "dbos": "Pydantic AI + DBOS DBOSDurability"}
OPENAI_AGENTS_NAMES: Final = {"sdk": "SDK Runner.run in-memory",
                              "wal": "SDK + wal-engine DurableRunner",
                              "dbos": "SDK + DBOS DBOSRunner"}


def _per_step_note(values: dict[str, float], reference: str) -> dict[str, Any]:
    base = values[reference]
    return {"per_step_us": values,
            "per_step_ratio": {name: value / base if base > 0 else None
                               for name, value in values.items()}}


async def _pydantic_ai_row(run: Run, peer: RemotePeer, dbos: bool, rounds: int,
                           ops: int) -> None:
    from benchmarks import pydantic_ai_agent

    steps = pydantic_ai_agent.STEPS
    names = {method: name for method, name in PYDANTIC_AI_NAMES.items()
             if dbos or method != "dbos"}
    workload = harness.Workload(
        "pydantic-ai", f"one Pydantic AI agent run ({pydantic_ai_agent.TOOL_CALLS} tool calls "
        f"and a structured answer: {steps} model requests and tool calls; events = steps)",
        _agent_contenders(peer, names, ops=ops, events=steps), ops, warmup_ops=0)
    result = await harness.run_workload(workload, rounds=rounds)
    run.results.append(result)
    per_step = {c.name: c.p50_us / steps for c in result.contenders}
    run.notes.setdefault("agent_rows", {})["pydantic-ai"] = {
        "steps_per_run": steps, **_per_step_note(per_step, PYDANTIC_AI_NAMES["in_memory"])}


async def _openai_agents_row(run: Run, peer: RemotePeer, dbos: bool, rounds: int, ops: int,
                             steps: int) -> None:
    from benchmarks import openai_agents

    results = []
    for count, suffix in ((1, "1"), (steps, "n")):
        names = {f"{method}_{suffix}": name for method, name in OPENAI_AGENTS_NAMES.items()
                 if dbos or method != "dbos"}
        workload = harness.Workload(
            f"openai-agents@{count}", f"one OpenAI Agents SDK run of {count} model turn(s) "
            "and tool call(s), then an answer; events = steps",
            _agent_contenders(peer, names, ops=ops, events=count), ops, warmup_ops=0)
        results.append(await harness.run_workload(workload, rounds=rounds))
    run.results.extend(results)
    contenders = tuple(name for name in OPENAI_AGENTS_NAMES.values()
                       if any(c.name == name for c in results[0].contenders))
    per_step = openai_agents.per_step_us(results, steps, contenders)
    run.notes.setdefault("agent_rows", {})["openai-agents"] = {
        "steps": steps, **_per_step_note(per_step, OPENAI_AGENTS_NAMES["sdk"])}


# ----------------------------------------------------------------------------- main


def argument_parser() -> argparse.ArgumentParser:
    """The suite's options: the harness's, plus peers and history sizes."""
    parser = harness.argument_parser(NAME, __doc__, rounds=20, ops=50,
                                     database=SUITE_DATABASE)
    parser.prog = "python -m benchmarks"
    parser.add_argument(
        "--peers", type=lambda text: [name for name in text.split(",") if name],
        help="optional peers to run (default: every installed one of langgraph,dbos; "
        "without dbos the agent rows leave their DBOS contender out)")
    parser.add_argument(
        "--keep", action="store_true",
        help=f"keep the databases the suite created ({SUITE_DATABASE}, DBOS's) for inspection")
    parser.add_argument(
        "--sizes", type=lambda text: tuple(int(size) for size in text.split(",") if size),
        help=f"history sizes in steps (default {SIZES}, --quick {QUICK_SIZES}; LangGraph "
        f"and DBOS skip sizes above {PEER_HISTORY_STEPS_MAX:,})")
    return parser


def select_peers(args: argparse.Namespace) -> tuple[list[PeerSpec], dict[str, str]]:
    """The peers this run takes, and why each optional peer left out is left out."""
    wanted = None if args.peers is None else set(args.peers)
    chosen, skipped = [], {}
    for spec in PEERS:
        if spec.optional and wanted is not None and spec.key not in wanted:
            skipped[spec.key] = "not selected (--peers)"
            continue
        missing = missing_module(spec)
        if missing is not None:
            if not spec.optional:
                raise SystemExit(f"{spec.name} needs module {missing!r}")
            skipped[spec.key] = (f"not installed (no module {missing!r}; "
                                 "pip install -e '.[bench]')")
            continue
        chosen.append(spec)
    return chosen, skipped


async def main() -> int:
    """Run the suite; print the report; write the JSON."""
    args = argument_parser().parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=3, quick_ops=10)
    phases = harness.selected(["step", f"step{CONCURRENT_TASKS}", "resume",
                               *(row.key for row in AGENT_ROWS)], args)
    peers, skipped = select_peers(args)
    for key, reason in skipped.items():
        print(f"skipping {key}: {reason}", file=sys.stderr, flush=True)
    dsn, dbos_url = await prepare_databases(args.dsn)
    run = Run(settings=settings, sizes=args.sizes or (QUICK_SIZES if args.quick else SIZES),
              dsn=dsn, dbos_url=dbos_url, run_id=uuid.uuid4().hex[:8], peers=peers,
              skipped=skipped, agent_dbos=args.peers is None or "dbos" in args.peers,
              keep=args.keep)
    started = time.monotonic()
    machine = await harness.describe_machine(dsn)
    machine["packages"].update(peers_report.peer_versions(PEER_PACKAGES))
    try:
        if {"step", f"step{CONCURRENT_TASKS}"} & set(phases):
            await run_live_workloads(run, phases)
        if "resume" in phases:
            await build_histories(run)
            await run_resume_workloads(run)
        await run_agent_rows(run, phases)
    finally:
        if not args.keep:
            await recreate_database(dsn, urllib.parse.urlsplit(dbos_url).path.lstrip("/"),
                                    create=False)
        if not args.dsn and not args.keep:
            # The suite's own database holds a gigabyte after a full run: drop it.
            await recreate_database(with_database(dsn, "postgres"), SUITE_DATABASE,
                                    create=False)
    run.notes["suite_s"] = round(time.monotonic() - started, 1)
    run.notes["dsn"] = redact_dsn(dsn)
    report = peers_report.Report(run, machine)
    print(report.markdown())
    if not args.no_json:
        path = harness.write_json(NAME, machine, run.results, settings, path=args.json_path,
                                  extra=report.extra())
        print(f"Results written to {path}")
    return 0


def entry() -> None:
    """``python -m benchmarks``."""
    harness.run_main(main)


if __name__ == "__main__":
    entry()
