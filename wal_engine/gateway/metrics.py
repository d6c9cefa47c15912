"""The gateway's Prometheus metrics, in a registry of its own (served on /_gateway/metrics)."""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

UPSTREAM_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                             2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    """Requests by route and outcome, and upstream latency by route."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "wal_gateway_requests", "Requests answered, by route and outcome (forwarded, "
            "replayed, conflict, mismatch, bad_key, passed, in_doubt, store_unavailable...)",
            ["route", "outcome"], registry=self.registry)
        self._upstream = Histogram(
            "wal_gateway_upstream_seconds", "Time the upstream took to answer, by route",
            ["route"], buckets=UPSTREAM_BUCKETS_S, registry=self.registry)

    def request(self, route: str, outcome: str) -> None:
        """Count one answered request."""
        self._requests.labels(route=route, outcome=outcome).inc()

    def upstream(self, route: str, seconds: float) -> None:
        """Observe one upstream round trip."""
        self._upstream.labels(route=route).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
