"""Which agents workers serve: an advisory record in ``wal_workers`` (schema.sql, section
"Worker registrations").

A worker (``wal-engine worker`` or ``engine.worker().run()``) records its id and agents when
it starts and again every ``refresh_every_s_default`` while it runs, so a worker that has
served for days still counts as recent; ``wal-engine submit`` reads the recent records to
warn about a task that no worker would claim (an agent name misspelt, or its worker not
deployed). Nothing claims through it: a
worker that never registered still runs every task of its agents.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from wal_engine.runtime.ports import AgentSpec
from wal_engine.store import Database

recent_window_s_default: Final = 86_400
"""How far back ``submit`` looks for registrations (a day)."""
workers_read_max: Final = 500
refresh_every_s_default: Final = 3_600.0
"""How often a running worker records its agents again: well inside ``recent_window_s_default``
(registered only at start, a worker running for more than a day made ``submit`` warn that
no worker served its agents)."""

RECORD_WORKER: Final = """
INSERT INTO wal_workers (tenant, worker_id, agents, seen_at)
SELECT current_setting('wal.tenant', true), $1, $2::text[], now()
  FROM wal_prune_workers()
ON CONFLICT (tenant, worker_id) DO UPDATE SET agents = EXCLUDED.agents, seen_at = now()
"""
"""Record a worker, and forget its tenant's registrations a week old (worker ids are per
process: without the prune every restart would leave a row for ever)."""

RECENT_AGENTS: Final = """
SELECT worker_id, agents FROM wal_workers
 WHERE tenant = current_setting('wal.tenant', true)
   AND seen_at > now() - make_interval(secs => $1)
 ORDER BY seen_at DESC
 LIMIT $2
"""


async def record_worker(database: Database, worker_id: str, agents: Iterable[str]) -> None:
    """Record (or refresh) that ``worker_id`` serves ``agents``, and prune the tenant's
    registrations not renewed for a week (one statement)."""
    await database.fetch(RECORD_WORKER, worker_id, sorted(agents))


async def recent_agents(database: Database, *,
                        within_s: float = recent_window_s_default) -> set[str]:
    """Every agent a worker of this tenant registered within the last ``within_s``."""
    rows = await database.fetch(RECENT_AGENTS, float(within_s), workers_read_max)
    return {agent for row in rows for agent in row["agents"]}


def runnable_versions(agents: Mapping[str, AgentSpec]) -> tuple[list[str], list[str]]:
    """``(agents, versions)``: every agent and version of ``agents`` that a worker can run,
    as the claim statement takes them (each agent's own version first)."""
    names: list[str] = []
    versions: list[str] = []
    for name in sorted(agents):
        for version in agents[name].runs:
            names.append(name)
            versions.append(version)
    return names, versions
