"""Shaped local clusters: hosts as Linux network namespaces on a bridge, with slow links.

On loopback, bytes cost almost nothing, so a local run cannot show what a protocol does
with a slow network. `ShapedCluster(n, rates)` builds, on one machine, what a cluster of n
hosts on an Ethernet switch looks like:

- a *hub* namespace that holds the switch (a bridge, `br0`) and the coordinator's address,
  10.77.0.1/24;
- n *host* namespaces, host i with one veth pair: `eth0` inside it at 10.77.0.(10+i)/24
  (MTU 1500, `lo` up), the other end (`hI`) a port of the bridge in the hub;
- host i's link, when it has a rate, shaped with `tc ... tbf` in both directions: on `eth0`
  (what it sends) and on `hI` (what it receives). The coordinator's side of the bridge is
  not shaped (the hub's own traffic to `br0` leaves through no port's limit of its own).

Nothing is made in this machine's own namespace (no address, no link): every name lives
inside the cluster's namespaces, which carry this process's id (`ripples-PID-N-hub`,
`ripples-PID-N-hI`), so clusters of several processes never meet and deleting the
namespaces deletes every link in them. `destroy()` deletes them; a cluster whose owner died
without it (SIGKILL, a crash) is removed by the next cluster built on the machine
(`sweep_stale`). Building one needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2's
`ip` and `tc`; `unavailable_reason()` says why not.

Processes started with `cluster.argv(i, ...)` run inside host i's namespace and reach the
hub's address and the other hosts, nothing else. A thread of this process enters a
namespace with `entered(name)`: the sockets it opens there stay there (that is how a
coordinator in this process serves hosts of the cluster while its driver talks to it on
loopback, coordinator/server.py), and how `measure()` times each link.

Why tbf and these numbers: `tc netem` is not available on every kernel (it is a module of
its own); tbf is. tbf's burst must exceed the link's MTU, or every packet larger than the
burst waits forever (a 64 KiB-MTU loopback stalls all connections), hence the veths' MTU of
1500 and a burst of at least ten packets (or 10 ms at the rate, when more).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

__all__ = [
    "HUB_ADDRESS",
    "MTU",
    "Host",
    "LinkRate",
    "NetworkUnavailable",
    "ShapedCluster",
    "entered",
    "network_record",
    "parse_link_rates",
    "sweep_stale",
    "unavailable_reason",
]

SUBNET = "10.77.0"
"""Every cluster's hosts live in this /24 of their own hub: no two clusters share a hub, so
the same subnet never clashes (nor with the machine's own networks: it is never routed
outside the namespaces)."""
HUB_ADDRESS = f"{SUBNET}.1"
"""The coordinator's address, on the bridge in the hub namespace."""
MTU = 1500
"""Every veth's MTU (an Ethernet link's)."""
HOST_IFNAME = "eth0"
"""The link's end inside each host's namespace (GLOO_SOCKET_IFNAME for its processes)."""
MAX_HOSTS = 240
COMMAND_TIMEOUT_SECONDS = 30.0
_NAME = re.compile(r"^ripples-(\d+)-(\d+)-(hub|h\d+)$")
_CLONE_NEWNET = 0x40000000
_counter = itertools.count()


class NetworkUnavailable(RuntimeError):
    """A shaped cluster cannot be built here (not root, no iproute2, no veth or bridge)."""


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(argv)}` did not finish within "
                           f"{COMMAND_TIMEOUT_SECONDS:.0f} s") from None
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _ip(*args: str, netns: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *(["-n", netns] if netns else []), *args], check=check)


def _tc(*args: str, netns: str) -> None:
    _run(["tc", "-n", netns, *args])


def unavailable_reason() -> str | None:
    """Why this machine cannot build a shaped cluster, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ("network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN): run it "
                "as root, or without link shaping")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is missing"
    probe = f"ripples-{os.getpid()}-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of shaped clusters whose process is gone (killed before it
    could clean up); returns their names."""
    removed = []
    for name in _namespaces():
        found = _NAME.match(name)
        if found and not _alive(int(found.group(1))):
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """Run the body with this thread inside network namespace `netns` (a name `ip netns`
    lists). Sockets opened in the body belong to that namespace for their whole life;
    other threads are not affected."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def burst_bytes(rate_mbit: float) -> int:
    """tbf's bucket: ten full packets, or 10 ms at the rate when that is more."""
    return max(10 * MTU, int(rate_mbit * 1e6 / 8 * 0.010))


@dataclass(frozen=True)
class LinkRate:
    """One link's rate, set and measured (Mbit/s)."""

    host: int
    set_mbit: float | None
    up_mbit: float
    """Host to hub, as a TCP stream achieved it."""
    down_mbit: float
    """Hub to host."""

    def describe(self) -> str:
        limit = f"set {self.set_mbit:g}" if self.set_mbit else "unshaped"
        return (f"host {self.host}: {self.up_mbit:.1f} Mbit/s up, {self.down_mbit:.1f} "
                f"down ({limit})")


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, address and link."""

    index: int
    netns: str
    address: str
    port: str
    """Its link's end in the hub, a port of the bridge."""
    ifname: str = HOST_IFNAME


class ShapedCluster:
    """A hub namespace with a bridge and n host namespaces, each on a link of its own
    rate (see the module). A context manager: leaving it destroys the cluster."""

    def __init__(self, num_hosts: int, rates_mbit: Sequence[float | None] = ()) -> None:
        if not 0 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"a shaped cluster holds 0 to {MAX_HOSTS} hosts, not {num_hosts}")
        reason = unavailable_reason()
        if reason is not None:
            raise NetworkUnavailable(reason)
        sweep_stale()
        prefix = f"ripples-{os.getpid()}-{next(_counter)}"
        self.hub = f"{prefix}-hub"
        self.coordinator_address = HUB_ADDRESS
        self.hosts: list[Host] = []
        self.rates: list[float | None] = []
        self._prefix = prefix
        self._lock = threading.Lock()
        try:
            _ip("netns", "add", self.hub)
            _ip("link", "set", "lo", "up", netns=self.hub)
            _ip("link", "add", "br0", "type", "bridge", netns=self.hub)
            _ip("link", "set", "br0", "mtu", str(MTU), netns=self.hub)
            _ip("addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0", netns=self.hub)
            _ip("link", "set", "br0", "up", netns=self.hub)
            for i in range(num_hosts):
                self.add_host(rates_mbit[i] if i < len(rates_mbit) else None)
        except BaseException as err:
            self.destroy()
            if isinstance(err, RuntimeError):
                raise NetworkUnavailable(f"cannot build the shaped cluster: {err}") from err
            raise

    def __enter__(self) -> ShapedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def add_host(self, rate_mbit: float | None = None) -> Host:
        """One more host on the bridge (a fresh machine for a replacement), its link
        shaped to `rate_mbit` (None: as fast as the machine moves bytes)."""
        i = len(self.hosts)
        if i >= MAX_HOSTS:
            raise ValueError(f"a shaped cluster holds at most {MAX_HOSTS} hosts")
        host = Host(index=i, netns=f"{self._prefix}-h{i}", address=f"{SUBNET}.{10 + i}",
                    port=f"h{i}")
        self.hosts.append(host)  # before creating anything: destroy() removes what exists
        self.rates.append(None)
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.port, "mtu", str(MTU), "type", "veth", "peer", "name",
            host.ifname, "mtu", str(MTU), "netns", host.netns, netns=self.hub)
        _ip("link", "set", host.port, "master", "br0", netns=self.hub)
        _ip("link", "set", host.port, "up", netns=self.hub)
        _ip("addr", "add", f"{host.address}/24", "dev", host.ifname, netns=host.netns)
        _ip("link", "set", host.ifname, "up", netns=host.netns)
        _ip("link", "set", "lo", "up", netns=host.netns)
        self.shape(i, rate_mbit)
        return host

    def shape(self, i: int, rate_mbit: float | None) -> None:
        """Set host i's link to `rate_mbit` each way (None: unshaped)."""
        if rate_mbit is not None and not (rate_mbit > 0 and rate_mbit < 1e6):
            raise ValueError(f"a link's rate is a positive number of Mbit/s, not {rate_mbit}")
        host = self.hosts[i]
        for netns, dev in ((host.netns, host.ifname), (self.hub, host.port)):
            if rate_mbit is None:
                if self.rates[i] is not None:
                    _tc("qdisc", "del", "dev", dev, "root", netns=netns)
                continue
            _tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                "burst", str(burst_bytes(rate_mbit)), "latency", "100ms", netns=netns)
        self.rates[i] = rate_mbit

    def argv(self, i: int, *command: str) -> list[str]:
        """`command` run inside host i's namespace (its process id is the command's)."""
        return ["ip", "netns", "exec", self.hosts[i].netns, *command]

    def hub_argv(self, *command: str) -> list[str]:
        """`command` run inside the hub's namespace (on the coordinator's address)."""
        return ["ip", "netns", "exec", self.hub, *command]

    def cut(self, i: int) -> None:
        """Pull host i's cable: its link goes down inside its namespace (its packets fail
        locally, the others' packets to it are dropped at the bridge)."""
        host = self.hosts[i]
        _ip("link", "set", host.ifname, "down", netns=host.netns)

    def restore(self, i: int) -> None:
        """Plug it back in (its address and route come back with the link)."""
        host = self.hosts[i]
        _ip("link", "set", host.ifname, "up", netns=host.netns)

    def measure(self, i: int, seconds: float = 1.0) -> LinkRate:
        """Host i's achieved rate each way: a TCP stream from a socket in its namespace
        to one in the hub, then back, for `seconds` each. A probe that reads below half
        the set rate is run once more and the better of the two kept: a stream stalled by
        a loss (tbf drops what overflows its queue; TCP then waits out a retransmission)
        or read late on a loaded machine undercounts the link, never overcounts it."""
        host = self.hosts[i]
        rate = self.rates[i]

        def probe(sender: str, receiver: str, address: str) -> float:
            got = _stream_mbit(sender, receiver, seconds, listen_address=address)
            if rate is not None and got < rate / 2:
                got = max(got, _stream_mbit(sender, receiver, seconds,
                                            listen_address=address))
            return got

        return LinkRate(host=i, set_mbit=rate,
                        up_mbit=probe(host.netns, self.hub, HUB_ADDRESS),
                        down_mbit=probe(self.hub, host.netns, host.address))

    def measure_all(self, seconds: float = 1.0) -> list[LinkRate]:
        """Every host's link, one after another (so that none shares the machine's
        copying with another's)."""
        return [self.measure(i, seconds) for i in range(len(self.hosts))]

    def destroy(self) -> list[str]:
        """Delete every namespace of the cluster (and with them every link and the
        bridge); returns what could not be deleted (empty: all gone). Idempotent."""
        with self._lock:
            problems = []
            names = {h.netns for h in self.hosts} | {self.hub}
            for name in sorted(names & set(_namespaces())):
                done = _ip("netns", "del", name, check=False)
                if done.returncode != 0:
                    problems.append(f"netns {name}: {done.stderr.strip()}")
            return problems

    def names(self) -> list[str]:
        """The cluster's namespaces that exist now."""
        mine = {h.netns for h in self.hosts} | {self.hub}
        return [n for n in _namespaces() if n in mine]


def _stream_mbit(sender_ns: str, receiver_ns: str, seconds: float,
                 listen_address: str = HUB_ADDRESS) -> float:
    """Mbit/s of one TCP stream from a socket in `sender_ns` to a listener in
    `receiver_ns` at `listen_address`, counted at the receiver after a quarter of the time
    (tbf's first bucket and TCP's slow start left out)."""
    with entered(receiver_ns):
        listener = socket.create_server((listen_address, 0))
    with listener, contextlib.ExitStack() as stack:
        listener.settimeout(10.0)
        with entered(sender_ns):
            sender = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        sender.settimeout(10.0)
        sender.connect((listen_address, listener.getsockname()[1]))
        receiver = stack.enter_context(listener.accept()[0])
        stop = threading.Event()

        def send() -> None:
            chunk = b"\0" * 65536
            sender.settimeout(0.2)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError, BlockingIOError):
                    sender.send(chunk)

        thread = threading.Thread(target=send, name="link-probe", daemon=True)
        thread.start()
        try:
            receiver.settimeout(0.5)
            start = time.monotonic()
            warm, end = start + seconds / 4, start + seconds
            counted, first = 0, None
            while (now := time.monotonic()) < end:
                try:
                    got = len(receiver.recv(1 << 20))
                except TimeoutError:
                    continue
                if now >= warm:
                    first = now if first is None else first
                    counted += got
            span = end - (first if first is not None else warm)
        finally:
            stop.set()
            thread.join(5.0)
        return counted * 8 / 1e6 / max(span, 1e-3)


def network_record(rates: Sequence[float | None], links: Sequence[LinkRate]
                   ) -> dict[str, object] | None:
    """A run summary's `network`: the rates asked for and the links as measured (None
    on loopback: no rates)."""
    if not rates:
        return None
    return {"link_mbit": list(rates), "measured": [asdict(link) for link in links]}


def parse_link_rates(specs: Sequence[str], num_hosts: int) -> list[float | None]:
    """`--link-mbit` values to one rate per host: `RATE` sets every host's link, `I:RATE`
    host I's (later ones win); a host named by neither is unshaped.

    Raises:
        ValueError: a value that is not a positive number, or names no host of the run.
    """
    rates: list[float | None] = [None] * num_hosts
    for spec in specs:
        where, _, value = spec.rpartition(":")
        try:
            rate = float(value)
        except ValueError:
            raise ValueError(f"--link-mbit {spec!r}: the rate must be a number of Mbit/s "
                             "(RATE for every host, RANK:RATE for one)") from None
        if not (rate > 0 and rate < 1e6):
            raise ValueError(f"--link-mbit {spec!r}: the rate must be above 0 and below "
                             "1,000,000 Mbit/s")
        if not where:
            rates = [rate] * num_hosts
            continue
        if not where.isdigit() or int(where) >= num_hosts:
            raise ValueError(f"--link-mbit {spec!r}: {where!r} is not a host of this run "
                             f"(0 to {num_hosts - 1})")
        rates[int(where)] = rate
    return rates
