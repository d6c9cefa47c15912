"""The timeline page: one self-contained HTML file (inline CSS and JS, no network fetch).

The data is embedded as JSON in a ``<script type="application/json">`` element with ``<``,
``>`` and ``&`` escaped, and the script only ever inserts it into the page as text
(``textContent``), never as markup, so a payload cannot inject anything.
"""

from __future__ import annotations

import html
from typing import Any, Final

import orjson

_JSON_ESCAPES: Final = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"}


def render_page(model: dict[str, Any]) -> str:
    """The whole HTML document for a timeline model (see ``timeline.model.build_model``)."""
    data = orjson.dumps(model, option=orjson.OPT_SORT_KEYS).decode().translate(_JSON_ESCAPES)
    title = html.escape(f"wal-engine timeline: {model['task']['task_id']}")
    return PAGE.replace("__TITLE__", title).replace("__DATA__", data)


PAGE: Final = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>__TITLE__</title>
<style>
  :root { --ink:#1d2430; --muted:#6b7483; --line:#d9dee7; --bg:#fbfcfe; --panel:#fff; }
  * { box-sizing: border-box; }
  body { margin:0; font:13px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
         color:var(--ink); background:var(--bg); }
  header { padding:12px 16px; border-bottom:1px solid var(--line); background:var(--panel); }
  header h1 { font-size:16px; margin:0 0 4px 0; }
  header .facts span { margin-right:14px; color:var(--muted); }
  header .facts b { color:var(--ink); font-weight:600; }
  .controls { padding:8px 16px; display:flex; gap:12px; align-items:center; flex-wrap:wrap; }
  .controls button { font:inherit; padding:3px 10px; border:1px solid var(--line);
                     background:#fff; border-radius:4px; cursor:pointer; }
  .controls button.on { background:var(--ink); color:#fff; border-color:var(--ink); }
  .legend span { display:inline-flex; align-items:center; margin-right:10px; color:var(--muted); }
  .legend i { width:10px; height:10px; border-radius:50%; display:inline-block; margin-right:4px; }
  #chart-wrap { overflow-x:auto; border-top:1px solid var(--line);
                border-bottom:1px solid var(--line); background:var(--panel); }
  svg text { font-size:11px; fill:var(--ink); }
  svg .lane-label { fill:var(--muted); font-weight:600; }
  svg .lane-bg { fill:#f4f6fa; }
  svg .tick { stroke:var(--line); }
  svg .tick-label { fill:var(--muted); font-size:10px; }
  svg .span { stroke:#fff; stroke-width:1; cursor:pointer; }
  svg .span:hover, svg .mark:hover { stroke:var(--ink); stroke-width:1.5; }
  svg .mark { cursor:pointer; stroke:#fff; stroke-width:1; }
  svg .selected { stroke:#000 !important; stroke-width:2.5 !important; }
  svg .marker { stroke-width:1.2; }
  svg .marker.bad { stroke:#c0392b; stroke-dasharray:4 3; }
  svg .marker.good { stroke:#1e8449; }
  svg .marker.info { stroke:#8e9aaf; stroke-dasharray:2 3; }
  .cat-lifecycle { fill:#34495e; } .cat-step { fill:#8e44ad; } .cat-tool { fill:#2471a3; }
  .cat-llm { fill:#d35400; } .cat-wait { fill:#16a085; } .cat-approval { fill:#b7950b; }
  .cat-budget { fill:#c0392b; } .cat-data { fill:#7f8c8d; } .cat-graph { fill:#5d6d7e; }
  .o-ok { fill:#2e86c1; } .o-failed { fill:#c0392b; } .o-retrying { fill:#e67e22; }
  .o-in-doubt { fill:#f1c40f; } .o-uncertain { fill:#922b21; } .o-waiting { fill:#76d7c4; }
  svg .span.crossed { stroke:#f1c40f; stroke-width:3; stroke-dasharray:6 3; }
  .o-done { fill:#1abc9c; } .o-approved { fill:#27ae60; } .o-refused { fill:#c0392b; }
  .s-QUEUED { fill:#bdc3c7; } .s-RUNNING { fill:#5dade2; } .s-CHECKPOINTED { fill:#a569bd; }
  .s-WAITING { fill:#48c9b0; } .s-RESUMING { fill:#f5b041; } .s-COMPLETED { fill:#52be80; }
  .s-FAILED { fill:#ec7063; }
  .step { fill:#d7bde2; } .stretch { fill:#aed6f1; } .stretch.unknown { fill:#d5d8dc; }
  main { display:grid; grid-template-columns: minmax(0, 1fr) minmax(320px, 38%); gap:0; }
  #events-table-wrap { max-height:420px; overflow:auto; border-right:1px solid var(--line); }
  table { border-collapse:collapse; width:100%; }
  th, td { text-align:left; padding:3px 8px; border-bottom:1px solid #eef1f5;
           white-space:nowrap; }
  th { position:sticky; top:0; background:var(--panel); color:var(--muted); }
  tr.row { cursor:pointer; } tr.row:hover { background:#f2f6fc; }
  tr.row.selected { background:#dbe9f9; }
  td.what { overflow:hidden; text-overflow:ellipsis; max-width:420px; color:var(--muted); }
  #detail { padding:10px 14px; background:var(--panel); }
  #detail h2 { font-size:14px; margin:0 0 6px 0; }
  #detail .meta { color:var(--muted); margin-bottom:6px; }
  #detail .note { color:#b9770e; }
  #payload { margin:0; padding:8px; background:#f4f6fa; border-radius:4px; max-height:380px;
             overflow:auto; white-space:pre-wrap; word-break:break-word;
             font:12px/1.35 ui-monospace, SFMono-Regular, Menlo, monospace; }
</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <div class="facts" id="facts"></div>
</header>
<div class="controls">
  <span>scale</span>
  <button id="scale-time" class="on" type="button">time</button>
  <button id="scale-seq" type="button">seq</button>
  <span>zoom</span>
  <button id="zoom-out" type="button">&minus;</button>
  <span id="zoom-level">1&times;</span>
  <button id="zoom-in" type="button">+</button>
  <span class="legend" id="legend"></span>
</div>
<div id="chart-wrap"><svg id="chart" xmlns="http://www.w3.org/2000/svg"></svg></div>
<main>
  <div id="events-table-wrap">
    <table><thead><tr><th>seq</th><th>time</th><th>epoch</th><th>type</th><th>what</th></tr>
    </thead><tbody id="events-table"></tbody></table>
  </div>
  <section id="detail">
    <h2 id="detail-title">Click an event to see its payload</h2>
    <div class="meta" id="detail-meta"></div>
    <div class="note" id="detail-note"></div>
    <pre id="payload"></pre>
  </section>
</main>
<script id="timeline-data" type="application/json">__DATA__</script>
<script>
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("timeline-data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  const GUTTER = 150, RIGHT = 40;
  const LANES = [
    ["markers", "lifecycle", 34], ["stretches", "worker \u00b7 epoch", 28],
    ["statuses", "status", 18], ["steps", "steps", 24], ["calls", "tool & LLM calls", 30],
    ["waits", "waits", 24], ["events", "events", 62], ["budget", "budget use", 78]];
  const CATEGORIES = ["lifecycle", "step", "tool", "llm", "wait", "approval", "budget", "data",
                      "graph"];
  const events = data.events;
  const bySeq = new Map(events.map((e, i) => [e.seq, i]));
  const view = { scale: "time", zoom: 1, selected: null };
  const t0 = events.length ? events[0].t : 0;
  const t1 = events.length ? events[events.length - 1].t : 1;
  const s0 = events.length ? events[0].seq : 0;
  const s1 = events.length ? events[events.length - 1].seq : 1;

  function el(name, attrs, parent, text) {
    const node = document.createElementNS(NS, name);
    for (const key in attrs) node.setAttribute(key, attrs[key]);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function html(name, parent, text, cls) {
    const node = document.createElement(name);
    if (text !== undefined) node.textContent = text;
    if (cls) node.className = cls;
    if (parent) parent.appendChild(node);
    return node;
  }
  function chartWidth() {
    const wrap = document.getElementById("chart-wrap").clientWidth || 1200;
    return Math.max(600, wrap - GUTTER - RIGHT) * view.zoom;
  }
  function xOf(point, width) {
    if (view.scale === "seq") return GUTTER + (point.seq - s0) / Math.max(1, s1 - s0) * width;
    return GUTTER + (point.t - t0) / Math.max(1, t1 - t0) * width;
  }
  function ms(value) {
    if (value < 1000) return value.toFixed(value < 10 ? 1 : 0) + " ms";
    if (value < 60000) return (value / 1000).toFixed(2) + " s";
    return (value / 60000).toFixed(1) + " min";
  }
  function niceStep(range, count) {
    const raw = range / Math.max(1, count);
    const power = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1e-9))));
    for (const m of [1, 2, 5, 10]) if (m * power >= raw) return m * power;
    return 10 * power;
  }
  function drawAxis(svg, width, top, height) {
    const count = Math.max(2, Math.floor(width / 110));
    const time = view.scale === "time";
    const lo = time ? 0 : s0, hi = time ? Math.max(1, t1 - t0) : Math.max(s0 + 1, s1);
    const step = Math.max(time ? 0.001 : 1, niceStep(hi - lo, count));
    for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) {
      const x = time ? xOf({ t: t0 + v }, width) : xOf({ seq: v }, width);
      el("line", { x1: x, x2: x, y1: top, y2: top + height, class: "tick" }, svg);
      el("text", { x: x + 2, y: top + 10, class: "tick-label" }, svg,
         time ? "+" + ms(v) : "seq " + Math.round(v));
    }
  }
  function spanRect(svg, span, width, y, h, cls, title, seq) {
    const x0 = xOf(span.start, width), x1 = xOf(span.end, width);
    const rect = el("rect", { x: x0, y: y, width: Math.max(3, x1 - x0), height: h,
                              class: "span " + cls, "data-seq": seq }, svg);
    el("title", {}, rect, title);
    rect.addEventListener("click", () => select(seq, title));
    return rect;
  }
  function label(svg, span, width, y, text) {
    const x0 = xOf(span.start, width), x1 = xOf(span.end, width);
    if (x1 - x0 > text.length * 6 + 6) el("text", { x: x0 + 4, y: y }, svg, text);
  }

  const drawers = {
    markers(svg, width, top) {
      const ends = [-Infinity, -Infinity];  // Labels take one of two rows, or only a tooltip.
      for (const m of data.markers) {
        const x = xOf(m, width);
        const bad = ["task_orphaned", "task_failed", "task_cancelled", "budget_exceeded"];
        const good = ["task_resumed", "task_claimed", "task_completed"];
        const cls = bad.includes(m.kind) ? "bad" : good.includes(m.kind) ? "good" : "info";
        const line = el("line", { x1: x, x2: x, y1: top + 2, y2: totalHeight - 4,
                                  class: "marker " + cls, "data-seq": m.seq }, svg);
        el("title", {}, line, "seq " + m.seq + ": " + m.label);
        const row = ends.findIndex((end) => x >= end + 6);
        if (row < 0) continue;
        ends[row] = x + 3 + m.label.length * 6;
        const text = el("text", { x: x + 3, y: top + 12 + row * 13 }, svg, m.label);
        el("title", {}, text, "seq " + m.seq + ": " + m.label);
        text.addEventListener("click", () => select(m.seq, m.label));
      }
    },
    stretches(svg, width, top) {
      for (const s of data.stretches) {
        const title = "worker " + s.worker + ", epoch " + s.epoch + " (seq " + s.start.seq +
          "\u2013" + s.end.seq + ", " + ms(s.end.t - s.start.t) + ")" +
          (s.ended ? ", ended by " + s.ended : ", still holding");
        spanRect(svg, s, width, top + 3, 20, "stretch" + (s.worker === "?" ? " unknown" : ""),
                 title, s.start.seq);
        label(svg, s, width, top + 17, s.worker + " \u00b7 e" + s.epoch);
      }
    },
    statuses(svg, width, top) {
      for (const s of data.statuses) {
        spanRect(svg, s, width, top + 3, 12, "s-" + s.status, s.status + " from seq " +
                 s.start.seq, s.start.seq);
      }
    },
    steps(svg, width, top) {
      for (const s of data.steps) {
        const title = s.label + " (seq " + s.start.seq + "\u2013" + s.end.seq + ", " +
          ms(s.end.t - s.start.t) + ")" + (s.next_action != null ? ", next: " +
          JSON.stringify(s.next_action) : "");
        spanRect(svg, s, width, top + 3, 18, "step", title, s.start.seq);
        label(svg, s, width, top + 16, s.label);
      }
    },
    calls(svg, width, top) {
      for (const c of data.calls) {
        const title = c.kind + " " + c.name + " attempt " + c.attempt + ": " + c.outcome +
          " in " + ms(c.duration_ms) + (c.tokens ? ", " + c.tokens + " tokens" : "") +
          (c.error ? " (" + c.error + ")" : "") + (c.epochs ? "; in doubt across a lost " +
          "lease, resolved at epoch " + c.epochs[1] + " (intent at epoch " + c.epochs[0] +
          ")" : "");
        spanRect(svg, c, width, top + 4, 22, "o-" + c.outcome.replace(" ", "-") +
                 (c.epochs ? " crossed" : ""), title, c.start.seq);
        label(svg, c, width, top + 19, c.name + (c.attempt > 1 ? " #" + c.attempt : "") +
              " " + ms(c.duration_ms) + (c.epochs ? " \u00b7 in doubt across a lost lease" : ""));
      }
    },
    waits(svg, width, top) {
      for (const w of data.waits) {
        const title = w.name + ": " + w.outcome + " after " + ms(w.duration_ms);
        spanRect(svg, w, width, top + 3, 18, "o-" + w.outcome, title, w.start.seq);
        label(svg, w, width, top + 16, w.name);
      }
    },
    events(svg, width, top) {
      // Greedy rows: a mark takes the first row where it does not touch the previous mark,
      // so marks close in time stack instead of hiding each other (zoom in past 6 rows).
      const rows = [-Infinity, -Infinity, -Infinity, -Infinity, -Infinity, -Infinity];
      for (const e of events) {
        const x = xOf(e, width);
        let row = rows.findIndex((last) => x - last >= 10);
        if (row < 0) row = rows.indexOf(Math.min(...rows));
        rows[row] = x;
        const mark = el("circle", { cx: x, cy: top + 8 + row * 9.5, r: 4.5,
                                    class: "mark cat-" + e.cat, "data-seq": e.seq }, svg);
        el("title", {}, mark, "seq " + e.seq + " " + e.type + " (epoch " + e.epoch + ")");
        mark.addEventListener("click", () => select(e.seq));
      }
    },
    budget(svg, width, top, height) {
      const metrics = [
        ["tokens", "max_tokens", "#d35400"], ["cost_usd", "max_cost_usd", "#c0392b"],
        ["tool_calls", "max_tool_calls", "#2471a3"], ["steps", "max_steps", "#8e44ad"],
        ["llm_calls", null, "#7f8c8d"]];
      const series = data.budget.series, limits = data.budget.limits;
      const bottom = top + height - 6, room = height - 14;
      let row = 0;
      for (const [name, limitKey, color] of metrics) {
        const peak = series.reduce((m, p) => Math.max(m, p[name]), 0);
        if (!peak) continue;
        const limit = limitKey && limits[limitKey] ? limits[limitKey] : null;
        const scale = limit || peak;
        let points = "", lastY = bottom;
        for (const p of series) {
          const x = xOf(p, width), y = bottom - Math.min(1, p[name] / scale) * room;
          points += x + "," + lastY + " " + x + "," + y + " ";
          lastY = y;
        }
        points += (GUTTER + width) + "," + lastY;
        const line = el("polyline", { points: points, fill: "none", stroke: color,
                                      "stroke-width": 1.8 }, svg);
        const last = series[series.length - 1][name];
        const text = name + " " + (name === "cost_usd" ? last.toFixed(4) : last) +
          (limit ? " / " + limit : "");
        el("title", {}, line, text);
        el("text", { x: 4, y: top + 24 + row * 11, fill: color, style: "fill:" + color }, svg,
           text);
        row += 1;
      }
      const stopped = data.budget.fold_stopped;
      if (stopped) {
        el("text", { x: 4, y: top + height - 2, style: "fill:#c0392b" }, svg,
           "usage up to seq " + (stopped.seq - 1) + " only: " + stopped.error);
      }
      for (const trip of data.budget.trips) {
        const x = xOf(trip, width);
        el("text", { x: x + 3, y: top + 12, style: "fill:#c0392b" }, svg,
           trip.budget + " tripped");
      }
    },
  };

  let totalHeight = 0;
  function render() {
    const svg = document.getElementById("chart");
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const width = chartWidth();
    totalHeight = 22 + LANES.reduce((sum, lane) => sum + lane[2] + 4, 0);
    svg.setAttribute("width", GUTTER + width + RIGHT);
    svg.setAttribute("height", totalHeight);
    drawAxis(svg, width, 0, totalHeight);
    let top = 22;
    for (const [key, title, height] of LANES) {
      el("rect", { x: 0, y: top, width: GUTTER + width + RIGHT, height: height,
                   class: "lane-bg" }, svg);
      el("text", { x: 6, y: top + 13, class: "lane-label" }, svg, title);
      drawers[key](svg, width, top, height);
      top += height + 4;
    }
    if (view.selected !== null) highlight(view.selected);
  }

  function highlight(seq) {
    for (const node of document.querySelectorAll(".selected")) node.classList.remove("selected");
    for (const node of document.querySelectorAll('[data-seq="' + seq + '"]')) {
      if (node.classList.contains("mark") || node.tagName === "TR") {
        node.classList.add("selected");
      }
    }
  }

  function select(seq, context) {
    const index = bySeq.get(seq);
    if (index === undefined) return;
    const e = events[index];
    view.selected = seq;
    document.getElementById("detail-title").textContent = "seq " + e.seq + " \u00b7 " + e.type;
    document.getElementById("detail-meta").textContent = "epoch " + e.epoch + " \u00b7 " +
      (e.recorded_at || "") + " \u00b7 hash " + e.hash + (context ? " \u00b7 " + context : "");
    document.getElementById("detail-note").textContent = e.note || "";
    document.getElementById("payload").textContent = typeof e.payload === "string" ?
      e.payload : JSON.stringify(e.payload, null, 2);
    highlight(seq);
    const row = document.querySelector('tr[data-seq="' + seq + '"]');
    if (row && row.scrollIntoView) row.scrollIntoView({ block: "nearest" });
  }

  function fillTable() {
    const body = document.getElementById("events-table");
    for (const e of events) {
      const row = html("tr", body, undefined, "row");
      row.setAttribute("data-seq", e.seq);
      html("td", row, String(e.seq));
      html("td", row, "+" + ms(e.t - t0));
      html("td", row, String(e.epoch));
      html("td", row, e.type);
      const text = typeof e.payload === "string" ? e.payload : JSON.stringify(e.payload);
      html("td", row, text.length > 160 ? text.slice(0, 157) + "..." : text, "what");
      row.addEventListener("click", () => select(e.seq));
    }
  }

  function header() {
    const task = data.task;
    document.getElementById("title").textContent = "Task " + task.task_id;
    const facts = document.getElementById("facts");
    const workers = new Set(data.stretches.map((s) => s.worker));
    const orphaned = data.markers.filter((m) => m.kind === "task_orphaned").length;
    const items = [["agent", task.agent], ["status", task.status],
                   ["events", events.length + " (seq " + task.first_seq + "\u2013" +
                    task.last_seq + " of " + task.head_seq + ")"],
                   ["span", ms(t1 - t0)], ["workers", workers.size],
                   ["orphaned", orphaned], ["calls", data.calls.length],
                   ["started", task.start || "-"]];
    if (task.parent_task_id) items.push(["forked from", task.parent_task_id + " @ " +
                                         task.parent_seq]);
    for (const [name, value] of items) {
      const span = html("span", facts, name + " ");
      html("b", span, String(value));
    }
    const legend = document.getElementById("legend");
    for (const cat of CATEGORIES) {
      const item = html("span", legend);
      const dot = html("i", item);
      dot.setAttribute("data-cat", cat);
      item.appendChild(document.createTextNode(cat));
    }
    const probe = el("circle", { class: "cat-x" }, document.getElementById("chart"));
    for (const dot of legend.querySelectorAll("i")) {
      probe.setAttribute("class", "cat-" + dot.getAttribute("data-cat"));
      dot.style.background = getComputedStyle(probe).fill;
    }
    probe.remove();
  }

  function setScale(scale) {
    view.scale = scale;
    document.getElementById("scale-time").classList.toggle("on", scale === "time");
    document.getElementById("scale-seq").classList.toggle("on", scale === "seq");
    render();
  }
  function setZoom(zoom) {
    view.zoom = Math.min(64, Math.max(1, zoom));
    document.getElementById("zoom-level").textContent = view.zoom + "\u00d7";
    render();
  }
  document.getElementById("scale-time").addEventListener("click", () => setScale("time"));
  document.getElementById("scale-seq").addEventListener("click", () => setScale("seq"));
  document.getElementById("zoom-in").addEventListener("click", () => setZoom(view.zoom * 2));
  document.getElementById("zoom-out").addEventListener("click", () => setZoom(view.zoom / 2));
  document.addEventListener("keydown", (event) => {
    if (view.selected === null) return;
    const index = bySeq.get(view.selected);
    if (event.key === "ArrowRight" && index + 1 < events.length) select(events[index + 1].seq);
    if (event.key === "ArrowLeft" && index > 0) select(events[index - 1].seq);
  });
  window.addEventListener("resize", render);

  header();
  fillTable();
  render();
  document.body.setAttribute("data-rendered", String(events.length));
})();
</script>
</body>
</html>
"""
