"""A highly available PostgreSQL of a test's own: one etcd and three Patroni nodes.

:func:`start_cluster` starts Debian's ``etcd`` (3.4, the v3 API) on ports and a data
directory of its own, then three ``patroni`` (3.0) nodes that run PostgreSQL 15 from
``/usr/lib/postgresql/15/bin``, each with its own PostgreSQL and REST API ports and data
directory, with ``synchronous_mode: true`` (a commit returns only once the synchronous
standby has it, and only that standby may be promoted), ``use_pg_rewind: true`` (with data
checksums, so that a former leader can be rewound and rejoin) and a short TTL, so that a
lost leader is replaced within seconds. It never touches a server it did not start.

When this process is root the servers run as the unprivileged ``walengine`` account (the one
the embedded server uses; created when missing), else as the current user. Everything lives
under one scratch directory (on ``/dev/shm`` when it has room), removed by
:meth:`PatroniCluster.close`, which kills only the processes this object started.

The faults a test makes: :meth:`PatroniCluster.kill_node` (Patroni and its postmaster
SIGKILLed together, with the postmaster's children: the loss of the node's processes),
:meth:`PatroniCluster.start_node` (the node comes back and rejoins, rewound by pg_rewind
when it diverged), :meth:`PatroniCluster.switchover` (``patronictl switchover``).

Clients reach the leader through :meth:`PatroniCluster.dsn`, a multi-host DSN with
``target_session_attrs=read-write``: the driver tries each host and keeps the one that
accepts writes. A single address (HAProxy asking each node's ``GET /primary``, or a
virtual IP moved by a Patroni callback) does the same outside the client; see
docs/testing.md ("A highly available PostgreSQL").
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from wal_engine.testing.postgres import scratch_root

PG_BIN: Final = Path("/usr/lib/postgresql/15/bin")
SERVER_USER: Final = "walengine"
SUPERUSER: Final = "postgres"
DATABASE: Final = "walha"
start_timeout_s: Final = 120.0
stop_timeout_s: Final = 30.0
http_timeout_s: Final = 2.0
useradd_timeout_s: Final = 30.0
lag_max_bytes: Final = 1024 * 1024
"""A replica this far behind counts as caught up (Patroni's maximum_lag_on_failover)."""


class PatroniUnavailable(RuntimeError):
    """A package the cluster needs is missing, or the cluster did not come up."""


def missing_components() -> list[str]:
    """What is missing to start a cluster here (empty when everything is installed), each
    with the Debian package that provides it."""
    missing = [f"{name} (apt-get install {package})"
               for name, package in (("patroni", "patroni"), ("patronictl", "patroni"),
                                     ("etcd", "etcd-server"))
               if shutil.which(name) is None]
    for binary in ("postgres", "initdb", "pg_rewind", "pg_basebackup", "pg_ctl"):
        if not (PG_BIN / binary).exists():
            missing.append(f"{PG_BIN / binary} (apt-get install postgresql-15)")
    return missing


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True)
class Account:
    """Who the servers run as: None fields when they run as the current user."""

    name: str
    uid: int | None = None
    gid: int | None = None

    def popen_options(self) -> dict[str, Any]:
        """``subprocess.Popen`` options that run a child as this account."""
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def give(self, path: Path) -> None:
        """Make ``path`` (and what is under it) this account's."""
        if self.uid is None or self.gid is None:
            return
        for root, directories, files in os.walk(path):
            os.chown(root, self.uid, self.gid)
            for name in (*directories, *files):
                os.chown(Path(root) / name, self.uid, self.gid, follow_symlinks=False)


def server_account() -> Account:
    """The unprivileged ``walengine`` account when root (created when missing), else the
    current user (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return Account(pwd.getpwuid(os.geteuid()).pw_name)
    try:
        entry = pwd.getpwnam(SERVER_USER)
    except KeyError:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", SERVER_USER], capture_output=True,
                           timeout=useradd_timeout_s, check=True)
        try:
            entry = pwd.getpwnam(SERVER_USER)
        except KeyError as error:
            raise PatroniUnavailable(f"running as root, the servers need an unprivileged "
                                     f"user and {SERVER_USER!r} could not be made") from error
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _environment() -> dict[str, str]:
    """The servers' environment: ours without libpq's PG* variables (a PGPORT or PGHOST of
    the caller must not steer Patroni's own connections)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("PG")}


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            # Field 4 of stat, after the command name in parentheses (which may hold spaces).
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait(predicate: Any, what: str, timeout_s: float, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise PatroniUnavailable(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Etcd:
    """One etcd member (the cluster's DCS), on ports of its own."""

    root: Path
    account: Account
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client API."""
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        """Start etcd and wait until it is healthy."""
        data = self.root / "etcd"
        data.mkdir(mode=0o700)
        self.account.give(data)
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://{self.endpoint}"
        argv = ["etcd", "--name", "etcd0", "--data-dir", str(data),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"etcd0={peer}", "--initial-cluster-state", "new",
                "--initial-cluster-token", self.root.name, "--log-level", "warn"]
        with (self.root / "etcd.log").open("ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd="/", env=_environment(), start_new_session=True,
                **self.account.popen_options())
        _wait(self._healthy, "etcd to answer", start_timeout_s)

    def _healthy(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise PatroniUnavailable(f"etcd exited: {_tail(self.root / 'etcd.log')}")
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health",
                                        timeout=http_timeout_s) as answer:
                return bool(json.loads(answer.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        """SIGKILL etcd (its data is thrown away with the cluster)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=stop_timeout_s)


@dataclass
class PatroniNode:
    """One Patroni member and the PostgreSQL it runs."""

    name: str
    root: Path
    pg_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        """PostgreSQL's data directory."""
        return self.root / "pgdata"

    @property
    def config_path(self) -> Path:
        """The Patroni configuration file."""
        return self.root / "patroni.yml"

    @property
    def log_path(self) -> Path:
        """Patroni's output and PostgreSQL's log lines (stderr)."""
        return self.root / "patroni.log"

    def api(self, path: str, timeout_s: float = http_timeout_s) -> Any:
        """GET ``path`` of this node's REST API: (status, decoded JSON), or None when it does
        not answer."""
        url = f"http://127.0.0.1:{self.api_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as error:
            with contextlib.suppress(ValueError):
                return error.code, json.loads(error.read() or b"null")
            return error.code, None
        except (OSError, ValueError):
            return None

    def postmaster_pid(self) -> int | None:
        """The postmaster's pid, from the first line of ``postmaster.pid``."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().splitlines()[0]
            pid = int(first)
        except (OSError, IndexError, ValueError):
            return None
        return pid if _alive(pid) else None

    @property
    def running(self) -> bool:
        """Whether this node's Patroni runs."""
        return self.process is not None and self.process.poll() is None


class PatroniCluster:
    """etcd and three Patroni nodes (see the module docstring)."""

    def __init__(self, *, nodes: int = 3, ttl: int = 10, loop_wait: int = 1,
                 retry_timeout: int = 4, root: Path | None = None) -> None:
        if missing := missing_components():
            raise PatroniUnavailable("missing: " + ", ".join(missing))
        self.account = server_account()
        self.root = root or scratch_root("wal-engine-patroni-")
        self.root.chmod(0o755)
        self.scope = f"walha-{self.root.name}"
        self.ttl, self.loop_wait, self.retry_timeout = ttl, loop_wait, retry_timeout
        self.etcd = Etcd(self.root, self.account)
        self.nodes = {f"node{n}": PatroniNode(f"node{n}", self.root / f"node{n}")
                      for n in range(1, nodes + 1)}
        self.bootstrap_s: float | None = None

    # ------------------------------------------------------------------ addresses

    def dsn(self, database: str = DATABASE) -> str:
        """The multi-host DSN of every node, choosing the one that accepts writes."""
        hosts = ",".join(f"127.0.0.1:{node.pg_port}" for node in self.nodes.values())
        return (f"postgresql://{SUPERUSER}@{hosts}/{database}"
                f"?target_session_attrs=read-write")

    def node_dsn(self, name: str, database: str = DATABASE) -> str:
        """A DSN of one node only (whatever its role)."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.nodes[name].pg_port}/{database}"

    # ------------------------------------------------------------------ starting

    def start(self) -> PatroniCluster:
        """Start etcd and every node; wait for a leader, every replica streaming, a
        synchronous standby, and the test database; record ``bootstrap_s``."""
        started = time.monotonic()
        try:
            self.etcd.start()
            for index, node in enumerate(self.nodes.values()):
                node.root.mkdir(mode=0o700)
                self._write_config(node)
                self.account.give(node.root)
                self.start_node(node.name)
                if index == 0:
                    # The first node bootstraps the cluster alone: started together, two
                    # nodes could race for the initialize key and the loser aborted with
                    # "Failed to bootstrap cluster" (seen once under load in CI).
                    self.wait_for_leader(start_timeout_s)
            self.wait_healthy(start_timeout_s)
            self._create_database()
        except PatroniUnavailable as error:
            # What each server said, read before close() removes the scratch directory.
            logs = "\n".join(f"--- {path.relative_to(self.root)}\n{_tail(path)}"
                              for path in sorted(self.root.rglob("*.log")))
            self.close()
            raise PatroniUnavailable(f"{error}\n{logs}") from error
        except BaseException:
            self.close()
            raise
        self.bootstrap_s = time.monotonic() - started
        return self

    def _write_config(self, node: PatroniNode) -> None:
        """Patroni's YAML (JSON is YAML) for ``node``."""
        postgres_parameters = {
            "wal_log_hints": "on", "max_connections": 200, "shared_buffers": "32MB",
            "max_wal_senders": 10, "max_replication_slots": 10, "wal_keep_size": "128MB",
            "unix_socket_directories": str(node.root), "log_min_messages": "warning",
            "logging_collector": "off", "log_line_prefix": f"%m [%p] {node.name} ",
        }
        config = {
            "scope": self.scope, "namespace": "/wal-engine-test/", "name": node.name,
            "log": {"level": "INFO", "format": "%(asctime)s %(levelname)s: %(message)s"},
            "restapi": {"listen": f"127.0.0.1:{node.api_port}",
                        "connect_address": f"127.0.0.1:{node.api_port}"},
            "etcd3": {"hosts": [self.etcd.endpoint]},
            "bootstrap": {
                "dcs": {"ttl": self.ttl, "loop_wait": self.loop_wait,
                        "retry_timeout": self.retry_timeout,
                        "maximum_lag_on_failover": lag_max_bytes,
                        "synchronous_mode": True,
                        "postgresql": {"use_pg_rewind": True, "use_slots": True,
                                       "parameters": {"wal_log_hints": "on",
                                                      "max_connections": 200,
                                                      "max_wal_senders": 10,
                                                      "max_replication_slots": 10}}},
                "initdb": [{"encoding": "UTF8"}, "data-checksums",
                           {"auth-local": "trust"}, {"auth-host": "trust"}],
                "pg_hba": ["local all all trust",
                           "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.data_dir), "bin_dir": str(PG_BIN),
                "pgpass": str(node.root / "pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": SUPERUSER, "password": "postgres"},
                },
                "parameters": postgres_parameters,
                "pg_hba": ["local all all trust",
                           "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }
        node.config_path.write_text(json.dumps(config, indent=1))

    def start_node(self, name: str) -> None:
        """Start (or start again) the Patroni of ``name``; it starts its PostgreSQL and,
        after a loss, rejoins as a replica (pg_rewind when its history diverged)."""
        node = self.nodes[name]
        if node.running:
            raise PatroniUnavailable(f"{name} is already running")
        with node.log_path.open("ab") as log:
            node.process = subprocess.Popen(
                ["patroni", str(node.config_path)], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=str(node.root), env=_environment(),
                start_new_session=True, **self.account.popen_options())

    def _create_database(self) -> None:
        leader = self.nodes[self.wait_for_leader(start_timeout_s)]
        completed = subprocess.run(
            [str(PG_BIN / "psql"), "-h", "127.0.0.1", "-p", str(leader.pg_port), "-U",
             SUPERUSER, "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c",
             f"CREATE DATABASE {DATABASE}"],
            capture_output=True, text=True, timeout=start_timeout_s, env=_environment(),
            check=False)
        if completed.returncode != 0:
            raise PatroniUnavailable(f"CREATE DATABASE failed: {completed.stderr.strip()}")

    # ------------------------------------------------------------------ reading

    def members(self) -> list[dict[str, Any]]:
        """``GET /cluster`` of the first node that answers: each member's name, role
        (``leader``, ``sync_standby``, ``replica``), state, timeline and lag."""
        for node in self.nodes.values():
            if not node.running:
                continue
            answer = node.api("/cluster")
            if answer is not None and answer[0] == 200 and answer[1]:
                members: list[dict[str, Any]] = answer[1].get("members", [])
                return members
        return []

    def leader(self) -> str | None:
        """The name of the node that is leader and runs as primary now, per its own REST
        API (``GET /primary`` answers 200 only there), or None."""
        for node in self.nodes.values():
            if node.running:
                answer = node.api("/primary")
                if answer is not None and answer[0] == 200:
                    return node.name
        return None

    def wait_for_leader(self, timeout_s: float, *, other_than: str | None = None) -> str:
        """Wait until a node (not ``other_than``) is the running primary; its name."""
        def found() -> str | None:
            name = self.leader()
            return name if name is not None and name != other_than else None

        what = "a leader" + (f" other than {other_than}" if other_than else "")
        leader: str = _wait(found, what, timeout_s)
        return leader

    def wait_healthy(self, timeout_s: float, *, nodes: int | None = None) -> None:
        """Wait until ``nodes`` members (all by default) run, one leader, the others
        streaming, one of them the synchronous standby."""
        wanted = len(self.nodes) if nodes is None else nodes

        def healthy() -> bool:
            members = self.members()
            running = [m for m in members if m.get("state") in ("running", "streaming")]
            leaders = [m for m in members if m.get("role") == "leader"
                       and m.get("state") == "running"]
            # Patroni 3.0 says "running" for a replica whatever its WAL receiver does; a
            # numeric lag means it replays the leader's WAL.
            streaming = [m for m in members if m.get("role") in ("replica", "sync_standby")
                         and m.get("state") in ("running", "streaming")
                         and isinstance(m.get("lag"), int) and m["lag"] <= lag_max_bytes]
            sync = [m for m in members if m.get("role") == "sync_standby"]
            return (len(running) >= wanted and len(leaders) == 1
                    and len(streaming) >= wanted - 1 and (wanted < 2 or bool(sync)))

        _wait(healthy, f"{wanted} healthy members with a synchronous standby", timeout_s,
              0.2)

    def role(self, name: str) -> str | None:
        """``name``'s role per the cluster view (leader, sync_standby, replica), or None."""
        for member in self.members():
            if member.get("name") == name:
                role: str | None = member.get("role")
                return role
        return None

    def timeline(self, name: str) -> int | None:
        """``name``'s timeline per its own REST API."""
        answer = self.nodes[name].api("/patroni")
        if answer is None or not answer[1]:
            return None
        value = answer[1].get("timeline")
        return int(value) if value is not None else None

    def log(self, name: str) -> str:
        """Everything ``name``'s Patroni (and its PostgreSQL) printed."""
        return self.nodes[name].log_path.read_text(errors="replace")

    # ------------------------------------------------------------------ faults

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL the node's Patroni, its postmaster and the postmaster's children, all at
        once (the pids are collected first): nothing of the node shuts down cleanly.
        Returns the pids killed."""
        node = self.nodes[name]
        pids: list[int] = []
        postmaster = node.postmaster_pid()
        if postmaster is not None:
            pids += [postmaster, *_children(postmaster)]
        if node.process is not None and node.process.poll() is None:
            pids.insert(0, node.process.pid)
            pids += [pid for pid in _children(node.process.pid) if pid not in pids]
        for pid in pids:
            _kill(pid)
        if node.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=stop_timeout_s)
        _wait(lambda: not any(_alive(pid) for pid in pids), f"{name}'s processes to die",
              stop_timeout_s)
        return pids

    def switchover(self, candidate: str | None = None, timeout_s: float = 60.0) -> str:
        """A planned ``patronictl switchover`` from the leader to ``candidate`` (by default
        the synchronous standby); waits until the candidate is the running primary and
        returns its name."""
        leader = self.wait_for_leader(timeout_s)
        if candidate is None:
            sync = [m["name"] for m in self.members() if m.get("role") == "sync_standby"]
            if not sync:
                raise PatroniUnavailable("no synchronous standby to switch over to")
            candidate = sync[0]
        completed = subprocess.run(
            ["patronictl", "-c", str(self.nodes[leader].config_path), "switchover",
             self.scope, "--leader", leader, "--candidate", candidate, "--force"],
            capture_output=True, text=True, timeout=timeout_s, env=_environment(),
            check=False, cwd="/", **self.account.popen_options())
        if completed.returncode != 0:
            raise PatroniUnavailable(f"patronictl switchover failed: "
                                     f"{(completed.stdout + completed.stderr).strip()}")
        deadline = time.monotonic() + timeout_s
        _wait(lambda: self.leader() == candidate, f"{candidate} to lead",
              max(0.1, deadline - time.monotonic()))
        return candidate

    # ------------------------------------------------------------------ stopping

    def close(self) -> None:
        """Kill every process this cluster started (each node, then etcd) and remove its
        directory."""
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                if node.running or node.postmaster_pid() is not None:
                    self.kill_node(node.name)
        with contextlib.suppress(Exception):
            self.etcd.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_cluster(**options: Any) -> PatroniCluster:
    """Start a cluster (see :class:`PatroniCluster` for the options) and wait until it is
    healthy; :class:`PatroniUnavailable` when a component is missing or it did not come up."""
    return PatroniCluster(**options).start()
