"""Communicators for dynamic groups, built for the members only and cached.

`dist.new_group` hangs for groups decided at run time (its store prefix depends on each
process's history), so communicators are built directly on the coordinator's rendezvous
store under a name the coordinator hands out (docs/data-plane.md):
gloo on CPU, NCCL on CUDA. No default process group is needed.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist

# ProcessGroupNCCL exists only in CUDA builds; annotations are never evaluated.
GroupBackend: TypeAlias = "dist.ProcessGroupGloo | dist.ProcessGroupNCCL"

logger = logging.getLogger(__name__)

GLOO_THREADS_PER_GROUP = 2
"""Worker threads of each cached gloo group. With one, back-to-back collectives on a group
wait for its single thread to finish the previous one's bookkeeping: measured here (3
members, 1 MB, 2 shared cores) P-Reduce took 0.92x a default-group all_reduce with one
thread and 0.72x with two; four gained little more (0.61x) at twice the threads. At
16 MB the thread count made no difference."""


@dataclass(kw_only=True)
class Communicator:
    """A backend process group over one member set."""

    key: str
    rank: int  # index of this worker among the sorted members
    size: int
    backend: GroupBackend

    def allreduce_sum_(self, tensor: torch.Tensor, timeout_seconds: float) -> None:
        """Sum `tensor` across the members in place; raises on error or timeout."""
        work = self.backend.allreduce([tensor])  # type: ignore[union-attr]  # missing from torch stubs
        self.wait(work, "all-reduce", timeout_seconds)

    def allreduce_max_(self, tensor: torch.Tensor, timeout_seconds: float) -> None:
        """Take the elementwise largest of `tensor` across the members, in place."""
        self.wait(self.start_allreduce_max(tensor), "all-reduce (max)", timeout_seconds)

    def allgather(self, tensor: torch.Tensor, timeout_seconds: float) -> list[torch.Tensor]:
        """Every member's `tensor` (same shape and dtype everywhere), in member order,
        in fresh buffers."""
        gathered, work = self.start_allgather(tensor)
        self.wait(work, "all-gather", timeout_seconds)
        return gathered

    def start_allreduce_max(self, tensor: torch.Tensor) -> dist.Work:
        """Start taking the elementwise largest of `tensor` in place; the caller waits on
        the work it returns."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # RedOpType is accepted
        return self.backend.allreduce([tensor], options)  # type: ignore[union-attr]  # missing from torch stubs

    def start_allgather(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], dist.Work]:
        """Start gathering every member's `tensor` into fresh buffers (returned, in member
        order, filled once the work returned is done)."""
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        work = self.backend.allgather([gathered], [tensor])  # type: ignore[union-attr]  # missing from torch stubs
        return gathered, work

    def start_allreduce_sum(self, tensor: torch.Tensor) -> dist.Work:
        """Start summing `tensor` across the members in place; the caller waits on the
        work it returns (worker/dataplane/background.py) with a deadline of its own."""
        return self.backend.allreduce([tensor])  # type: ignore[union-attr]  # missing from torch stubs

    def send(self, tensor: torch.Tensor, dst: int, timeout_seconds: float) -> None:
        """Send `tensor` to member `dst`; raises on error or timeout."""
        work = self.backend.send([tensor], dst, 0)  # type: ignore[union-attr]  # missing from torch stubs
        self.wait(work, "send", timeout_seconds)

    def recv(self, tensor: torch.Tensor, src: int, timeout_seconds: float) -> None:
        """Receive into `tensor` from member `src`; raises on error or timeout."""
        work = self.backend.recv([tensor], src, 0)  # type: ignore[union-attr]  # missing from torch stubs
        self.wait(work, "recv", timeout_seconds)

    def wait(self, work: dist.Work, what: str, timeout_seconds: float) -> None:
        """Wait for one of this group's collectives (`what`, for the error) up to
        `timeout_seconds`; raises its error, or TimeoutError."""
        if not work.wait(datetime.timedelta(seconds=timeout_seconds)):
            raise TimeoutError(f"{what} on {self.key} did not finish in {timeout_seconds} s")


def connect_store(host: str, port: int, timeout_seconds: float) -> dist.Store:
    """Connect to the coordinator's rendezvous TCPStore."""
    try:
        return dist.TCPStore(host, port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_seconds))
    except (RuntimeError, dist.DistStoreError) as err:
        raise ConnectionError(
            f"cannot reach the coordinator's rendezvous store at {host}:{port}: {err}"
        ) from err


def gloo_device(hostname: str = "") -> object:
    """The gloo device to bind: `hostname`'s address; else the interface named by
    GLOO_SOCKET_IFNAME (its first, if it lists several), as torch's own process groups
    do; else the address this host's name resolves to. (torch's create_default_device()
    alone does not read GLOO_SOCKET_IFNAME: where the host name resolves to 127.0.0.1, or
    to no address of this network namespace, it binds loopback and advertises 127.0.0.1
    to peers on other hosts, whose connections then fail: tests/integration/test_netns.py.)
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if hostname:
        return dist.ProcessGroupGloo.create_device(hostname=hostname)
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname)
    return dist.ProcessGroupGloo.create_default_device()


class CommunicatorFactory:
    """Builds communicators on the shared store, gloo or NCCL by device."""

    def __init__(self, store: dist.Store, device: torch.device, timeout_seconds: float,
                 *, gloo_hostname: str = "",
                 reconnect: Callable[[], dist.Store] | None = None) -> None:
        self.store = store
        self.reconnect = reconnect
        """Connects to the rendezvous store anew: after a coordinator restart (its store
        restarts with it, empty, on the same address) the old connection is dead."""
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_seconds)
        self.gloo_hostname = gloo_hostname  # address gloo binds to ("" = this host's name)
        self._gloo_device: object | None = None

    def build(self, key: str, rank: int, size: int, *,
              peers_within: float | None = None) -> Communicator:
        """The communicator of `key`'s members. If building fails because the store
        connection died (the coordinator restarted), reconnect and build once more: the
        peers do the same, and meet on the new store under the same key.

        `peers_within`: the members are known to be on their way (the coordinator handed
        them the group together), so each one checks in on the store and gives up
        (TimeoutError) when a member has not checked in within that many seconds: it
        died after the coordinator delivered the group. Without it, the backend's
        rendezvous would wait the whole collective timeout for a dead member. The gloo
        rendezvous that follows is bounded by it too (a member killed after its check-in,
        before it published its address, held its peers for the whole collective timeout:
        a 61 s stall in chaos trial 1069); the collectives keep the collective timeout."""
        try:
            return self._build(key, rank, size, peers_within)
        except (RuntimeError, dist.DistStoreError) as err:
            if self.reconnect is None or self._store_alive():
                raise
            logger.warning("the rendezvous store connection is lost (%s); reconnecting", err)
            self.store = self.reconnect()
            return self._build(key, rank, size, peers_within)

    @staticmethod
    def _check_in(store: dist.Store, rank: int, size: int, seconds: float) -> None:
        store.set(f"here/{rank}", "1")
        try:
            store.wait([f"here/{r}" for r in range(size)], datetime.timedelta(seconds=seconds))
        except (RuntimeError, dist.DistStoreError) as err:
            missing = [r for r in range(size) if not store.check([f"here/{r}"])]
            if not missing:  # a store error, not a missing member
                raise
            raise TimeoutError(f"members {missing} of the group did not check in within "
                               f"{seconds:.0f} s (dead since the group was made?)") from err

    def _store_alive(self) -> bool:
        try:
            self.store.check(["ripples/alive"])
        except (RuntimeError, dist.DistStoreError):
            return False
        return True

    def _build(self, key: str, rank: int, size: int, peers_within: float | None) -> Communicator:
        prefix_store = dist.PrefixStore(f"comm/{key}/", self.store)
        if peers_within is not None:
            self._check_in(prefix_store, rank, size, peers_within)
        if self.device.type == "cuda":
            backend = self._build_nccl(prefix_store, rank, size)
        else:
            rendezvous = (datetime.timedelta(seconds=peers_within) if peers_within is not None
                          else self.timeout)
            backend = self._build_gloo(prefix_store, rank, size, min(rendezvous, self.timeout))
        return Communicator(key=key, rank=rank, size=size, backend=backend)

    def _build_gloo(self, store: dist.Store, rank: int, size: int,
                    rendezvous: datetime.timedelta) -> GroupBackend:
        """A gloo group whose rendezvous (the members' addresses on the store) gives up
        after `rendezvous`, and whose collectives after the collective timeout: gloo
        takes one timeout for both at construction, so the group is built with the
        first and given the second afterwards (measured: a collective then waits the
        second for a late member; without the change it failed after the first)."""
        # One eagerly-connected device per process, shared by all groups: ~1.7 ms to
        # create a group and far fewer file descriptors than a device per group.
        if self._gloo_device is None:
            self._gloo_device = gloo_device(self.gloo_hostname)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [self._gloo_device]
        opts._threads = GLOO_THREADS_PER_GROUP
        opts._timeout = rendezvous
        backend = dist.ProcessGroupGloo(store, rank, size, opts)
        backend._set_default_timeout(self.timeout)
        return backend

    def _build_nccl(self, store: dist.Store, rank: int, size: int) -> GroupBackend:
        # Built directly for the members (never split from a global communicator, which
        # would need every rank); the CUDA device is the caller's current device.
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        torch.cuda.set_device(self.device)
        return dist.ProcessGroupNCCL(store, rank, size, opts)


class CommunicatorCache:
    """Cached communicators by key; evictions are ordered by the coordinator.

    Invariant: a key is built at most once per process; a dropped key is never rebuilt
    (the coordinator never hands out a comm id twice, and static keys are never dropped
    except after failure, which ends a lock-step run).
    """

    def __init__(self, factory: CommunicatorFactory, *, shard: int | None = None) -> None:
        self.factory = factory
        self.suffix = "" if shard is None else f"/s{shard}"
        """A worker of several ranks (worker/replica.py): rank r builds each group's
        communicator under the group's key and /s<r>, with rank r of the other members
        (the cache's keys are the groups', without it)."""
        self._comms: OrderedDict[str, Communicator] = OrderedDict()
        self._dropped: set[str] = set()
        self.num_hits = 0
        self.num_misses = 0

    def get(self, key: str, rank: int, size: int, *, create: bool,
            peers_within: float | None = None) -> Communicator:
        """The cached communicator of `key`, or a new one (see CommunicatorFactory.build
        for `peers_within`)."""
        comm = self._comms.get(key)
        if comm is not None:
            self.num_hits += 1
            self._comms.move_to_end(key)
            return comm
        if key in self._dropped:
            raise RuntimeError(f"communicator {key} was dropped and must not be rebuilt")
        if not create:
            logger.warning("communicator %s is not cached here although the coordinator "
                           "expects reuse; building it", key)
        self.num_misses += 1
        comm = self.factory.build(key + self.suffix, rank, size, peers_within=peers_within)
        self._comms[key] = comm
        return comm

    def drop(self, key: str, *, abort: bool = False) -> None:
        """Close `key`'s communicator for good; `abort`: a collective of it may still be
        running (a background P-Reduce past its deadline), which a clean shutdown would
        wait for: abort it instead."""
        comm = self._comms.pop(key, None)
        self._dropped.add(key)
        if comm is not None:
            try:
                if abort:
                    comm.backend.abort()  # type: ignore[union-attr]  # missing from torch stubs
                else:
                    comm.backend.shutdown()
            except RuntimeError as err:  # a broken group may refuse a clean shutdown
                logger.debug("shutdown of %s: %s", key, err)

    def drop_where(self, condition: Callable[[str], bool]) -> int:
        """Drop every cached communicator whose key meets `condition`; returns how many."""
        keys = [k for k in self._comms if condition(k)]
        for key in keys:
            self.drop(key)
        return len(keys)

    def __len__(self) -> int:
        return len(self._comms)

    def close(self) -> None:
        for key in list(self._comms):
            self.drop(key)
