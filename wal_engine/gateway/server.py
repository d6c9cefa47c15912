"""Run the gateway: open the configured store, serve the app with uvicorn."""

from __future__ import annotations

from wal_engine.effects.gateway import GatewayStore, PostgresGatewayStore
from wal_engine.gateway.config import GatewayConfig, sentinel_addresses


async def open_store(config: GatewayConfig) -> GatewayStore:
    """The store ``config.store`` names, opened (the gateway closes it at shutdown)."""
    settings = config.store
    retention_ms = int(config.gateway.retention_s * 1000)
    if settings.kind == "redis":
        from wal_engine.effects.redis_store import RedisGatewayStore

        if settings.sentinels:
            assert settings.service_name is not None  # parse_config requires it.
            store = RedisGatewayStore.from_sentinel(
                sentinel_addresses(settings), settings.service_name, tenant=settings.tenant,
                retention_ms=retention_ms, replicas_min=settings.replicas_min)
        else:
            assert settings.url is not None  # parse_config requires url or sentinels.
            store = RedisGatewayStore.from_url(settings.url, tenant=settings.tenant,
                                               retention_ms=retention_ms,
                                               replicas_min=settings.replicas_min)
        await store.ping()
        return store
    from wal_engine.store import Database

    database = await Database.open(settings.url, tenant=settings.tenant,
                                   development=settings.development or None,
                                   application_name="wal-engine:gateway")
    return PostgresGatewayStore(database, owns_database=True)


async def serve(config: GatewayConfig) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers), then drain and close."""
    import uvicorn

    from wal_engine.gateway.app import CLIENT_KEEPALIVE_S, create_app

    host, port = config.host_port
    app = create_app(config, lambda: open_store(config))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="on",
                                           timeout_keep_alive=CLIENT_KEEPALIVE_S,
                                           timeout_graceful_shutdown=30))
    await server.serve()
