"""Simulated hosts on one machine: Linux network namespaces joined by a bridge.

`NetnsCluster(n)` builds, in a private /24 it picks (10.231.7.0/24, or the next free
10.231.X.0/24 when another cluster of this helper holds that one):

- a bridge in the root namespace that holds the coordinator's address, 10.231.X.1/24;
- n host namespaces, host i with a veth pair: one end inside the namespace, 10.231.X.(10+i)/24,
  with `lo` up; the other end enslaved to the bridge.

Processes started with `cluster.argv(i, ...)` run inside host i's namespace and reach the
bridge's address and the other hosts, nothing else. `cut(i)` / `restore(i)` set host i's
veth down and up (inside its namespace: its routes go with it, so its packets fail locally
and the others' packets to it are dropped at the bridge). `destroy()` deletes every link,
namespace and the bridge it made; a half-built cluster is destroyed too. Every name carries
this process's id, so two test sessions never touch each other's interfaces.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET_PREFIX = "10.231"
FIRST_SUBNET = 7


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, no veth or bridge support)."""


def _ip(*args: str, netns: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why this machine cannot run namespace tests, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"rplprobe{os.getpid()}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _used_subnets() -> set[int]:
    used = set()
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        for word in line.split():
            if word.startswith(SUBNET_PREFIX + "."):
                used.add(int(word.split(".")[2]))
    return used


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """An exclusive lock, across processes, on choosing a subnet (released on exit, also
    when the process dies)."""
    path = os.path.join(tempfile.gettempdir(), "ripples-netns-subnets.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its veth ends and its address."""

    index: int
    netns: str
    ifname: str
    """The veth end inside the namespace (GLOO_SOCKET_IFNAME for its workers)."""
    peer: str
    """The veth end in the root namespace, a port of the bridge."""
    address: str


class NetnsCluster:
    """A bridge with the coordinator's address and n host namespaces (see the module)."""

    def __init__(self, num_hosts: int) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        tag = f"rpl{os.getpid() % 100000}"
        self.bridge = f"{tag}br"
        self.hosts: list[Host] = []
        self._tag = tag
        self._made_bridge = False
        try:
            # One cluster at a time picks its subnet: two test processes that read the
            # used subnets together would both take the first free one.
            with _subnet_lock():
                used = _used_subnets()
                subnet = next(x for x in range(FIRST_SUBNET, 255) if x not in used)
                self.subnet = f"{SUBNET_PREFIX}.{subnet}"
                self.coordinator_address = f"{self.subnet}.1"
                _ip("link", "add", self.bridge, "type", "bridge")
                self._made_bridge = True
                _ip("addr", "add", f"{self.coordinator_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for _ in range(num_hosts):
                self.add_host()
        except BaseException as err:
            self.destroy()
            if isinstance(err, RuntimeError):
                raise NetnsUnavailable(f"cannot build the namespaces: {err}") from err
            raise

    def add_host(self) -> Host:
        """One more host namespace on the bridge (a fresh machine for a replacement)."""
        i = len(self.hosts)
        host = Host(index=i, netns=f"{self._tag}ns{i}", ifname=f"{self._tag}n{i}",
                    peer=f"{self._tag}h{i}", address=f"{self.subnet}.{10 + i}")
        self.hosts.append(host)  # before creating anything: destroy() removes what exists
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.peer, "type", "veth", "peer", "name", host.ifname)
        _ip("link", "set", host.ifname, "netns", host.netns)
        _ip("link", "set", host.peer, "master", self.bridge)
        _ip("link", "set", host.peer, "up")
        _ip("addr", "add", f"{host.address}/24", "dev", host.ifname, netns=host.netns)
        _ip("link", "set", host.ifname, "up", netns=host.netns)
        _ip("link", "set", "lo", "up", netns=host.netns)
        return host

    def argv(self, i: int, *command: str) -> list[str]:
        """`command` run inside host i's namespace."""
        return ["ip", "netns", "exec", self.hosts[i].netns, *command]

    def cut(self, i: int) -> None:
        """Pull host i's cable: its veth goes down inside its namespace."""
        host = self.hosts[i]
        _ip("link", "set", host.ifname, "down", netns=host.netns)

    def restore(self, i: int) -> None:
        """Plug it back in (its address and connected route come back with the link)."""
        host = self.hosts[i]
        _ip("link", "set", host.ifname, "up", netns=host.netns)

    def destroy(self) -> list[str]:
        """Delete every veth, namespace and the bridge this cluster made; returns what
        could not be deleted (empty: all gone). Idempotent."""
        problems = []
        for host in self.hosts:
            # Deleting the root end deletes the pair at once (a namespace is freed
            # asynchronously, its veth end with it).
            if _ip("link", "show", host.peer, check=False).returncode == 0:
                done = _ip("link", "del", host.peer, check=False)
                if done.returncode != 0:
                    problems.append(f"link {host.peer}: {done.stderr.strip()}")
            if host.netns in _namespaces():
                done = _ip("netns", "del", host.netns, check=False)
                if done.returncode != 0:
                    problems.append(f"netns {host.netns}: {done.stderr.strip()}")
        if self._made_bridge:
            done = _ip("link", "del", self.bridge, check=False)
            if done.returncode != 0:
                problems.append(f"bridge {self.bridge}: {done.stderr.strip()}")
            self._made_bridge = False
        self.hosts = []
        return problems


def _namespaces() -> set[str]:
    out = _ip("netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}
