"""Hosts on one machine: network namespaces joined by a bridge, for multi-host fault tests.

A :class:`Lab` makes one network namespace per host (``ip netns add``, names unique to the
lab), a bridge in the hub host's namespace and one veth pair per other host: its end
``eth0`` in the host, the other end a port of the bridge. The hosts get addresses in a
private /24 that no route or address of the machine's own namespace overlaps. Nothing is
added to the machine's own namespace: every link lives in a namespace the lab made, so
deleting the namespaces (:meth:`Lab.close`, also on failure) deletes every link too.

Faults on one host's link: :meth:`Lab.cut` sets the bridge's port of the host down (the
cable pulled at the switch: the host's packets go nowhere, its sockets stay open), and
:meth:`Lab.impair` makes its link lose and delay packets. With ``sch_netem`` in the kernel
that is ``tc netem`` loss and delay on both ends of the link. Without it (kernels built
without netem, such as this project's sandbox) the loss is made with nftables instead: a
``netdev`` ingress rule ``numgen random mod 10000 < N drop`` on each end of the link (the
host's ``eth0`` and the bridge's port of the host), so each direction loses its share of
packets on arrival, after the sender's stack has let them go, as on a lossy wire. A delay
cannot be made that way: nftables can drop or pass a packet, not hold it, and the qdiscs
such kernels do have (``tbf``, ``htb``) only delay what queues behind a rate limit (a
packet's transmission time at the rate, more under load), never a fixed latency; so a
delay without netem is refused (:class:`NetemUnavailable`) and nothing is applied.

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
import json
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
NFT: Final = "nft"
NETEM: Final = "netem"
NFTABLES: Final = "nftables"
loss_table: Final = "wal_lab_loss"
"""The nftables table (family ``netdev``) :meth:`Lab.impair` puts its drop rules in."""
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


class ImpairmentUnavailable(LabError):
    """The link cannot be impaired as asked on this machine (the message says why)."""


class NetemUnavailable(ImpairmentUnavailable):
    """A delay was asked for and ``tc qdisc add ... netem`` was refused: the kernel has no
    ``sch_netem`` (loss alone is still made, with nftables)."""


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
        self._impaired: dict[str, str] = {}
        self._netem_refusal: str | None = None
        self._netem_probed = False

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

    def _link_ends(self, host: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """(namespace host, device) of both ends of ``host``'s link: its ``eth0`` and the
        bridge's port of it in the hub."""
        return (host, "eth0"), (self.hub, self.port_name(host))

    def netem_refusal(self) -> str | None:
        """Why ``tc netem`` cannot be used here, or None when it can.

        Probes once per lab, on the loopback device of the hub (nothing flows there)."""
        if not self._netem_probed:
            self._netem_probed = True
            if shutil.which(TC) is None:
                self._netem_refusal = "the tc command (iproute2) is not installed"
            else:
                rule = [TC, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
                done = self._in(self.hub, rule, check=False)
                if done.returncode == 0:
                    self._in(self.hub, [TC, "qdisc", "del", "dev", "lo", "root"], check=False)
                else:
                    self._netem_refusal = (f"`{' '.join(rule)}` was refused: "
                                           f"{done.stderr.strip()} (the kernel needs sch_netem)")
        return self._netem_refusal

    def impair(self, host: str, *, loss_percent: float, delay_ms: int = 0) -> str:
        """Lose ``loss_percent`` of the packets each way on ``host``'s link, each delayed by
        ``delay_ms``; returns the mechanism used, :data:`NETEM` or :data:`NFTABLES`.

        ``tc netem`` on both ends of the link where the kernel has it; else, for loss
        alone, nftables drop rules at both ends' ingress (see the module's docstring).
        One impairment at a time per host: a second call replaces the first.

        Raises:
            ValueError: ``loss_percent`` outside 0-100 or a negative ``delay_ms``.
            NetemUnavailable: a delay was asked for and the kernel has no netem (nothing
                is applied; ask for the loss alone to get it with nftables).
            ImpairmentUnavailable: neither netem nor nftables can make the loss here.
        """
        self._known(host)
        if host == self.hub:
            raise ValueError(f"{host!r} is the hub: impair the link of another host")
        if not 0 <= loss_percent <= 100:
            raise ValueError(f"loss_percent must be within 0-100, not {loss_percent!r}")
        if delay_ms < 0:
            raise ValueError(f"delay_ms must not be negative, not {delay_ms!r}")
        self.clear_impairment(host)
        refusal = self.netem_refusal()
        if refusal is None:
            self._netem(host, loss_percent, delay_ms)
            return NETEM
        if delay_ms > 0:
            raise NetemUnavailable(
                f"a delay of {delay_ms} ms on {host}'s link needs tc netem: {refusal}. "
                "nftables can only drop packets, and tbf/htb delay only what queues behind "
                "a rate limit, not by a fixed latency; ask for the loss alone (delay_ms=0) "
                "to get it with nftables")
        self._nft_loss(host, loss_percent)
        return NFTABLES

    def _netem(self, host: str, loss_percent: float, delay_ms: int) -> None:
        rule = ["netem", "loss", f"{loss_percent}%", "delay", f"{delay_ms}ms"]
        self._impaired[host] = NETEM
        for where, device in self._link_ends(host):
            done = self._in(where, [TC, "qdisc", "add", "dev", device, "root", *rule],
                            check=False)
            if done.returncode != 0:
                self.clear_impairment(host)
                raise NetemUnavailable(
                    f"`tc qdisc add dev {device} root {' '.join(rule)}` was refused: "
                    f"{done.stderr.strip()} (the kernel needs sch_netem)")

    def _nft_loss(self, host: str, loss_percent: float) -> None:
        if shutil.which(NFT) is None:
            raise ImpairmentUnavailable(
                "the kernel has no sch_netem and the nft command is not installed (Debian "
                "package nftables), so no packet loss can be made")
        threshold = round(loss_percent * 100)  # of 10000: hundredths of a percent
        self._impaired[host] = NFTABLES
        for where, device in self._link_ends(host):
            script = (f"table netdev {loss_table} {{\n"
                      f"  chain ingress_{device.replace('-', '_')} {{\n"
                      f"    type filter hook ingress device \"{device}\" priority 0;\n"
                      "    counter\n"
                      f"    numgen random mod 10000 < {threshold} counter drop\n"
                      "  }\n}\n")
            done = subprocess.run(self.exec_argv(where, [NFT, "-f", "-"]), input=script,
                                  capture_output=True, text=True, timeout=command_timeout_s,
                                  check=False)
            if done.returncode != 0:
                self.clear_impairment(host)
                raise ImpairmentUnavailable(
                    f"nft refused the loss rule on {device} in {where}: "
                    f"{(done.stderr or done.stdout).strip()}")

    def loss_counts(self, host: str) -> dict[str, tuple[int, int]]:
        """Packets that arrived and packets dropped at each end of ``host``'s link while
        nftables impairs it: ``{"to <host>": (seen, dropped), "from <host>": ...}``; empty
        when no nftables loss is on (netem keeps no such count per rule)."""
        if self._impaired.get(host) != NFTABLES:
            return {}
        counts: dict[str, tuple[int, int]] = {}
        for (where, device), direction in zip(self._link_ends(host), ("to", "from"),
                                              strict=True):
            listed = self._in(where, [NFT, "-j", "list", "chain", "netdev", loss_table,
                                      f"ingress_{device.replace('-', '_')}"])
            packets = [int(expr["counter"]["packets"])
                       for item in json.loads(listed.stdout).get("nftables", [])
                       for expr in item.get("rule", {}).get("expr", [])
                       if isinstance(expr, dict) and "counter" in expr]
            if len(packets) != 2:
                raise LabError(f"unexpected counters in {loss_table} on {device}: {packets}")
            counts[f"{direction} {host}"] = (packets[0], packets[1])
        return counts

    def impairment(self, host: str) -> str | None:
        """The mechanism impairing ``host``'s link (:data:`NETEM`, :data:`NFTABLES`), or None."""
        self._known(host)
        return self._impaired.get(host)

    def clear_impairment(self, host: str) -> None:
        """Remove what :meth:`impair` put on ``host``'s link, if anything."""
        mechanism = self._impaired.pop(host, None)
        if mechanism is None:
            return
        for where, device in self._link_ends(host):
            if mechanism == NETEM:
                self._in(where, [TC, "qdisc", "del", "dev", device, "root"], check=False)
            else:
                self._in(where, [NFT, "delete", "chain", "netdev", loss_table,
                                 f"ingress_{device.replace('-', '_')}"], check=False)

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
