"""The Idempotency-Key header, the request fingerprint and the gateway's config file."""

from __future__ import annotations

from typing import Any

import pytest

from wal_engine.effects.gateway import check_key
from wal_engine.errors import ConfigurationError
from wal_engine.gateway.app import key_in_store
from wal_engine.gateway.config import parse_config, sentinel_addresses
from wal_engine.gateway.keys import MalformedKey, fingerprint, format_key, parse_key


@pytest.mark.parametrize(("values", "key"), [
    ([], None),
    (['"abc-123"'], "abc-123"),
    (['  "with space"  '], "with space"),
    ([r'"quote \" and backslash \\"'], 'quote " and backslash \\'),
    (["bare-token_1:2"], "bare-token_1:2"),
])
def test_keys_the_draft_and_common_clients_send_are_parsed(values: list[str],
                                                           key: str | None) -> None:
    """A quoted sf-string (unescaped) or a bare token is the key; no header is None."""
    assert parse_key(values, 64) == key


@pytest.mark.parametrize("values", [
    ['""'], ['"a'], ['"a" "b"'], ['"a", "b"'], ["a b"], ["a;b"], ['"t\tab"'], ["é"],
    ['"x"', '"y"'], ['"' + "k" * 65 + '"'],
])
def test_malformed_repeated_or_oversized_keys_are_refused(values: list[str]) -> None:
    """Anything but one key of at most 64 characters is MalformedKey."""
    with pytest.raises(MalformedKey):
        parse_key(values, 64)


@pytest.mark.parametrize("key", ["idem:task-1:7", 'a"b\\c', " "])
def test_format_key_round_trips_through_parse_key(key: str) -> None:
    """What the HTTP tool sends is what the gateway reads."""
    assert parse_key([format_key(key)], 400) == key


def test_format_key_refuses_what_a_header_cannot_carry() -> None:
    """Non-ASCII or empty keys cannot be sent as an sf-string."""
    for key in ("", "ключ", "a\nb"):
        with pytest.raises(MalformedKey):
            format_key(key)


def test_fingerprint_separates_every_part() -> None:
    """Method, target, content type and body each change the fingerprint; parts cannot be
    shifted into each other."""
    base = fingerprint("POST", "/a", "json", b"x")
    assert len({base, fingerprint("PUT", "/a", "json", b"x"),
                fingerprint("POST", "/a?q", "json", b"x"),
                fingerprint("POST", "/a", "text", b"x"),
                fingerprint("POST", "/a", "json", b"y"),
                fingerprint("POST", "/aj", "son", b"x")}) == 6
    assert fingerprint("POST", "/a", "json", b"x") == base


def config(**route: Any) -> dict[str, Any]:
    """A minimal valid config, one route changed by ``route``."""
    return {"store": {"kind": "redis", "url": "redis://127.0.0.1:1/0"},
            "routes": [{"name": "r", "prefix": "/r", "upstream": "http://127.0.0.1:1",
                        **route}]}


def test_a_minimal_config_gets_the_defaults() -> None:
    """Only store and one route are required; the lease defaults to the timeout plus 5 s."""
    parsed = parse_config(config())
    assert parsed.host_port == ("127.0.0.1", 8080)
    assert parsed.routes[0].lease_ms == 35_000 and parsed.routes[0].missing_key == "pass"
    assert parsed.routes[0].release_statuses == [429, 503]


def test_the_longest_key_of_the_longest_route_name_fits_the_store() -> None:
    """A route name of 64 characters, a scope digest and a 400-character key make a store
    key the stores accept (a longer name made every long key a 500)."""
    parsed = parse_config({**config(name="n" * 64), "gateway": {"key_chars_max": 400}})
    key = "k" * parsed.gateway.key_chars_max
    assert check_key(key_in_store(parsed.routes[0].name, "token", key)).endswith(key)


@pytest.mark.parametrize(("route", "message"), [
    ({"prefix": "/_gateway/x"}, "prefix"),
    ({"upstream": "ftp://x"}, "upstream"),
    ({"lease_s": 1.0, "timeout_s": 2.0}, "lease_s must exceed timeout_s"),
    ({"missing_key": "maybe"}, "missing_key"),
    ({"unknown": 1}, "unknown"),
    ({"methods": ["post"]}, "upper case"),
    ({"name": "a:b"}, "name must be"),
    ({"name": "n" * 65}, "name must be"),
    ({"release_statuses": [200]}, "release_statuses"),
])
def test_bad_configs_name_the_field(route: dict[str, Any], message: str) -> None:
    """A bad route is a ConfigurationError naming what is wrong."""
    with pytest.raises(ConfigurationError, match=message):
        parse_config(config(**route))


@pytest.mark.parametrize(("store", "message"), [
    ({"kind": "redis", "url": "redis://h:1/0", "sentinels": ["h:2"], "service_name": "m"},
     "not both"),
    ({"kind": "redis", "sentinels": ["h:2"]}, "go together"),
    ({"kind": "redis", "sentinels": ["nohost"], "service_name": "m"}, "HOST:PORT"),
    ({"kind": "redis", "url": "redis://h:1/0", "replicas_min": -1}, "replicas_min"),
    ({"kind": "postgres", "replicas_min": 1}, "for a redis store"),
])
def test_bad_store_tables_name_the_field(store: dict[str, Any], message: str) -> None:
    """A Redis store is a URL or Sentinels with a service name, never both."""
    with pytest.raises(ConfigurationError, match=message):
        parse_config({**config(), "store": store})


def test_a_sentinel_store_parses() -> None:
    """Sentinels, a service name and replicas_min make a Redis store without a URL."""
    parsed = parse_config({**config(), "store": {
        "kind": "redis", "sentinels": ["127.0.0.1:26379", "[::1]:26380"],
        "service_name": "primary", "replicas_min": 1}})
    assert sentinel_addresses(parsed.store) == [("127.0.0.1", 26379), ("::1", 26380)]


def test_a_redis_store_needs_a_url_and_routes_are_required() -> None:
    """Store and routes are checked as a whole."""
    with pytest.raises(ConfigurationError, match=r"store\.url"):
        parse_config({"store": {"kind": "redis"}, "routes": config()["routes"]})
    with pytest.raises(ConfigurationError, match="at least one"):
        parse_config({"store": {"kind": "postgres"}, "routes": []})
