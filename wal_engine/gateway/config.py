"""The gateway's configuration file (TOML): listen address, store, retention, routes.

Example::

    [gateway]
    listen = "127.0.0.1:8080"
    retention_s = 86400          # how long a stored response is replayed
    key_chars_max = 255          # longer Idempotency-Key values get 400

    [store]
    kind = "redis"               # or "postgres"
    url = "redis://127.0.0.1:6379/0"   # for postgres: its DSN (default WAL_ENGINE_DSN)

    [[routes]]
    name = "payments"
    prefix = "/payments"         # longest matching prefix wins
    upstream = "http://127.0.0.1:9000"
    methods = ["POST", "PATCH"]  # the methods deduplicated; others pass through
    missing_key = "refuse"       # or "pass": forward keyless requests as they are
    concurrent = "reject"        # 409 while the first is in flight; or "wait"
    in_doubt = "refuse"          # a holder died mid-request: 502; or "forward" again

Every field but ``store`` and ``routes`` has a default; a bad file is a
:class:`~wal_engine.errors.ConfigurationError` naming the field.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Final, Literal

import msgspec

from wal_engine.errors import ConfigurationError

RESERVED_PREFIX: Final = "/_gateway"
"""Where the gateway's own endpoints live (health, metrics); no route may use it."""
ROUTE_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A route name is part of every store key (``http:NAME:SCOPE:KEY``) and a metrics label:
no ``:`` (two routes' keys could then collide) and short enough that the longest accepted
Idempotency-Key still fits the store's key limit."""


class GatewaySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[gateway]`` table."""

    listen: str = "127.0.0.1:8080"
    retention_s: float = 24 * 3600.0
    key_chars_max: int = 255
    request_bytes_max: int = 1024 * 1024
    response_bytes_max: int = 4 * 1024 * 1024
    expire_every_s: float = 60.0
    """How often settled keys past retention are deleted (the store's TTL is the backstop)."""


class StoreSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[store]`` table."""

    kind: Literal["redis", "postgres"]
    url: str | None = None
    sentinels: list[str] = msgspec.field(default_factory=list)
    """Redis only, instead of ``url``: Sentinels (``"HOST:PORT"``) that name the primary of
    ``service_name``; after a failover the gateway finds the new primary by itself."""
    service_name: str | None = None
    replicas_min: int = 0
    """Redis only: replicas that must hold each claim and response before it counts (Redis
    ``WAIT``), so a failover to such a replica loses none (see docs/gateway.md)."""
    tenant: str | None = None
    development: bool = False
    """PostgreSQL only: let a superuser through the security self-test (tests, laptops)."""


class Route(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[routes]]`` entry: requests under ``prefix`` go to ``upstream``."""

    name: str
    prefix: str
    upstream: str
    methods: list[str] = msgspec.field(default_factory=lambda: ["POST", "PATCH"])
    missing_key: Literal["pass", "refuse"] = "pass"
    concurrent: Literal["reject", "wait"] = "reject"
    wait_s: float = 10.0
    in_doubt: Literal["refuse", "forward"] = "refuse"
    timeout_s: float = 30.0
    lease_s: float | None = None
    """How long a claim lasts without an answer; must exceed ``timeout_s`` (default: it
    plus 5 s), so an expired claim means its gateway died."""
    strip_prefix: bool = False
    scope_header: str | None = None
    """A header (for example Authorization) whose value scopes keys: two clients' equal
    keys are then different keys."""
    release_statuses: list[int] = msgspec.field(default_factory=lambda: [429, 503])
    """Upstream answers that say the request was not acted on: passed to the client but not
    stored, and the key released, so a retry under the same key is forwarded again (what
    ``http_tool`` does on 429 and 503). Empty: every answer is stored."""

    @property
    def lease_ms(self) -> int:
        """The claim lease in milliseconds."""
        lease_s = self.lease_s if self.lease_s is not None else self.timeout_s + 5.0
        return int(lease_s * 1000)


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole file."""

    store: StoreSettings
    routes: list[Route]
    gateway: GatewaySettings = msgspec.field(default_factory=GatewaySettings)

    @property
    def host_port(self) -> tuple[str, int]:
        """``gateway.listen`` split."""
        host, _, port = self.gateway.listen.rpartition(":")
        return host.strip("[]") or "127.0.0.1", int(port)


def load_config(path: Path, *, listen: str | None = None) -> GatewayConfig:
    """Read and check the file at ``path``; ``listen`` overrides ``gateway.listen``."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as error:
        raise ConfigurationError(f"gateway config {path}: {error.strerror}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigurationError(f"gateway config {path}: {error}") from error
    if listen is not None:
        settings = raw.get("gateway")
        raw["gateway"] = {**(settings if isinstance(settings, dict) else {}), "listen": listen}
    return parse_config(raw, str(path))


def parse_config(raw: object, source: str = "<config>") -> GatewayConfig:
    """A checked :class:`GatewayConfig` from parsed TOML (or any plain mapping)."""
    try:
        config = msgspec.convert(raw, GatewayConfig)
    except msgspec.ValidationError as error:
        raise ConfigurationError(f"gateway config {source}: {error}") from error
    problems = [*_settings_problems(config), *_route_problems(config.routes)]
    if problems:
        raise ConfigurationError(f"gateway config {source}: " + "; ".join(problems))
    return config


def _settings_problems(config: GatewayConfig) -> list[str]:
    problems: list[str] = []
    settings = config.gateway
    try:
        config.host_port  # noqa: B018 -- evaluated only to see that listen parses
    except ValueError:
        problems.append(f"gateway.listen must be HOST:PORT, not {settings.listen!r}")
    if settings.retention_s <= 0:
        problems.append("gateway.retention_s must be > 0")
    if not 1 <= settings.key_chars_max <= 400:
        problems.append("gateway.key_chars_max must be between 1 and 400")
    if settings.request_bytes_max < 1 or settings.response_bytes_max < 1:
        problems.append("gateway.request_bytes_max and response_bytes_max must be >= 1")
    problems += _store_problems(config.store)
    if not config.routes:
        problems.append("at least one [[routes]] entry is required")
    return problems


def _store_problems(store: StoreSettings) -> list[str]:
    if store.kind == "postgres":
        if store.sentinels or store.service_name or store.replicas_min:
            return ["store.sentinels, service_name and replicas_min are for a redis store"]
        return []
    problems: list[str] = []
    if bool(store.url) == bool(store.sentinels):
        problems.append("store.url is required for a redis store (or store.sentinels "
                        "instead, not both)")
    if bool(store.sentinels) != bool(store.service_name):
        problems.append("store.sentinels and store.service_name go together")
    for address in store.sentinels:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            problems.append(f"store.sentinels: {address!r} is not HOST:PORT")
    if store.replicas_min < 0:
        problems.append("store.replicas_min must be >= 0")
    return problems


def sentinel_addresses(store: StoreSettings) -> list[tuple[str, int]]:
    """``store.sentinels`` as (host, port) pairs."""
    pairs = [address.rpartition(":") for address in store.sentinels]
    return [(host.strip("[]"), int(port)) for host, _, port in pairs]


def _route_problems(routes: list[Route]) -> list[str]:
    problems: list[str] = []
    names: set[str] = set()
    for route in routes:
        where = f"route {route.name!r}"
        if not ROUTE_NAME.fullmatch(route.name):
            problems.append(f"{where}: name must be 1 to 64 letters, digits, '_', '.' or '-'")
        if route.name in names:
            problems.append(f"{where} is defined twice")
        names.add(route.name)
        if not route.prefix.startswith("/") or route.prefix.startswith(RESERVED_PREFIX):
            problems.append(f"{where}: prefix must start with / and not {RESERVED_PREFIX}")
        if not route.upstream.startswith(("http://", "https://")):
            problems.append(f"{where}: upstream must be an http:// or https:// URL")
        if route.timeout_s <= 0 or route.wait_s < 0:
            problems.append(f"{where}: timeout_s must be > 0 and wait_s >= 0")
        if route.lease_ms <= route.timeout_s * 1000:
            problems.append(f"{where}: lease_s must exceed timeout_s")
        if any(method.upper() != method for method in route.methods):
            problems.append(f"{where}: methods must be upper case")
        if any(not 400 <= status <= 599 for status in route.release_statuses):
            problems.append(f"{where}: release_statuses must be 4xx or 5xx statuses")
    return problems
