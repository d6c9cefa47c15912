"""What a new user does, start to end, through the installed ``wal-engine`` command only.

A fresh virtual environment gets the project the way a user gets it (a real, non-editable
``pip install`` of the checkout with the ``embedded`` extra, its dependencies resolved by pip
from the machine's configured index); the README's first command, ``wal-engine demo``, runs
on an embedded server of its own; then ``wal-engine setup`` prepares an empty database on
the test suite's PostgreSQL (its own embedded server or ``WAL_ENGINE_TEST_DSN``'s) and,
logged in as the application role it prints, a worker serves the README's ``triage`` agent
while ``submit``, ``timer fire``, ``signal``, ``pending``, ``approve``, ``show``, ``verify``
and ``timeline`` take its task to the end, and Ctrl-C stops the worker.

No process inherits this checkout: PYTHONPATH and every ``WAL_ENGINE_*`` variable are
removed, and commands run in a project directory of their own, so the code that runs is
the installed copy (the first step checks where it was imported from).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
import pytest_asyncio

from wal_engine.testing.postgres import TestServer

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 300
DEMO_TIMEOUT_S = 120
STEP_TIMEOUT_S = 60
STATE_DEADLINE_S = 30
WORKER_STOP_DEADLINE_S = 20
TICKET = {"text": "charged twice", "customer": "c-1"}
DROP_ROLE = "SELECT format('DROP OWNED BY %I', $1::text), format('DROP ROLE %I', $1::text)"


@dataclass(frozen=True)
class Install:
    """The user's virtual environment, the environment its commands run in, and their cwd."""

    venv: Path
    env: dict[str, str]
    project: Path

    @property
    def wal_engine(self) -> str:
        return str(self.venv / "bin" / "wal-engine")


def _clean_env(venv: Path) -> dict[str, str]:
    """The caller's environment as a user's shell with the venv activated would have it:
    nothing of this checkout or of the test session."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
           and not key.startswith(("WAL_ENGINE_", "PYTEST_", "HYPOTHESIS_"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _described(args: list[str], done: subprocess.CompletedProcess[str]) -> str:
    return (f"`{' '.join(args)}` exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
            f"\n--- stderr\n{done.stderr[-4000:]}")


def run(install: Install, *args: str, expect: int = 0, timeout: float = STEP_TIMEOUT_S,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``wal-engine ARGS`` from the venv in the project directory; assert its exit code
    (the failure shows the command's stdout and stderr)."""
    command = [install.wal_engine, *args]
    done = subprocess.run(command, cwd=install.project, env=env or install.env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == expect, _described(command, done)
    return done


def json_lines(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """Every line of a ``--json`` command's standard output, parsed."""
    return [orjson.loads(line) for line in done.stdout.splitlines() if line.strip()]


def one_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    found = json_lines(done)
    assert len(found) == 1, f"expected one JSON line, got {done.stdout!r}"
    return found[0]


@pytest.fixture(scope="module")
def workspace() -> Iterator[Path]:
    """A directory for the venv, the project and the demo's data directory, made with
    mkdtemp: the embedded servers run as an unprivileged user when the tests run as root,
    and pytest's tmp_path root is reset to mode 0700 by every pytest session that starts
    meanwhile (which cut a running demo server off from its own binaries)."""
    base = Path(tempfile.mkdtemp(prefix="wal-engine-walkthrough-"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def install(workspace: Path) -> Iterator[Install]:
    """``python -m venv`` and ``pip install 'CHECKOUT[embedded]'``, as a user does."""
    venv, project = workspace / "venv", workspace / "project"
    project.mkdir()
    started = time.monotonic()
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    assert made.returncode == 0, _described(["venv"], made)
    env = _clean_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", f"{ROOT}[embedded]"]
    installed = subprocess.run(pip, cwd=project, env=env, capture_output=True, text=True,
                               timeout=INSTALL_TIMEOUT_S, check=False)
    assert installed.returncode == 0, _described(pip, installed)
    print(f"walkthrough: venv and pip install took {time.monotonic() - started:.1f} s")
    yield Install(venv, env, project)
    data_dir = workspace / "pgdata"
    if data_dir.exists():  # The demo's embedded server keeps running after the demo.
        run(Install(venv, {**env, "WAL_ENGINE_DATA_DIR": str(data_dir)}, project),
            "embedded", "stop")


@pytest_asyncio.fixture(scope="module")
async def empty_database(pg_server: TestServer) -> AsyncIterator[str]:
    """The superuser DSN of a new, empty database (no schema: ``setup`` applies it); the
    database and the tenant roles made on it are dropped afterwards."""
    name = f"walt_{os.getpid()}_walkthrough"
    admin = await asyncpg.connect(pg_server.admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = pg_server.dsn(name)
    yield dsn
    await _drop(pg_server, dsn, name)


async def _drop(pg_server: TestServer, dsn: str, name: str) -> None:
    on_database = await asyncpg.connect(dsn)
    try:
        roles = []
        if await on_database.fetchval("SELECT to_regclass('wal_tenant_roles') IS NOT NULL"):
            roles = await on_database.fetch("SELECT role_name FROM wal_tenant_roles")
        for (role,) in roles:
            await on_database.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                      " WHERE usename = $1", role)
            owned, _ = await on_database.fetchrow(DROP_ROLE, role)
            await on_database.execute(owned)
    finally:
        await on_database.close()
    admin = await asyncpg.connect(pg_server.admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        for (role,) in roles:
            _, drop = await admin.fetchrow(DROP_ROLE, role)
            await admin.execute(drop)
    finally:
        await admin.close()


def test_the_installed_command_is_the_checkout_s_version(install: Install) -> None:
    """``wal-engine --version`` is the project's version, imported from the venv."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version in run(install, "--version").stdout
    python = str(install.venv / "bin" / "python")
    where = subprocess.run([python, "-c", "import wal_engine; print(wal_engine.__file__)"],
                           cwd=install.project, env=install.env, capture_output=True,
                           text=True, timeout=STEP_TIMEOUT_S, check=False)
    assert where.returncode == 0, _described([python], where)
    assert Path(where.stdout.strip()).is_relative_to(install.venv), where.stdout


def test_the_demo_does_what_the_readme_says(install: Install, workspace: Path) -> None:
    """The README's first command: a worker SIGKILLed mid-task, another resuming it from
    the log, an approval, the verified chain, each side effect once."""
    first = re.search(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert first is not None and first.group(1).endswith("&& wal-engine demo")
    done = run(install, "demo", timeout=DEMO_TIMEOUT_S,
               env={**install.env, "WAL_ENGINE_DATA_DIR": str(workspace / "pgdata")})
    out = done.stdout
    (task_id,) = re.findall(r"^submitted task (t-[0-9a-f]{32})$", out, re.M)
    assert "worker-A exited with -9 (SIGKILL is -9)" in out
    assert "worker-B started; A's lease expires" in out
    assert "task waits for approval of send_report" in out
    for event in ("task_orphaned", "task_resumed", "approval_decided", "task_completed"):
        assert event in out, event
    assert re.search(r"^hash chain: verified \(\d+ events", out, re.M), out
    assert "fetch_page: reached 3x, acted 1x" in out
    assert re.search(r"side effects: (\d+) ran for \1 tool calls .*each exactly once", out), out
    assert "final status COMPLETED" in out and "demo passed in" in out
    assert task_id in out


def test_setup_then_a_task_as_the_application_role(install: Install,
                                                   empty_database: str) -> None:
    """setup prints an application DSN; as that role, the README's triage agent runs to
    COMPLETED through submit, timer fire, signal, pending and approve; verify and timeline
    read it back; Ctrl-C stops the worker cleanly."""
    empty = run(install, "tasks", "--dsn", empty_database, expect=4)
    assert "no wal-engine schema found" in empty.stderr
    made = one_json(run(install, "setup", "--dsn", empty_database, "--json"))
    assert made["tenant"] == "default" and made["password_generated"] is True
    app_dsn = made["app_dsn"]
    assert app_dsn.startswith(f"postgresql://{made['role']}:")
    assert app_dsn.endswith(empty_database.rsplit("@", 1)[1])
    app = Install(install.venv, {**install.env, "WAL_ENGINE_DSN": app_dsn}, install.project)
    (install.project / "triage.py").write_text(_readme_agent())
    worker = _start_worker(app)
    try:
        task_id = _run_the_task(app)
        _read_it_back(app, task_id)
    except BaseException:
        worker.halt()
        print(f"--- worker log\n{worker.log.read_text()}")  # Shown with the failure.
        raise
    logged = _stop_worker(worker)
    assert f'"task_id":"{task_id}"' in logged and '"event":"task_completed"' in logged
    assert '"event":"worker_stopped"' in logged


def _readme_agent() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    # The triage agent's block (the integrations'
    # sections later in the README have a register(engine) of their own).
    agent = next(str(block) for block in blocks if "def register(engine: Engine)" in block
                 and "class Ticket" in block)
    return agent


@dataclass
class Worker:
    """A ``wal-engine worker`` subprocess and the file its output goes to."""

    process: subprocess.Popen[bytes]
    log: Path

    def halt(self) -> None:
        """SIGKILL it (a failed test must not leave it running)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=WORKER_STOP_DEADLINE_S)


def _start_worker(app: Install) -> Worker:
    """``wal-engine worker --agents triage:register --dsn APP_DSN`` in the directory holding
    triage.py (the working directory is importable, as the README has it; the other
    commands take the DSN from WAL_ENGINE_DSN); returns once it runs."""
    log = app.project / "worker.log"
    env = dict(app.env)
    command = [app.wal_engine, "worker", "--agents", "triage:register",
               "--dsn", env.pop("WAL_ENGINE_DSN")]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, cwd=app.project, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT)
    worker = Worker(process, log)
    deadline = time.monotonic() + STATE_DEADLINE_S
    while '"event":"worker_started"' not in log.read_text():
        exited = process.poll()
        assert exited is None, f"worker exited {exited}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"worker did not start:\n{log.read_text()}"
        time.sleep(0.1)
    return worker


def _stop_worker(worker: Worker) -> str:
    """Ctrl-C: the worker drains and exits 0 within the deadline; returns its log."""
    if worker.process.poll() is None:
        worker.process.send_signal(signal.SIGINT)
    try:
        code = worker.process.wait(timeout=WORKER_STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        worker.halt()
        raise AssertionError(f"worker ignored SIGINT:\n{worker.log.read_text()}") from None
    logged = worker.log.read_text()
    assert code == 0, f"worker exited {code}:\n{logged}"
    assert "draining: 0 task(s) handing back" in logged, logged
    return logged


def _wait_for(app: Install, task_id: str, what: str,
              reached: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll ``show TASK --json`` until ``reached(state)``, with a deadline."""
    deadline = time.monotonic() + STATE_DEADLINE_S
    while True:
        state = one_json(run(app, "show", task_id, "--json"))
        if reached(state):
            return state
        assert time.monotonic() < deadline, f"waited for {what}: {state}"
        time.sleep(0.2)


def _asleep(state: dict[str, Any]) -> bool:
    return bool(state["status"] == "WAITING" and "timer_id" in (state["waiting_on"] or {}))


def _awaiting(signal_name: str) -> Callable[[dict[str, Any]], bool]:
    def awaiting(state: dict[str, Any]) -> bool:
        return bool(state["status"] == "WAITING"
                    and (state["waiting_on"] or {}).get("signal") == signal_name)
    return awaiting


def _completed(state: dict[str, Any]) -> bool:
    return bool(state["status"] == "COMPLETED")


def _run_the_task(app: Install) -> str:
    submitted = run(app, "submit", "triage", "--input", orjson.dumps(TICKET).decode(),
                    "--json")
    assert "warning" not in submitted.stderr, submitted.stderr  # The worker registered it.
    queued = one_json(submitted)
    task_id = str(queued["task_id"])
    # The worker may claim it before submit reads the head back.
    assert queued["agent"] == "triage" and queued["status"] in ("QUEUED", "RUNNING")
    asleep = _wait_for(app, task_id, "the durable sleep", _asleep)
    assert asleep["usage"]["tool_calls"] == 1 and asleep["next_action"] == "lookup"
    assert one_json(run(app, "timer", "fire", task_id, "--json")) == {
        "task_id": task_id, "fired": True}
    _wait_for(app, task_id, "the signal manager_ok", _awaiting("manager_ok"))
    (awaited,) = json_lines(run(app, "pending", "--json"))
    assert awaited["waiting_for"] == "signal" and awaited["signal"] == "manager_ok"
    sent = one_json(run(app, "signal", task_id, "manager_ok", "--payload", '{"ok": true}',
                        "--json"))
    assert sent["task_id"] == task_id and sent["name"] == "manager_ok"
    approval = _wait_for_approval(app, task_id)
    human = run(app, "pending").stdout
    assert f"wal-engine approve {task_id} {approval['call_id']} --approver NAME" in human
    approved = one_json(run(app, "approve", task_id, approval["call_id"], "--approver", "ops",
                            "--json"))
    assert approved["approved"] is True and approved["approver"] == "ops"
    done = _wait_for(app, task_id, "COMPLETED", _completed)
    assert done["output"]["refund"] == {"refunded": 20}
    assert done["output"]["approval"] == {"ok": True}
    assert done["output"]["account"] == {"id": "c-1", "tier": "gold"}
    return task_id


def _wait_for_approval(app: Install, task_id: str) -> dict[str, Any]:
    """Poll ``pending --json`` until the task's refund waits for approval."""
    deadline = time.monotonic() + STATE_DEADLINE_S
    while True:
        waiting = json_lines(run(app, "pending", "--json"))
        if waiting and waiting[0]["waiting_for"] == "approval":
            (approval,) = waiting
            assert approval["task_id"] == task_id and approval["tool"] == "refund"
            assert re.fullmatch(r"[0-9a-f]{64}", approval["args_hash"]), approval
            return approval
        assert time.monotonic() < deadline, f"no approval pending: {waiting}"
        time.sleep(0.2)


def _read_it_back(app: Install, task_id: str) -> None:
    verified = one_json(run(app, "verify", task_id, "--json"))
    assert verified["ok"] is True and verified["violation"] is None, verified
    assert verified["task_id"] == task_id and verified["events"] == verified["head_seq"]
    everything = json_lines(run(app, "verify", "--all", "--json"))
    assert [(v["task_id"], v["ok"]) for v in everything] == [(task_id, True)]
    (listed,) = json_lines(run(app, "tasks", "--json"))
    assert listed["task_id"] == task_id and listed["status"] == "COMPLETED"
    page = app.project / "timeline.html"
    drawn = one_json(run(app, "timeline", task_id, "--html", str(page), "--json"))
    assert drawn["task_id"] == task_id and drawn["events"] == verified["events"]
    html = page.read_text()
    assert html.lstrip().lower().startswith("<!doctype html")
    for text in (task_id, "task_submitted", "approval_decided", "signal_received",
                 "task_completed"):
        assert text in html, text
