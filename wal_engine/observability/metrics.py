"""Prometheus metrics of the engine, behind the optional ``metrics`` extra.

With ``prometheus-client`` installed (``pip install 'wal-engine[metrics]'``) the engine
counts into the default registry, and ``wal-engine worker --metrics-port N`` serves it.
Without it every hook below is a function call that tests one module global and returns:
nothing is imported, allocated or timed.

The hooks are single calls placed in the engine where the thing happens:

========================================  ====================================================
``wal_engine_events_appended_total``      events accepted by fenced appends
``wal_engine_append_statements_total``    append statements sent, by ``path`` (single, group)
``wal_engine_append_seconds``             latency of one append statement, by ``path``
``wal_engine_tasks_claimed_total``        claims (a task leased by a worker)
``wal_engine_tasks_orphaned_total``       leases broken because their worker stopped renewing
``wal_engine_call_retries_total``         tool/LLM attempts retried, by ``kind`` and ``reason``
``wal_engine_budget_trips_total``         tasks failed by a budget, by ``budget``
``wal_engine_effects_deduplicated_total`` side effects answered from the dedup table
``wal_engine_sync_calls_overrunning``     sync calls whose thread a run waits for (timed
                                          out, or the worker stopping): one that stays up
                                          is a thread that never returns
``wal_engine_sync_call_overruns_total``   such waits begun, by ``reason`` (timed_out,
                                          stopping)
``wal_engine_resume_events_folded``       events folded to resume a task (the replay length),
                                          by ``source`` (snapshot + tail, or the whole log)
``wal_engine_claims_by_agent_version``    claims, by ``agent`` and the ``version`` that started
                                          the task
``wal_engine_limiter_grants_total``       limiter grants taken by calls, by ``limiter``
``wal_engine_limiter_wait_seconds``       in-process wait of a call for its grant, by
                                          ``limiter`` (0 for an immediate grant)
``wal_engine_limiter_parked_total``       waits long enough to park the task on a durable
                                          timer, by ``limiter``
``wal_engine_limiter_rate_limited_total`` provider 429s reported under a limiter, by
                                          ``limiter``
``wal_engine_live_tasks``                 gauge: tasks not finished (queued, running, waiting,
                                          resuming), by ``agent`` and ``version``, as a worker
                                          last read them from the log (see below)
``wal_engine_queue_claims_total``         claims, by ``queue``
``wal_engine_queue_depth``                gauge: tasks claimable now, by ``tenant`` and
                                          ``queue`` (read from the log, like live tasks)
``wal_engine_queue_running``              gauge: leased tasks (slots in use), likewise
``wal_engine_queue_concurrency_max``      gauge: the global limit (absent: none), likewise
``wal_engine_queue_worker_concurrency_max``  gauge: the per-worker limit, likewise
``wal_engine_queue_oldest_wait_seconds``  gauge: the oldest claimable task's wait, likewise
========================================  ====================================================

``wal_engine_live_tasks`` is read from the database, not counted in process: each worker
runs one grouped statement of its tenant's live tasks on its sweep connection, at most once
every ``live_tasks_refresh_sweeps`` sweep intervals (:mod:`wal_engine.runtime.worker`; 15 s
by default), never on a claim or an append. It is the whole tenant's figure, so every worker
of a tenant reports the same numbers: aggregate them with ``max`` (not ``sum``) across
workers. A version whose tasks have all finished stays at 0 for as long as the process runs,
so a drained version reads as 0 rather than disappearing. The version label of a task no
worker has claimed under a pinned version yet is empty, as in
``wal_engine_claims_by_agent_version``.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from wal_engine.errors import ConfigurationError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

append_buckets_s: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
                           2.5)
folded_buckets_events: Final = (0, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
EXTRA_HINT: Final = "install the metrics extra: pip install 'wal-engine[metrics]'"


class _PathTally:
    """Statements and latency of one append path, as plain numbers."""

    __slots__ = ("buckets", "count", "seconds")

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(append_buckets_s) + 1)
        """Observations per bucket (not cumulative); the last one is above every bound."""


class AppendTally:
    """The append hot path's metrics, kept as plain numbers and read at scrape time.

    Every append moves three metrics. Through prometheus-client's Counter and Histogram
    objects that is five locked increments and several Python calls (~3 µs measured on the
    benchmark machine, on a step of two appends); here it is one lock and a bisect. A
    registered collector turns the numbers into the same metric families when scraped:
    ``wal_engine_events_appended_total``, ``wal_engine_append_statements_total`` and the
    ``wal_engine_append_seconds`` histogram, by ``path``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events = 0
        self.paths = {path: _PathTally() for path in ("single", "group")}

    def add_events(self, count: int) -> None:
        """``count`` events were accepted."""
        with self._lock:
            self.events += count

    def observe(self, path: str, seconds: float, events: int) -> None:
        """One append statement of ``path`` took ``seconds`` and wrote ``events`` events."""
        tally = self.paths[path]
        with self._lock:
            self.events += events
            tally.count += 1
            tally.seconds += seconds
            tally.buckets[bisect.bisect_left(append_buckets_s, seconds)] += 1

    def collect(self) -> Iterator[Any]:
        """The metric families (the registry calls this on every scrape)."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        with self._lock:
            events = self.events
            paths = {path: (t.count, t.seconds, list(t.buckets))
                     for path, t in self.paths.items()}
        appended = CounterMetricFamily("wal_engine_events_appended",
                                       "Events accepted by fenced appends.")
        appended.add_metric([], events)
        statements = CounterMetricFamily("wal_engine_append_statements",
                                         "Append statements sent.", labels=["path"])
        latency = HistogramMetricFamily("wal_engine_append_seconds",
                                        "Latency of one append statement.", labels=["path"])
        for path, (count, seconds, buckets) in paths.items():
            statements.add_metric([path], count)
            cumulative, running = [], 0
            for bound, observed in zip((*map(_bound, append_buckets_s), "+Inf"), buckets,
                                       strict=True):
                running += observed
                cumulative.append((bound, running))
            latency.add_metric([path], cumulative, sum_value=seconds)
        yield appended
        yield statements
        yield latency


class LiveTasks:
    """The ``wal_engine_live_tasks`` gauge: the last reading of each tenant's live tasks by
    (agent, version), turned into a metric family at scrape time.

    Readings are kept per tenant (two engines of one process may serve two tenants) and
    summed at scrape; a series seen once and absent from the latest readings is reported as
    0, so a drained version goes to 0 instead of vanishing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tenant: dict[str, dict[tuple[str, str], int]] = {}
        self._seen: set[tuple[str, str]] = set()

    def update(self, tenant: str, counts: dict[tuple[str, str], int]) -> None:
        """``tenant``'s live tasks are now ``counts`` by (agent, version)."""
        with self._lock:
            self._by_tenant[tenant] = dict(counts)
            self._seen.update(counts)

    def totals(self) -> dict[tuple[str, str], int]:
        """Live tasks by (agent, version), summed over tenants (0 for a drained series)."""
        with self._lock:
            totals = dict.fromkeys(self._seen, 0)
            for counts in self._by_tenant.values():
                for key, tasks in counts.items():
                    totals[key] += tasks
        return totals

    def collect(self) -> Iterator[Any]:
        """The gauge family (the registry calls this on every scrape)."""
        from prometheus_client.core import GaugeMetricFamily

        gauge = GaugeMetricFamily(
            "wal_engine_live_tasks",
            "Tasks not finished (queued, running, waiting, resuming), by agent and the agent "
            "version that started them, as a worker last read them from the log.",
            labels=["agent", "version"])
        for (agent, version), tasks in sorted(self.totals().items()):
            gauge.add_metric([agent, version], tasks)
        yield gauge


class QueueGauges:
    """The ``wal_engine_queue_*`` gauges: the last reading of each tenant's queues (the
    worker's sweep reads them with the live tasks; ``wal-engine queues`` too), turned into
    metric families at scrape time. A queue gone from a reading is dropped."""

    fields: Final = (("depth", "Tasks claimable now (queued, resuming, due)."),
                     ("running", "Leased tasks: the queue's slots in use."),
                     ("concurrency_max", "The queue's global concurrency limit."),
                     ("worker_concurrency_max", "The queue's per-worker concurrency limit."),
                     ("oldest_wait_seconds", "How long the oldest claimable task has waited."))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tenant: dict[str, dict[str, dict[str, float]]] = {}

    def update(self, tenant: str, queues: dict[str, dict[str, float]]) -> None:
        """``tenant``'s queues now read ``queues``: name -> field -> value (absent: none)."""
        with self._lock:
            self._by_tenant[tenant] = queues

    def collect(self) -> Iterator[Any]:
        """The gauge families (the registry calls this on every scrape)."""
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            readings = {tenant: dict(queues) for tenant, queues in self._by_tenant.items()}
        for field, help_text in self.fields:
            gauge = GaugeMetricFamily(f"wal_engine_queue_{field}", help_text,
                                      labels=["tenant", "queue"])
            for tenant, queues in sorted(readings.items()):
                for queue, values in sorted(queues.items()):
                    if field in values:
                        gauge.add_metric([tenant, queue], values[field])
            yield gauge


def _bound(seconds: float) -> str:
    """A bucket's ``le`` label as prometheus-client writes it (``0.0005``, ``1.0``)."""
    return repr(float(seconds))


class Instruments:
    """The engine's counters and histograms, registered in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        target = REGISTRY if registry is None else registry
        self.registry = target
        self.appends = AppendTally()
        target.register(self.appends)
        self.live_tasks = LiveTasks()
        target.register(self.live_tasks)
        self.queues = QueueGauges()
        target.register(self.queues)
        self.queue_claims = Counter(
            "wal_engine_queue_claims", "Tasks leased by a worker, by queue.", ["queue"],
            registry=target)
        self.tasks_claimed = Counter(
            "wal_engine_tasks_claimed", "Tasks leased by a worker.", registry=target)
        self.tasks_orphaned = Counter(
            "wal_engine_tasks_orphaned", "Leases broken after their worker stopped renewing.",
            registry=target)
        self.call_retries = Counter(
            "wal_engine_call_retries", "Tool and LLM attempts retried.", ["kind", "reason"],
            registry=target)
        self.claims_by_version = Counter(
            "wal_engine_claims_by_agent_version",
            "Tasks claimed, by agent and the agent version that started them (what still runs "
            "on each version during a deploy).", ["agent", "version"], registry=target)
        self.call_escalations = Counter(
            "wal_engine_call_escalations",
            "Calls not safe to repeat left in doubt and escalated.", ["kind", "reason"],
            registry=target)
        self.loop_stalls = Counter(
            "wal_engine_event_loop_stalls",
            "Times a worker's event loop did not answer its watchdog in time.",
            registry=target)
        self.budget_trips = Counter(
            "wal_engine_budget_trips", "Tasks failed by a budget.", ["budget"], registry=target)
        self.effects_deduplicated = Counter(
            "wal_engine_effects_deduplicated",
            "Side effects answered from the dedup table instead of acting again.",
            registry=target)
        self.sync_calls_overrunning = Gauge(
            "wal_engine_sync_calls_overrunning",
            "Sync calls whose thread a run is waiting for (timed out, or the worker "
            "stopping); a value that stays up is a thread that never returns.",
            registry=target)
        self.sync_call_overruns = Counter(
            "wal_engine_sync_call_overruns",
            "Waits begun for the thread of a sync call that timed out or whose worker "
            "was stopping.", ["reason"], registry=target)
        self.limiter_grants = Counter(
            "wal_engine_limiter_grants", "Limiter grants taken by calls.", ["limiter"],
            registry=target)
        self.limiter_wait = Histogram(
            "wal_engine_limiter_wait_seconds",
            "In-process wait of a call for its limiter grant.", ["limiter"],
            buckets=(0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=target)
        self.limiter_parked = Counter(
            "wal_engine_limiter_parked",
            "Limiter waits long enough to park the task on a durable timer.", ["limiter"],
            registry=target)
        self.limiter_rate_limited = Counter(
            "wal_engine_limiter_rate_limited",
            "Provider 429s reported under a limiter.", ["limiter"], registry=target)
        self.resume_events_folded = Histogram(
            "wal_engine_resume_events_folded", "Events folded to resume a task.", ["source"],
            buckets=folded_buckets_events, registry=target)


def _load() -> Instruments | None:
    try:
        import prometheus_client  # noqa: F401 -- only asks whether the extra is installed
    except ImportError:
        return None
    return Instruments()


_instruments: Instruments | None = _load()


def available() -> bool:
    """Whether prometheus-client is installed (metrics are collected)."""
    return _instruments is not None


def instruments() -> Instruments | None:
    """The live instruments, or None without the extra."""
    return _instruments


# ----------------------------------------------------------------------------- hooks


def clock() -> float:
    """A start time for :func:`append_observed` (0.0 and no clock read without the extra)."""
    return time.perf_counter() if _instruments is not None else 0.0


def append_observed(path: str, started: float, events: int) -> None:
    """One append statement of ``path`` (``single`` or ``group``) finished; it wrote
    ``events`` events (0 when it was refused)."""
    if _instruments is not None:
        _instruments.appends.observe(path, time.perf_counter() - started, events)


def events_appended(count: int) -> None:
    """``count`` events of one task were accepted (by an append not timed by
    :func:`append_observed`)."""
    if _instruments is not None:
        _instruments.appends.add_events(count)


def tasks_claimed(count: int) -> None:
    """A claim statement leased ``count`` tasks."""
    if _instruments is not None and count:
        _instruments.tasks_claimed.inc(count)


def tasks_orphaned(count: int) -> None:
    """A sweep broke ``count`` expired leases."""
    if _instruments is not None and count:
        _instruments.tasks_orphaned.inc(count)


def call_retried(kind: str, reason: str) -> None:
    """A ``kind`` (tool, llm) call is attempted again; ``reason``: failure or in_doubt."""
    if _instruments is not None:
        _instruments.call_retries.labels(kind, reason).inc()


def task_claimed_at_version(agent: str, version: str | None) -> None:
    """A task of ``agent`` started by code of ``version`` was claimed."""
    if _instruments is not None:
        _instruments.claims_by_version.labels(agent, version or "").inc()


def live_tasks_read(tenant: str, rows: Iterable[Mapping[str, Any]]) -> None:
    """A worker of ``tenant`` read its live tasks: ``rows`` of ``agent``, ``agent_version``
    and ``tasks`` (a row per status, as ``TASKS_BY_VERSION`` returns them)."""
    if _instruments is None:
        return
    counts: dict[tuple[str, str], int] = {}
    for row in rows:
        key = (row["agent"], row["agent_version"] or "")
        counts[key] = counts.get(key, 0) + int(row["tasks"])
    _instruments.live_tasks.update(tenant, counts)


def claimed_in_queue(queue: str) -> None:
    """A task of ``queue`` was claimed."""
    if _instruments is not None:
        _instruments.queue_claims.labels(queue).inc()


def queues_read(tenant: str, stats: Iterable[Any]) -> None:
    """``tenant``'s queues were read (:class:`wal_engine.store.queues.QueueStats` items)."""
    if _instruments is None:
        return
    queues: dict[str, dict[str, float]] = {}
    for item in stats:
        values = {"depth": float(item.depth), "running": float(item.running)}
        for field, value in (("concurrency_max", item.concurrency_max),
                             ("worker_concurrency_max", item.worker_concurrency_max),
                             ("oldest_wait_seconds", item.oldest_wait_s)):
            if value is not None:
                values[field] = float(value)
        queues[item.queue] = values
    _instruments.queues.update(tenant, queues)


def call_escalated(kind: str, reason: str) -> None:
    """A ``kind`` call was left in doubt and escalated (``reason``: timed_out, ...)."""
    if _instruments is not None:
        _instruments.call_escalations.labels(kind, reason).inc()


def loop_stalled() -> None:
    """A worker's event loop did not answer its watchdog within the warning threshold."""
    if _instruments is not None:
        _instruments.loop_stalls.inc()


def call_failed(kind: str, retryable: bool) -> None:
    """An attempt failed; a retryable failure counts as a retry."""
    if _instruments is not None and retryable:
        _instruments.call_retries.labels(kind, "failure").inc()


def limiter_granted(limiter: str, waited_s: float) -> None:
    """A call took a grant of ``limiter`` after waiting ``waited_s`` in process."""
    if _instruments is not None:
        _instruments.limiter_grants.labels(limiter).inc()
        _instruments.limiter_wait.labels(limiter).observe(waited_s)


def limiter_parked(limiter: str) -> None:
    """A call's wait for ``limiter`` was long: its task parked on a durable timer."""
    if _instruments is not None:
        _instruments.limiter_parked.labels(limiter).inc()


def limiter_rate_limited(limiter: str) -> None:
    """A provider answered 429 to a call made under ``limiter``."""
    if _instruments is not None:
        _instruments.limiter_rate_limited.labels(limiter).inc()


def budget_tripped(budget: str) -> None:
    """A task was failed by its ``budget`` (max_steps, max_tokens, ...)."""
    if _instruments is not None:
        _instruments.budget_trips.labels(budget).inc()


def effect_deduplicated() -> None:
    """A side effect returned its recorded result instead of acting again."""
    if _instruments is not None:
        _instruments.effects_deduplicated.inc()


def sync_call_overrunning(reason: str) -> None:
    """A run began waiting for a sync call's thread (``reason``: timed_out, stopping)."""
    if _instruments is not None:
        _instruments.sync_call_overruns.labels(reason).inc()
        _instruments.sync_calls_overrunning.inc()


def sync_call_overrun_ended() -> None:
    """A wait begun by :func:`sync_call_overrunning` ended."""
    if _instruments is not None:
        _instruments.sync_calls_overrunning.dec()


def resumed(events_folded: int, from_snapshot: bool) -> None:
    """A task run folded ``events_folded`` events to resume."""
    if _instruments is not None:
        source = "snapshot" if from_snapshot else "log"
        _instruments.resume_events_folded.labels(source).observe(events_folded)


# ----------------------------------------------------------------------------- serving


def serve(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve the default registry over HTTP on ``addr:port`` (a daemon thread).

    Returns the HTTP server (``shutdown()`` stops it).

    Raises:
        ConfigurationError: prometheus-client is not installed, or the port is taken.
    """
    if _instruments is None:
        raise ConfigurationError(f"metrics are not available: {EXTRA_HINT}")
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, addr, registry=_instruments.registry)
    except OSError as error:
        raise ConfigurationError(f"cannot serve metrics on {addr}:{port}: {error}") from error
    return server
