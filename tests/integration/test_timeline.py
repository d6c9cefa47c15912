"""``wal-engine timeline``: the model drawn from a real history (with an orphaned lease, a
retry and a durable wait), and the page in headless Chromium: no console error, no network
fetch, one mark per event, a click shows the payload; a screenshot is kept."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import claim
from tests.integration.test_cli_agents import FAST, cli, lines, scripted_llm, tool
from wal_engine import failpoints
from wal_engine.audit.timeline import read_timeline
from wal_engine.engine import Engine
from wal_engine.events import Budget
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import AgentContext

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = "</script><script>alert('x')</script><b>bold</b>"


async def audited(ctx: AgentContext, task_input: Any) -> Any:
    """Every kind of span: LLM, tools (one retried), a durable sleep, checkpoints."""
    await ctx.message("user", HOSTILE)
    plan = await ctx.llm("scripted", scripted_llm, {"q": task_input["q"]})
    await ctx.checkpoint(next_action="search")
    await ctx.tool("search", tool("search", ["a"]), {"q": plan})
    await ctx.sleep(0.05)
    page = await ctx.tool("fetch", tool("fetch", {"title": "T"}, fail_first=1), {"u": 1},
                          retry=RetryPolicy(max_attempts=3, initial_delay_s=0.01))
    await ctx.checkpoint(next_action="answer")
    await ctx.llm("scripted", scripted_llm, {"q": "answer"})
    return page


async def _history_with_an_orphaned_lease(engine: Engine) -> str:
    """A worker claims the task and dies (never renews); a live worker breaks its lease,
    resumes the task, 'dies' between the first tool's effect and its result, and after
    another orphaning retries the in-doubt call and finishes."""
    engine.register("audited", audited)
    task_id = await engine.submit("audited", {"q": "t"}, budget=Budget(max_tokens=1000))
    (row,) = await claim(engine.database, worker="dead-worker", ttl_ms=300)
    assert row["task_id"] == task_id
    failpoints.arm("after_effect_before_result", 1, "raise")
    worker = engine.worker(concurrency=2, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        state = await engine.wait(task_id, timeout_s=30)
    finally:
        failpoints.disarm()
        worker.stop()
        await running
    assert str(state.status) == "COMPLETED"
    return task_id


async def test_timeline_model_covers_workers_calls_retries_waits_and_budget(
        engine: Engine) -> None:
    """Stretches per worker and epoch, the orphaning, call durations, retry, wait, budget."""
    task_id = await _history_with_an_orphaned_lease(engine)
    history = await engine.history(task_id)
    model = await read_timeline(engine.store, task_id)
    assert [e["seq"] for e in model["events"]] == [r.seq for r in history]
    workers = [(s["worker"], s["epoch"]) for s in model["stretches"]]
    assert workers[0] == ("dead-worker", 1)
    assert {w for w, _ in workers[1:]} == {workers[1][0]} and workers[1][0] != "dead-worker"
    assert model["stretches"][0]["ended"] == "task_orphaned"
    kinds = [m["kind"] for m in model["markers"]]
    assert kinds.index("task_orphaned") < kinds.index("task_resumed")
    assert kinds.count("task_orphaned") == 2
    (search,) = [c for c in model["calls"] if c["name"] == "search"]
    assert search["outcome"] == "ok" and search["epochs"][0] < search["epochs"][1]
    fetch = [c for c in model["calls"] if c["name"] == "fetch"]
    assert [(c["attempt"], c["outcome"]) for c in fetch] == [(1, "retrying"), (2, "ok")]
    assert all(c["duration_ms"] >= 0 for c in model["calls"])
    assert [c["tokens"] for c in model["calls"] if c["kind"] == "llm"] == [42, 42]
    (sleep,) = [w for w in model["waits"] if w["kind"] == "timer"]
    assert sleep["outcome"] == "done" and sleep["duration_ms"] >= 40
    assert model["budget"]["limits"] == {"max_tokens": 1000}
    assert model["budget"]["series"][-1]["tokens"] == 84
    assert [s["label"] for s in model["steps"]][:2] == ["step 1", "step 2"]
    window = await read_timeline(engine.store, task_id, from_seq=5, to_seq=9)
    assert [e["seq"] for e in window["events"]] == [5, 6, 7, 8, 9]
    assert window["stretches"][0]["worker"] == "?"  # The window opens inside a stretch.


async def test_timeline_refuses_an_oversized_window(engine: Engine, tmp_path: Path) -> None:
    """More events than one page draws: a clear error naming --from and --to."""
    from wal_engine.audit import timeline

    engine.register("audited", audited)
    task_id = await engine.submit("audited", {"q": "t"})
    original = timeline.timeline_events_max
    timeline.timeline_events_max = 0
    try:
        target = tmp_path / "never-written.html"
        result = await cli("timeline", task_id, "--html", str(target), "--dsn",
                           engine.database.dsn)
    finally:
        timeline.timeline_events_max = original
    assert result.exit_code == 2 and "--from and --to" in result.stderr
    assert not await asyncio.to_thread(target.exists)


async def test_timeline_command_writes_a_self_contained_page(engine: Engine,
                                                             tmp_path: Path) -> None:
    """The file embeds its CSS, script and data; nothing is fetched from anywhere."""
    task_id = await _history_with_an_orphaned_lease(engine)
    target = tmp_path / "timeline.html"
    result = await cli("timeline", task_id, "--html", str(target), "--dsn",
                       engine.database.dsn, "--json")
    assert result.exit_code == 0, result.output
    (written,) = lines(result.stdout)
    assert written == {"task_id": task_id, "file": str(target),
                       "events": len(await engine.history(task_id))}
    page = target.read_text(encoding="utf-8")
    assert all(url.startswith("data:")
               for url in re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", page))
    assert "<link rel=\"stylesheet\"" not in page and "@import" not in page
    assert HOSTILE not in page  # The payload is embedded escaped, never as markup.


# ----------------------------------------------------------------------------- Chromium


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.events: list[dict[str, Any]] = []
        self._next_id = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        ident = self._next_id
        await self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(await asyncio.wait_for(self.socket.recv(), 30))
            if message.get("id") == ident:
                assert "error" not in message, message
                return dict(message.get("result", {}))
            self.events.append(message)

    async def until(self, method: str, timeout_s: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {method}"
            self.events.append(json.loads(await asyncio.wait_for(self.socket.recv(),
                                                                 remaining)))

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions, failed loads and dialogs seen so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown" or method == "Page.javascriptDialogOpening":
                found.append(f"{method}: {params}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error",
                                                                                "assert"):
                found.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(f"log: {params['entry'].get('text')}")
        return found

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]


def _launch_chromium(profile: Path) -> subprocess.Popen[bytes]:
    """Headless Chromium with a fresh profile and a DevTools port of its choosing."""
    assert CHROMIUM is not None
    return subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--no-first-run", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--window-size=1400,1000", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _open_chromium(profile: Path) -> tuple[subprocess.Popen[bytes], str]:
    process = _launch_chromium(profile)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text().strip():
        assert process.poll() is None, "chromium exited at start"
        assert time.monotonic() < deadline, "chromium did not open its DevTools port"
        await asyncio.sleep(0.1)
    port = port_file.read_text().split()[0]
    page_url = None
    while page_url is None:
        assert time.monotonic() < deadline, "chromium opened no page"
        listing = await asyncio.to_thread(_get_json, f"http://127.0.0.1:{port}/json/list")
        page_url = next((t["webSocketDebuggerUrl"] for t in listing if t["type"] == "page"),
                        None)
        await asyncio.sleep(0.1)
    return process, page_url


def _get_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.mark.skipif(CHROMIUM is None,
                    reason="chromium is not installed (apt-get install -y chromium)")
async def test_timeline_page_in_headless_chromium(engine: Engine, tmp_path: Path) -> None:
    """Loads with no console error and no fetch, one mark per event, a click shows the
    payload (a hostile one as text), both scales render; a screenshot is kept."""
    websockets = pytest.importorskip("websockets.asyncio.client",
                                     reason="the websockets test dependency is missing")
    task_id = await _history_with_an_orphaned_lease(engine)
    events = len(await engine.history(task_id))
    target = tmp_path / "timeline.html"
    result = await cli("timeline", task_id, "--html", str(target), "--dsn", engine.database.dsn)
    assert result.exit_code == 0, result.output
    process, page_url = await _open_chromium(tmp_path / "profile")
    try:
        async with websockets.connect(page_url, max_size=None) as socket:
            tools = DevTools(socket)
            for domain in ("Runtime", "Log", "Network", "Page"):
                await tools.call(f"{domain}.enable")
            await tools.call("Page.navigate", url=target.as_uri())
            await tools.until("Page.loadEventFired")
            assert await tools.evaluate("document.body.dataset.rendered") == str(events)
            assert await tools.evaluate("document.querySelectorAll('circle.mark').length") \
                == events
            marks = await tools.evaluate(
                "[...document.querySelectorAll('circle.mark')].map(m => +m.dataset.seq)")
            assert sorted(marks) == list(range(1, events + 1))
            message_seq = next(r.seq for r in await engine.history(task_id)
                               if r.type == "message_appended")
            await tools.evaluate("document.getElementById('scale-seq').click()")
            await _click_mark(tools, message_seq)
            assert await tools.evaluate("document.getElementById('detail-title').textContent") \
                == f"seq {message_seq} \u00b7 message_appended"
            shown = json.loads(await tools.evaluate(
                "document.getElementById('payload').textContent"))
            assert shown["content"] == HOSTILE
            assert await tools.evaluate("document.querySelectorAll('b').length") \
                == await tools.evaluate("document.querySelectorAll('#facts b').length")
            await tools.evaluate("document.getElementById('scale-time').click()")
            assert await tools.evaluate("document.querySelectorAll('circle.mark').length") \
                == events
            assert await tools.evaluate("document.querySelectorAll('.mark.selected').length") \
                == 1
            ARTIFACTS.mkdir(exist_ok=True)
            shot = await tools.call("Page.captureScreenshot", format="png")
            (ARTIFACTS / "timeline.png").write_bytes(base64.b64decode(shot["data"]))
            shutil.copy(target, ARTIFACTS / "timeline.html")
            assert tools.problems() == []
            assert all(url.startswith(("file://", "data:")) for url in tools.requests())
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)


async def _click_mark(tools: DevTools, seq: int) -> None:
    """A real mouse click (press and release) at the centre of the mark of ``seq``."""
    box = await tools.evaluate(
        f"(() => {{ const m = document.querySelector('circle.mark[data-seq=\"{seq}\"]');"
        "m.scrollIntoView({block: 'center', inline: 'center'});"
        "const r = m.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2];"
        "})()")
    for kind in ("mousePressed", "mouseReleased"):
        await tools.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1],
                         button="left", clickCount=1)
