"""Hosts on one machine: network namespaces joined by a bridge, for multi-host fault tests.

A :class:`Lab` makes one network namespace per host (``ip netns add``, names unique to the
lab), a bridge in the hub host's namespace and one veth pair per other host: its end
``eth0`` in the host, the other end a port of the bridge. The hosts get addresses in a
private /24 that no route or address of the machine's own namespace overlaps. Nothing is
added to the machine's own namespace: every link lives in a namespace the lab made, so
deleting the namespaces (:meth:`Lab.close`, also on failure) deletes every link too.

Faults on one host's link: :meth:`Lab.cut` sets the bridge's port of the host down (the
cable pulled at the switch: the host's packets go nowhere, its sockets stay open), and
:meth:`Lab.impair` puts ``tc netem`` loss and delay on both ends of its link (the kernel
needs ``sch_netem``: :class:`NetemUnavailable` says so when it is refused).

:class:`NamespacedPostgres` runs a PostgreSQL server inside a host: ``initdb`` and
``postgres`` as an unprivileged user, listening on the host's address (trust for the lab's
subnet) and on a Unix socket in its data directory, which the test process, outside every
namespace, connects through (a path socket belongs to the file system, not to a network
namespace).

Everything here needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``); :func:`unavailable`
tells why a lab cannot be made on this machine, for a test to skip with.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pwd
import random
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

from wal_engine.embedded import fallback_user_name, find_pg_bin, server_user_name, superuser_name
from wal_engine.testing.postgres import scratch_root

IP: Final = "ip"
TC: Final = "tc"
command_timeout_s: Final = 30.0
postgres_start_timeout_s: Final = 60.0
postgres_stop_timeout_s: Final = 30.0
postgres_port: Final = 5432
"""The server's port inside its own namespace: nothing else listens there."""
subnet_candidates: Final = tuple(f"10.{second}.{third}.0/24"
                                 for second in (231, 232, 233) for third in range(16, 32))
"""Private /24s a lab may take, in a random order (two labs at once pick different ones, or
would clash only inside their own namespaces, which share nothing)."""


class LabError(RuntimeError):
    """A command that makes or changes the lab failed (its stderr is in the message)."""


class NetemUnavailable(LabError):
    """``tc qdisc add ... netem`` was refused: the kernel has no ``sch_netem``."""


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(list(argv), capture_output=True, text=True,
                               timeout=command_timeout_s, check=False)
    if check and completed.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({completed.returncode}): "
                       f"{(completed.stderr or completed.stdout).strip()}")
    return completed


def unavailable() -> str | None:
    """Why no lab can be made here (not root, no ``ip``, namespaces refused), else None.

    Probes by making and deleting one namespace, so a sandbox that forbids them is found."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which(IP) is None:
        return "the ip command (iproute2) is not installed"
    probe = f"walprobe{os.getpid()}{random.randrange(16**4):04x}"
    try:
        made = _run([IP, "netns", "add", probe], check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return f"`ip netns add` could not run: {error!r}"
    if made.returncode != 0:
        return f"`ip netns add` was refused here: {made.stderr.strip()}"
    _run([IP, "netns", "del", probe], check=False)
    return None


def _taken_networks() -> list[ipaddress.IPv4Network]:
    """Networks of the machine's own namespace: its routes and its addresses."""
    taken: list[ipaddress.IPv4Network] = []
    for argv in ([IP, "-4", "-o", "route", "show", "table", "all"], [IP, "-4", "-o", "addr"]):
        for line in _run(argv, check=False).stdout.splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in word or word[:1].isdigit():
                        taken.append(ipaddress.IPv4Network(word, strict=False))
    return [network for network in taken if network.prefixlen > 0]


def pick_subnet(rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A private /24 overlapping no route or address of the machine's namespace."""
    taken = _taken_networks()
    candidates = list(subnet_candidates)
    (rng or random.Random()).shuffle(candidates)
    for text in candidates:
        network = ipaddress.IPv4Network(text)
        if not any(network.overlaps(other) for other in taken):
            return network
    raise LabError(f"every candidate subnet overlaps a network of this machine: {taken}")


class Lab:
    """Namespaces for ``hosts``; the first is the hub, whose bridge joins the others.

    Use as a context manager, or call :meth:`close` (it deletes whatever was made, even
    after a failure half-way through :meth:`create`)."""

    def __init__(self, hosts: Sequence[str], *, tag: str | None = None) -> None:
        if len(hosts) < 2 or len(set(hosts)) != len(hosts):
            raise ValueError(f"a lab needs two or more distinct hosts, not {hosts!r}")
        self.hosts: Final = tuple(hosts)
        self.hub: Final = hosts[0]
        self.tag: Final = tag or f"wal{os.getpid()}{random.randrange(16**4):04x}"
        self.subnet = pick_subnet()
        addresses = self.subnet.hosts()
        self._addresses = {host: str(next(addresses)) for host in self.hosts}
        self._made: list[str] = []
        self._impaired: set[str] = set()

    # ------------------------------------------------------------------ naming

    def namespace(self, host: str) -> str:
        """The network namespace of ``host``."""
        self._known(host)
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of ``host`` in the lab's subnet (the hub's is on its bridge)."""
        self._known(host)
        return self._addresses[host]

    def port_name(self, host: str) -> str:
        """The bridge's port (in the hub) that ``host`` is plugged into."""
        self._known(host)
        return f"p-{host}"[:15]

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host`` (``ip netns exec``)."""
        return [IP, "netns", "exec", self.namespace(host), *argv]

    def _known(self, host: str) -> None:
        if host not in self.hosts:
            raise ValueError(f"{host!r} is not a host of this lab ({', '.join(self.hosts)})")

    # ------------------------------------------------------------------ building

    def create(self) -> Lab:
        """Make the namespaces, the bridge and the links; bring everything up."""
        prefix = self.subnet.prefixlen
        try:
            for host in self.hosts:
                _run([IP, "netns", "add", self.namespace(host)])
                self._made.append(self.namespace(host))
                self._in(host, [IP, "link", "set", "lo", "up"])
            hub = self.namespace(self.hub)
            self._in(self.hub, [IP, "link", "add", "br0", "type", "bridge"])
            self._in(self.hub, [IP, "addr", "add", f"{self.address(self.hub)}/{prefix}",
                                "dev", "br0"])
            self._in(self.hub, [IP, "link", "set", "br0", "up"])
            for host in self.hosts[1:]:
                port = self.port_name(host)
                _run([IP, "link", "add", "eth0", "netns", self.namespace(host), "type", "veth",
                      "peer", "name", port, "netns", hub])
                self._in(self.hub, [IP, "link", "set", port, "master", "br0"])
                self._in(self.hub, [IP, "link", "set", port, "up"])
                self._in(host, [IP, "addr", "add", f"{self.address(host)}/{prefix}",
                                "dev", "eth0"])
                self._in(host, [IP, "link", "set", "eth0", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def _in(self, host: str, argv: Sequence[str], *, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        return _run(self.exec_argv(host, argv), check=check)

    # ------------------------------------------------------------------ faults

    def cut(self, host: str) -> None:
        """Pull ``host``'s cable at the switch: its bridge port goes down."""
        self._in(self.hub, [IP, "link", "set", self.port_name(host), "down"])

    def restore(self, host: str) -> None:
        """Plug ``host`` back in (and lift any :meth:`impair`)."""
        self._in(self.hub, [IP, "link", "set", self.port_name(host), "up"])
        self.clear_impairment(host)

    def impair(self, host: str, *, loss_percent: float, delay_ms: int) -> None:
        """``tc netem`` loss and delay on both ends of ``host``'s link.

        Raises:
            NetemUnavailable: tc refused netem (its message says why).
        """
        if shutil.which(TC) is None:
            raise NetemUnavailable("the tc command (iproute2) is not installed")
        rule = ["netem", "loss", f"{loss_percent}%", "delay", f"{delay_ms}ms"]
        for where, device in ((host, "eth0"), (self.hub, self.port_name(host))):
            done = self._in(where, [TC, "qdisc", "add", "dev", device, "root", *rule],
                            check=False)
            if done.returncode != 0:
                self.clear_impairment(host)
                raise NetemUnavailable(
                    f"`tc qdisc add dev {device} root {' '.join(rule)}` was refused: "
                    f"{done.stderr.strip()} (the kernel needs sch_netem)")
            self._impaired.add(host)

    def clear_impairment(self, host: str) -> None:
        """Remove the netem rules :meth:`impair` put on ``host``'s link, if any."""
        if host not in self._impaired:
            return
        self._impaired.discard(host)
        for where, device in ((host, "eth0"), (self.hub, self.port_name(host))):
            self._in(where, [TC, "qdisc", "del", "dev", device, "root"], check=False)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Delete every namespace this lab made (and so every link in them)."""
        while self._made:
            namespace = self._made.pop()
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _run([IP, "netns", "del", namespace], check=False)

    def leftovers(self) -> list[str]:
        """Namespaces of this lab that still exist (empty after :meth:`close`)."""
        listed = _run([IP, "netns", "list"], check=False).stdout.split()
        return sorted(name for name in listed if name.startswith(f"{self.tag}-"))

    def __enter__(self) -> Lab:
        return self.create()

    def __exit__(self, *_exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- the database host


def _server_user() -> pwd.struct_passwd:
    for name in (server_user_name, fallback_user_name):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise LabError(f"no unprivileged user ({server_user_name} or {fallback_user_name}) to "
                   "run PostgreSQL as")


def _system_bin_dirs() -> list[Path]:
    """Debian's server binaries first (readable by any user), newest version first."""
    return sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                  key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
                  reverse=True)


class NamespacedPostgres:
    """A PostgreSQL server run by an unprivileged user inside one host of a :class:`Lab`."""

    def __init__(self, lab: Lab, host: str, *, settings: Mapping[str, str] | None = None
                 ) -> None:
        self.lab = lab
        self.host = host
        self.root = scratch_root("wal-engine-netns-")
        self.data_dir = self.root / "pgdata"
        self.log_path = self.root / "server.log"
        self.settings = dict(settings or {})
        self._process: subprocess.Popen[bytes] | None = None
        self._account = _server_user()
        candidates = [path for path in _system_bin_dirs()
                      if (path / "initdb").exists() and (path / "postgres").exists()]
        self.bin_dir = candidates[0] if candidates else find_pg_bin()

    def _as_server_user(self, argv: Sequence[str]) -> list[str]:
        return ["setpriv", f"--reuid={self._account.pw_uid}",
                f"--regid={self._account.pw_gid}", "--clear-groups", "--", *argv]

    def start(self) -> NamespacedPostgres:
        """initdb, then start ``postgres`` in the host and wait until it accepts sessions."""
        os.chmod(self.root, 0o755)
        self.data_dir.mkdir(mode=0o700)
        os.chown(self.data_dir, self._account.pw_uid, self._account.pw_gid)
        initdb = subprocess.run(
            self._as_server_user([str(self.bin_dir / "initdb"), "-D", str(self.data_dir),
                                  "-U", superuser_name, "--auth=trust", "--encoding=UTF8",
                                  "--no-locale", "--no-sync"]),
            capture_output=True, text=True, timeout=120, check=False, cwd="/")
        if initdb.returncode != 0:
            raise LabError(f"initdb failed: {initdb.stdout}{initdb.stderr}")
        with (self.data_dir / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {self.lab.subnet} trust\n")
        settings = {
            "listen_addresses": self.lab.address(self.host), "port": str(postgres_port),
            "unix_socket_directories": str(self.data_dir), "fsync": "off",
            "full_page_writes": "off", "synchronous_commit": "on", "max_connections": "200",
            "logging_collector": "off", **self.settings,
        }
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("".join(f"{key} = '{value}'\n" for key, value in settings.items()))
        log = self.log_path.open("wb")
        try:
            self._process = subprocess.Popen(
                self.lab.exec_argv(self.host, self._as_server_user(
                    [str(self.bin_dir / "postgres"), "-D", str(self.data_dir)])),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/")
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        socket_path = self.data_dir / f".s.PGSQL.{postgres_port}"
        deadline = time.monotonic() + postgres_start_timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                break
            ready = subprocess.run(
                [str(self.bin_dir / "pg_isready"), "-h", str(self.data_dir), "-p",
                 str(postgres_port), "-U", superuser_name], capture_output=True, check=False,
                timeout=command_timeout_s) if socket_path.exists() else None
            if ready is not None and ready.returncode == 0:
                return
            time.sleep(0.05)
        raise LabError(f"PostgreSQL in {self.host} did not start:\n{self.log_tail()}")

    def dsn(self, database: str = "postgres") -> str:
        """The DSN the lab's hosts use (TCP to the host's address)."""
        return (f"postgresql://{superuser_name}@{self.lab.address(self.host)}:{postgres_port}"
                f"/{database}?sslmode=disable")

    def local_dsn(self, database: str = "postgres") -> str:
        """The DSN of the test process, outside the namespaces (the Unix socket)."""
        return (f"postgresql://{superuser_name}@/{database}?host={self.data_dir}"
                f"&port={postgres_port}")

    def log_tail(self, size: int = 4000) -> str:
        """The end of the server's log."""
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-size:]
        return "(no server log)"

    def stop(self) -> None:
        """Stop the server (fast shutdown, then a kill) and remove its files."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            # ip netns exec execs setpriv, which execs postgres: the pid is the postmaster.
            process.send_signal(2)  # SIGINT: fast shutdown
            try:
                process.wait(timeout=postgres_stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=postgres_stop_timeout_s)
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def lab_with_database(hosts: Sequence[str]) -> Iterator[tuple[Lab, NamespacedPostgres]]:
    """A :class:`Lab` of ``hosts`` whose hub (the first) runs a :class:`NamespacedPostgres`;
    both are torn down when the block ends, whatever happens in it."""
    lab = Lab(hosts)
    server: NamespacedPostgres | None = None
    try:
        lab.create()
        server = NamespacedPostgres(lab, lab.hub)
        server.start()
        yield lab, server
    finally:
        if server is not None:
            server.stop()
        lab.close()
