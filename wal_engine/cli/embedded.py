"""``wal-engine embedded path|status|stop``: the embedded PostgreSQL server of this project.

Without ``WAL_ENGINE_DSN`` (or ``--dsn``) every command runs on an embedded server, one
per project: the nearest directory up from the working directory holding a
``pyproject.toml``, ``setup.py``, ``setup.cfg`` or ``.git`` (outside any project, one per
user); ``WAL_ENGINE_DATA_DIR`` names another. The server keeps running after a command so
that the next one starts in milliseconds; ``stop`` ends it.
"""

from __future__ import annotations

from pathlib import Path

import click

from wal_engine.cli.common import console, emit, json_option, run
from wal_engine.embedded.layout import default_data_dir
from wal_engine.embedded.status import ServerStatus, known_data_dirs, status_of


@click.group()
def embedded() -> None:
    """The embedded PostgreSQL server of this project: path, status, stop."""


@embedded.command("path")
def path_command() -> None:
    """Print the data directory this working directory's commands use."""
    click.echo(str(default_data_dir()))


@embedded.command()
@click.option("--all", "every", is_flag=True,
              help="Every embedded server of this user, not only this project's.")
@json_option
def status(every: bool, as_json: bool) -> None:
    """Where the server lives, its project, whether it runs, stale or foreign."""
    here = default_data_dir()
    dirs = known_data_dirs() if every else [here]
    if every and here.resolve() not in {d.resolve() for d in dirs}:
        dirs.insert(0, here)
    found = [status_of(directory, current=here) for directory in dirs]
    if as_json:
        for item in found:
            emit(item.to_json())
        return
    out = console()
    for item in found:
        out.print(_describe(item), soft_wrap=True, markup=False)


def _describe(item: ServerStatus) -> str:
    state = (f"running (pid {item.pid}, port {item.port})" if item.running
             else "not running")
    notes = []
    if item.current:
        notes.append("this project's")
    if item.stale:
        notes.append(f"stale: its project {item.project} no longer exists")
    if item.foreign_binaries:
        notes.append(f"foreign: started by other binaries ({item.foreign_binaries})")
    project = f"project {item.project}" if item.project else "no project recorded yet"
    extra = f" [{'; '.join(notes)}]" if notes else ""
    return f"{item.data_dir}: {state}; {project}{extra}"


@embedded.command()
@click.option("--immediate", is_flag=True,
              help="Kill the server at once (recovery runs at the next start) instead of "
                   "a clean shutdown.")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Another data directory (from `embedded status --all`).")
def stop(immediate: bool, data_dir: Path | None) -> None:
    """Stop this project's embedded server (its data stays)."""
    from wal_engine.embedded.server import EmbeddedPostgres

    target = data_dir or default_data_dir()
    before = status_of(target)

    async def _stop() -> None:
        import asyncio

        await asyncio.to_thread(EmbeddedPostgres(target).stop,
                                "immediate" if immediate else "fast")

    run(_stop())
    click.echo(f"{before.data_dir}: " + ("stopped" if before.running else "was not running"))
