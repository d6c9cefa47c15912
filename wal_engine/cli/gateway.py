"""``wal-engine gateway``: run the HTTP idempotency gateway (the ``gateway`` extra)."""

from __future__ import annotations

from pathlib import Path

import click

from wal_engine.cli.common import EXIT_USAGE, CliError, run


@click.command()
@click.option("--config", "config_path", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The gateway's TOML file: listen address, store, retention, routes.")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Override gateway.listen from the file.")
@click.option("--check", is_flag=True, help="Check the file and exit without serving.")
def gateway(config_path: Path, listen: str | None, check: bool) -> None:
    """Serve the HTTP idempotency gateway in front of the configured upstream APIs.

    A request with an Idempotency-Key header is forwarded once; repeats with the same key
    and body get the stored response, 409 while the first is in flight, 422 for a
    different body (draft-ietf-httpapi-idempotency-key-header). Health on
    /_gateway/health, Prometheus metrics on /_gateway/metrics.
    """
    run(_gateway(config_path, listen, check))


async def _gateway(config_path: Path, listen: str | None, check: bool) -> None:
    try:
        import httpx  # noqa: F401 -- only asks whether the extra is installed
        import starlette  # noqa: F401 -- likewise
        import uvicorn  # noqa: F401 -- likewise
    except ImportError as error:
        raise CliError("the gateway needs its extra: pip install 'wal-engine[gateway]' "
                       f"({error.name} is missing)", EXIT_USAGE) from error
    from wal_engine.gateway.config import load_config
    from wal_engine.gateway.server import serve

    config = load_config(config_path, listen=listen)
    if check:
        click.echo(f"{config_path}: {len(config.routes)} route(s), {config.store.kind} store")
        return
    await serve(config)
