"""The ``wal-engine`` command line (thin: parses, calls the engine, renders).

Every command on the log takes ``--dsn`` (default ``WAL_ENGINE_DSN``, else the embedded
server), and those that open an engine take ``--development`` (the security self-test
then lets a superuser through); ``wal-engine --tenant T <command>`` works on tenant T's
tasks only (default ``WAL_ENGINE_TENANT``, else ``default``); reading commands take
``--json`` for one JSON object per line. ``tenant create|list|rotate|disable|enable``
provisions tenants' login roles on an administrator's DSN. ``schedule
add|list|pause|resume|delete`` manages cron and interval schedules; ``limiters`` lists
the rate limiters and their state, ``limiter set|delete`` defines them. ``queues`` shows
each queue's depth, running tasks, limits and oldest wait; ``queue set NAME --concurrency N
--worker-concurrency M`` creates a queue or changes its limits (audited: ``queue history``).
``retention plan|run`` archives finished tasks older than a policy, then removes them (an
administrator's DSN); ``verify --archive FILE`` checks such an archive offline. ``bench``
hands its arguments to the benchmark suite (``python -m benchmarks``). Errors are one line
on standard error with the exit codes listed in :mod:`wal_engine.cli.common`.
"""

from __future__ import annotations

import click

from wal_engine import __version__
from wal_engine.cli.anchoring import anchor, anchor_keygen
from wal_engine.cli.audit import history, show, tasks, verify
from wal_engine.cli.common import MainGroup, tenant_option
from wal_engine.cli.embedded import embedded
from wal_engine.cli.gateway import gateway
from wal_engine.cli.limiters import limiter, limiters
from wal_engine.cli.operate import bench, migrate, replay, timeline, worker
from wal_engine.cli.operate import demo as demo_command
from wal_engine.cli.operator import pending, reconcile, timer
from wal_engine.cli.queues import queue, queues
from wal_engine.cli.retention import retention
from wal_engine.cli.schedule import schedule
from wal_engine.cli.setup import setup
from wal_engine.cli.steer import approve, cancel, fork, signal, submit
from wal_engine.cli.tenant import tenant

# The demo command under another name: ``wal_engine.cli.demo`` is the demo's module, and
# binding the command as ``demo`` here would hide it from ``from wal_engine.cli import demo``.


@click.group(cls=MainGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="wal-engine")
@tenant_option
def main(tenant: str | None) -> None:
    """wal-engine: durable LLM-agent tasks on a PostgreSQL write-ahead log."""


for command in (demo_command, worker, submit, tasks, history, show, verify, anchor, anchor_keygen,
                signal, approve, cancel, fork, replay, migrate, setup, timeline, bench, tenant,
                gateway, embedded, pending, reconcile, timer, schedule, limiters, limiter,
                queues, queue, retention):
    main.add_command(command)

__all__ = ["main"]
