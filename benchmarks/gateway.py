"""The HTTP idempotency gateway: what it adds per request, and what one process carries.

All real processes on this machine: the counting upstream (``wal_engine.testing.upstream``,
one uvicorn process), ``wal-engine gateway`` twice (one process each, one on Redis with AOF
``appendfsync always``, one on PostgreSQL), and the load generator (this process, httpx, one
keep-alive client per target).

* **latency**: one request at a time. Reference: the same POST sent straight to the upstream.
  Contenders: through the gateway with a new key (claim, forward, record: the miss path), and
  a repeat of a stored key (the dedup hit path: read and replay, the upstream not reached),
  each on Redis and on PostgreSQL. The ratio column is the gateway's cost over the direct call.
* **throughput**: each operation sends ``--concurrency`` requests at once (new keys), so
  events/s is requests/s; the same against the upstream alone is the reference. The load
  generator shares the machine's cores with the gateway and the upstream, so requests/s
  depends on everything else the machine runs; the CPU time the gateway process itself
  spends per request (``/proc/PID/stat`` before and after 20 x ``--ops`` requests) does
  not, and gives the requests/s one process can serve on a core of its own.

Usage: ``python -m benchmarks.gateway [--dsn DSN] [--quick] [--rounds N] [--ops N]
[--concurrency N]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import httpx

from benchmarks import harness
from wal_engine.testing.gateway_processes import GatewayProcess, Upstream, route
from wal_engine.testing.redis_server import RedisServer

NAME: Final = "gateway"
BODY: Final = b'{"amount": 100, "currency": "EUR", "note": "benchmark"}'
HEADERS: Final = {"content-type": "application/json"}


class Targets:
    """The processes and one client per target."""

    def __init__(self, upstream: Upstream, gateways: dict[str, GatewayProcess]) -> None:
        # Idle connections expire before the upstream's (uvicorn's 5 s) keep-alive does, so
        # a round never reuses a connection the server is closing.
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256,
                              keepalive_expiry=2.0)
        self.direct = httpx.AsyncClient(base_url=upstream.url, timeout=30, limits=limits)
        self.through = {name: httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                                limits=limits)
                        for name, gateway in gateways.items()}

        self.pids: dict[str, int] = {}

    async def close(self) -> None:
        """Close every client."""
        for client in (self.direct, *self.through.values()):
            await client.aclose()


async def post(client: httpx.AsyncClient, key: str | None) -> None:
    """One POST; an unexpected status is a broken benchmark, not a figure."""
    headers = HEADERS if key is None else {**HEADERS, "idempotency-key": f'"{key}"'}
    response = await client.post("/pay/charges", content=BODY, headers=headers)
    if response.status_code != 201:
        raise RuntimeError(f"unexpected {response.status_code}: {response.text[:200]}")


def new_key_op(client: httpx.AsyncClient) -> Callable[[], Awaitable[None]]:
    """A POST under a key never used before (the miss path)."""
    async def operation() -> None:
        await post(client, str(uuid.uuid4()))

    return operation


def hit_op(client: httpx.AsyncClient) -> tuple[Callable[[], Awaitable[None]],
                                               Callable[[int], Awaitable[None]]]:
    """A repeat of a key stored before the round (the hit path), and its untimed set-up."""
    key = [str(uuid.uuid4())]

    async def before_round(_: int) -> None:
        key[0] = str(uuid.uuid4())
        await post(client, key[0])

    async def operation() -> None:
        await post(client, key[0])

    return operation, before_round


def latency_workload(targets: Targets, ops: int) -> harness.Workload:
    """One request at a time: direct, then each store's miss and hit paths."""
    contenders = [harness.Contender("direct to upstream", lambda: post(targets.direct, None),
                                    reference=True)]
    for name, client in targets.through.items():
        contenders.append(harness.Contender(f"gateway {name}, new key", new_key_op(client)))
        operation, before_round = hit_op(client)
        contenders.append(harness.Contender(f"gateway {name}, repeat (dedup hit)", operation,
                                            before_round=before_round))
    return harness.Workload(name="latency", description="one POST at a time; ratio = added "
                            "cost of the gateway over the direct call", contenders=contenders,
                            ops_per_round=ops, warmup_ops=3)


def burst(client: httpx.AsyncClient, concurrency: int, keyed: bool) -> Callable[[],
                                                                               Awaitable[None]]:
    """``concurrency`` POSTs at once, each under a new key when ``keyed``."""
    async def operation() -> None:
        await asyncio.gather(*(post(client, str(uuid.uuid4()) if keyed else None)
                               for _ in range(concurrency)))

    return operation


def throughput_workload(targets: Targets, ops: int, concurrency: int) -> harness.Workload:
    """Bursts of concurrent new-key requests; events/s is requests/s."""
    contenders = [harness.Contender("direct to upstream", burst(targets.direct, concurrency,
                                                                False),
                                    events_per_op=concurrency, reference=True)]
    contenders += [harness.Contender(f"gateway {name}, new keys",
                                     burst(client, concurrency, True),
                                     events_per_op=concurrency)
                   for name, client in targets.through.items()]
    return harness.Workload(name="throughput", description=f"{concurrency} concurrent POSTs "
                            "per op through one gateway process; events/s = requests/s",
                            contenders=contenders, ops_per_round=ops, warmup_ops=1)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def cpu_per_request(client: httpx.AsyncClient, pid: int, requests: int,
                          concurrency: int, keyed: bool) -> float:
    """CPU microseconds the process ``pid`` spends per request over ``requests`` new-key
    requests: a figure the other processes on the machine do not change, unlike requests/s."""
    operation = burst(client, concurrency, keyed)
    await operation()
    before = cpu_seconds(pid)
    for _ in range(max(1, requests // concurrency)):
        await operation()
    return (cpu_seconds(pid) - before) * 1e6 / (max(1, requests // concurrency) * concurrency)


async def cpu_figures(targets: Targets, pids: dict[str, int], requests: int,
                      concurrency: int) -> dict[str, float]:
    """CPU µs per request: the upstream served directly, and each gateway process (its own
    CPU only: the upstream's and the store's are not in it)."""
    figures = {"upstream, direct": await cpu_per_request(
        targets.direct, pids["upstream"], requests, concurrency, keyed=False)}
    for name, client in targets.through.items():
        figures[f"gateway {name}, new keys"] = await cpu_per_request(
            client, pids[name], requests, concurrency, keyed=True)
    return figures


@contextlib.asynccontextmanager
async def processes(dsn: str, work_dir: Path) -> AsyncIterator[Targets]:
    """Upstream, Redis and the two gateways, killed at the end."""
    upstream = Upstream(work_dir)
    redis = RedisServer(persistence="aof", data_dir=work_dir / "redis").start()
    gateways: dict[str, GatewayProcess] = {}
    try:
        gateways["redis"] = GatewayProcess(
            {"kind": "redis", "url": redis.url}, [route("pay", upstream)], work_dir).start()
        gateways["postgres"] = GatewayProcess(
            {"kind": "postgres", "url": dsn, "development": True}, [route("pay", upstream)],
            work_dir).start()
        targets = Targets(upstream, gateways)
        targets.pids = {"upstream": upstream.process.pid,
                        **{name: _pid(gateway) for name, gateway in gateways.items()}}
        try:
            yield targets
        finally:
            await targets.close()
    finally:
        for gateway in gateways.values():
            gateway.close()
        redis.close()
        upstream.close()


def _pid(gateway: GatewayProcess) -> int:
    assert gateway.process is not None
    return gateway.process.pid


def summary(results: list[harness.WorkloadResult], cpu: dict[str, float]) -> str:
    """The added latency per request in plain words."""
    latency = next((r for r in results if r.name == "latency"), None)
    if latency is None:
        return ""
    direct = latency.contender("direct to upstream")
    lines = ["", "Added latency per request over the direct call (p50 / p99, microseconds):"]
    for result in latency.contenders:
        if result.reference:
            continue
        lines.append(f"- {result.name}: +{result.p50_us - direct.p50_us:,.0f} / "
                     f"+{result.p99_us - direct.p99_us:,.0f}")
    if cpu:
        lines += ["", "CPU per request of one process (µs; requests/s it could serve on one "
                      "core of its own):"]
        lines += [f"- {name}: {micros:,.0f} ({1e6 / micros:,.0f}/s)" if micros else
                  f"- {name}: below the clock's resolution" for name, micros in cpu.items()]
    return "\n".join(lines)


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=10, ops=100)
    parser.add_argument("--concurrency", type=int, default=32,
                        help="requests in flight per throughput operation (default 32)")
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=2, quick_ops=5)
    dsn = await harness.resolve_bench_dsn(args.dsn)
    machine = await harness.describe_machine(dsn)
    names = harness.selected(["latency", "throughput"], args)
    results: list[harness.WorkloadResult] = []
    cpu: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="wal-bench-gateway-") as work:
        async with processes(dsn, Path(work)) as targets:
            if "latency" in names:
                results.append(await harness.run_workload(
                    latency_workload(targets, settings.ops), rounds=settings.rounds))
            if "throughput" in names:
                burst_ops = max(1, settings.ops // 10)
                results.append(await harness.run_workload(
                    throughput_workload(targets, burst_ops, args.concurrency),
                    rounds=settings.rounds))
                cpu = await cpu_figures(targets, targets.pids, settings.ops * 20,
                                        args.concurrency)
    print(harness.format_report(NAME, machine, results, settings))
    print(summary(results, cpu))
    if not args.no_json:
        extra: dict[str, Any] = {"concurrency": args.concurrency, "redis": "AOF always",
                                 "cpu_us_per_request": cpu}
        path = harness.write_json(NAME, machine, results, settings, path=args.json_path,
                                  extra=extra)
        print(f"Results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
