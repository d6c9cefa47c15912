"""The ``wal-engine`` command line (thin: parses, calls the engine, renders)."""

from __future__ import annotations

import asyncio

import click


@click.group()
def main() -> None:
    """wal-engine: durable LLM-agent tasks on a PostgreSQL write-ahead log."""


@main.command()
@click.option("--dsn", envvar="WAL_ENGINE_DSN", default=None,
              help="PostgreSQL DSN (default: WAL_ENGINE_DSN, else the embedded server).")
def demo(dsn: str | None) -> None:
    """Run the crash-and-resume demo end to end on the embedded PostgreSQL."""
    from wal_engine.demo_show import run_demo

    if not asyncio.run(run_demo(dsn=dsn)):
        raise SystemExit(1)
