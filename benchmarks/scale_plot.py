"""Draw the figures of a ``benchmarks.scale`` run (issue 23) to a PNG.

``python -m benchmarks.scale_plot RESULTS.json [more.json ...] --png docs/scaling.png``:
one panel of each latency's p50 on the empty and on each filled database (log scale, the
filled/empty ratio written over each filled bar), one of the timers' wake-up (until none
waits, until all ran their next step, against the 10 s target) and one of the workers'
steps/s by process count. Several results files (e.g. 200,000 and 1,000,000 tasks) are
drawn side by side, each filled size in its own colour. matplotlib comes with the
``bench`` extra and is imported only here, when drawing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLOURS = ("#4c72b0", "#dd8452", "#c44e52", "#8172b3", "#937860")


def _label(document: dict[str, Any]) -> str:
    filled = document["fill"]["filled"]
    return f"{filled['task_rows']:,} tasks / {filled['event_rows']:,} events"


def draw(documents: list[dict[str, Any]], target: Path) -> Path:
    """Write the PNG of ``documents`` (scale results) to ``target``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency_axis, timer_axis, worker_axis) = plt.subplots(
        3, 1, figsize=(11, 13), gridspec_kw={"height_ratios": [3, 1.3, 1.3]})
    measures = list(documents[0].get("latencies", {}))
    width = 0.8 / (1 + len(documents))
    positions = range(len(measures))
    empty = [documents[0]["latencies"][m]["empty"]["p50_us"] for m in measures]
    latency_axis.bar([p - 0.4 + width / 2 for p in positions], empty, width,
                     label=f"empty ({documents[0]['fill']['empty']['task_rows']:,} tasks)",
                     color="#999999")
    for index, document in enumerate(documents):
        values = [document["latencies"][m]["filled"]["p50_us"] for m in measures]
        xs = [p - 0.4 + width * (index + 1.5) for p in positions]
        latency_axis.bar(xs, values, width, label=_label(document),
                         color=COLOURS[index % len(COLOURS)])
        for x, value, measure in zip(xs, values, measures, strict=True):
            ratio = document["latencies"][measure]["p50_ratio"]
            latency_axis.text(x, value * 1.15, f"{ratio:.2f}x", ha="center", fontsize=7,
                              rotation=90)
    latency_axis.set_yscale("log")
    latency_axis.set_xticks(list(positions), measures, rotation=30, ha="right")
    latency_axis.set_ylabel("p50 latency, µs (log)")
    latency_axis.set_title("Per-operation p50, empty vs filled database, same run"
                           " (filled/empty ratio above each bar; target ≤ 1.25x)")
    latency_axis.legend(fontsize=8)

    phases = ("to_sleep_s", "all_resuming_s", "all_next_step_s")
    names = ("submit until all asleep", "due until none waiting",
             "due until all ran the next step")
    rows = [(f"{side}\n" + (_label(d) if side == "filled"
                             else f"{d['fill']['empty']['task_rows']:,} tasks"), d["timers"][side])
            for d in documents if "timers" in d for side in ("empty", "filled")]
    for index, (phase, name) in enumerate(zip(phases, names, strict=True)):
        timer_axis.barh([r + index * 0.25 for r in range(len(rows))],
                        [figures[phase] for _, figures in rows], 0.25, label=name,
                        color=COLOURS[index])
    timer_axis.axvline(10.0, color="black", linestyle="--", linewidth=1)
    timer_axis.text(10.0, len(rows) - 0.35, " target 10 s", fontsize=8, va="bottom")
    timer_axis.set_yticks([r + 0.25 for r in range(len(rows))], [r for r, _ in rows],
                          fontsize=7)
    timer_axis.set_xlabel("seconds (4 worker processes)")
    timer_axis.set_title("Wake-up of 10,000 timers due at once")
    timer_axis.legend(fontsize=8)

    for index, document in enumerate(documents):
        for side, style in (("empty", ":"), ("filled", "-")):
            rows_ = document.get("workers", {}).get(side, [])
            if not rows_:
                continue
            processes = [row["processes"] for row in rows_]
            worker_axis.plot(processes, [row["steps_per_s"] for row in rows_], style,
                             marker="o", color=COLOURS[index % len(COLOURS)],
                             label=f"steps/s, {side}" + (f" ({_label(document)})"
                                                         if side == "filled" else ""))
    worker_axis.set_xticks([1, 2, 4])
    worker_axis.set_xlabel("worker processes (2 cores, PostgreSQL on the same cores)")
    worker_axis.set_ylabel("tool steps/s")
    worker_axis.set_title("Stepping tasks across worker processes")
    if worker_axis.lines:
        worker_axis.legend(fontsize=8)
    machine = documents[0]["machine"]
    figure.suptitle(f"benchmarks.scale — {machine.get('cores')} cores, PostgreSQL "
                    f"{machine.get('postgres', {}).get('server_version')}, load average at"
                    f" start {machine.get('load_average')}", fontsize=10)
    figure.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target


def markdown(document: dict[str, Any]) -> str:
    """The tables of docs/scaling.md from one results file: fill, latencies, timers,
    workers, client CPU."""
    fill = document["fill"]
    lines = ["| database | tasks | events | COPY s | with VACUUM ANALYZE s | database MiB"
             " | wal_events MiB | wal_tasks MiB | bytes per event (database) |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for side in ("empty", "filled"):
        f = fill[side]
        lines.append(f"| {side} | {f['task_rows']:,} | {f['event_rows']:,} | {f['copy_s']}"
                     f" | {f['fill_s']} | {f['database_bytes'] / 2**20:,.0f}"
                     f" | {f['events_bytes'] / 2**20:,.0f} | {f['tasks_bytes'] / 2**20:,.0f}"
                     f" | {f['database_bytes'] / max(1, f['event_rows']):,.0f} |")
    lines += ["", "| measure | empty p50 µs | empty p99 µs | filled p50 µs | filled p99 µs"
              " | p50 filled/empty | target ≤ 1.25x |", "|---|--:|--:|--:|--:|--:|---|"]
    for name, figure in document.get("latencies", {}).items():
        e, f = figure["empty"], figure["filled"]
        lines.append(f"| {name} | {e['p50_us']:,.0f} | {e['p99_us']:,.0f} | {f['p50_us']:,.0f}"
                     f" | {f['p99_us']:,.0f} | {figure['p50_ratio']:.2f}x"
                     f" | {'met' if figure['target_met'] else 'missed'} |")
    if "timers" in document:
        lines += ["", "| timers (10,000, 4 workers) | submit to all asleep s | due to none"
                  " waiting s | due to all ran next step s | target < 10 s | server CPU s"
                  " | workers CPU s | worker RSS MiB: none / all waiting / after |",
                  "|---|--:|--:|--:|---|--:|--:|---|"]
        for side, t in document["timers"].items():
            rss = " / ".join(f"{sum(t[k]) / max(1, len(t[k])):.1f}" if k in t else "n/a"
                             for k in ("rss_mib_none_waiting", "rss_mib_all_waiting",
                                       "rss_mib_all_done"))
            lines.append(f"| {side} | {t['to_sleep_s']} | {t['all_resuming_s']}"
                         f" | {t['all_next_step_s']} | {'met' if t['target_met'] else 'missed'}"
                         f" | {t.get('server_cpu_s', '')} | {t.get('workers_cpu_s', '')}"
                         f" | {rss} (mean per process) |")
    if "workers" in document:
        lines += ["", "| workers | processes | steps/s | appends/s | ceiling rows/s"
                  " | vs ceiling | CPU µs/step (workers) | workers' CPU (cores) | RSS MiB |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
        for side, rows in document["workers"].items():
            for r in rows:
                lines.append(f"| {side} | {r['processes']} | {r['steps_per_s']:,}"
                             f" | {r['appends_per_s']:,} | {r['ceiling_rows_per_s']:,}"
                             f" | {r['vs_ceiling']} | {r['cpu_us_per_step']}"
                             f" | {r['cpu_utilisation']} | {r['rss_mib']} |")
    if "cpu_step" in document:
        lines += ["", "| client CPU per tool step | wal-engine µs | raw two INSERTs µs"
                  " | ratio |", "|---|--:|--:|--:|"]
        for side, c in document["cpu_step"].items():
            lines.append(f"| {side} | {c['wal_cpu_us_median']:.0f}"
                         f" | {c['raw_cpu_us_median']:.0f} | {c['ratio_median']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_plot",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="benchmarks.scale JSON files")
    parser.add_argument("--png", type=Path, default=Path("docs/scaling.png"))
    parser.add_argument("--markdown", action="store_true",
                        help="also print the tables of each file (docs/scaling.md)")
    args = parser.parse_args(argv)
    documents = [json.loads(path.read_text(encoding="utf-8")) for path in args.results]
    if args.markdown:
        for document in documents:
            print(markdown(document))
    print(f"wrote {draw(documents, args.png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
