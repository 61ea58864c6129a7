"""A group member that died after the coordinator delivered the group is noticed in
seconds when its peers build the group's communicator, not after the collective timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from ripples.worker.dataplane.communicators import CommunicatorCache, CommunicatorFactory


def _factory(store: dist.Store) -> CommunicatorFactory:
    return CommunicatorFactory(store, torch.device("cpu"), 60.0, gloo_hostname="127.0.0.1")


def test_a_member_that_never_checks_in_fails_the_build_quickly() -> None:
    store = dist.HashStore()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"members \[1\] of the group did not check in"):
        _factory(store).build("gg/run/7", 0, 2, peers_within=0.5)
    assert time.monotonic() - t0 < 30  # not the 60 s collective timeout


def test_members_that_check_in_build_a_working_communicator() -> None:
    store = dist.HashStore()
    comms: dict[int, object] = {}

    def member(rank: int) -> None:
        comm = _factory(store).build("gg/run/8", rank, 2, peers_within=20.0)
        tensor = torch.full((3,), float(rank + 1))
        comm.allreduce_sum_(tensor, 20.0)
        comms[rank] = tensor

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(torch.equal(comms[r], torch.full((3,), 3.0)) for r in range(2))  # type: ignore[arg-type]


def test_a_member_dead_after_its_check_in_fails_the_rendezvous_within_the_bound() -> None:
    """Chaos trial 1069: a member checked in, then died before it published its gloo
    address; its peers' rendezvous gives up after `peers_within`, not the 60 s collective
    timeout. A member that is merely late for a collective (beyond `peers_within`) is
    still waited for: the collectives keep the collective timeout."""
    store = dist.HashStore()
    dist.PrefixStore("comm/gg/run/10/", store).set("here/1", "1")  # checked in, then died
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timeout"):
        _factory(store).build("gg/run/10", 0, 2, peers_within=1.0)
    assert time.monotonic() - t0 < 15

    sums: dict[int, torch.Tensor] = {}

    def member(rank: int) -> None:
        comm = _factory(store).build("gg/run/11", rank, 2, peers_within=1.0)
        if rank == 1:
            time.sleep(3.0)  # late for the collective by three rendezvous bounds
        tensor = torch.full((2,), float(rank + 1))
        comm.allreduce_sum_(tensor, 60.0)
        sums[rank] = tensor

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(torch.equal(sums[r], torch.full((2,), 3.0)) for r in range(2)), sums


def test_dropping_a_communicator_frees_a_peer_held_in_its_collective() -> None:
    """After a coordinator restart a worker drops its predecessor's communicators
    (GroupGeneratorProtocol._forget_old_incarnation): a peer held in a collective of a
    group this worker never received fails at once, not after the collective timeout."""
    store = dist.HashStore()
    caches = {r: CommunicatorCache(_factory(store)) for r in range(2)}
    built = threading.Barrier(2)
    outcome: dict[str, object] = {}

    def held() -> None:
        comm = caches[0].get("gg/run/9", 0, 2, create=True, peers_within=20.0)
        built.wait(30)
        t0 = time.monotonic()
        try:
            comm.allreduce_sum_(torch.ones(3), 60.0)  # its peer never joins
            outcome["error"] = None
        except (RuntimeError, TimeoutError) as err:
            outcome["error"] = err
        outcome["seconds"] = time.monotonic() - t0

    def dropping() -> None:
        caches[1].get("gg/run/9", 1, 2, create=True, peers_within=20.0)
        built.wait(30)
        time.sleep(0.5)
        assert caches[1].drop_where(lambda key: key.startswith("gg/run/")) == 1

    threads = [threading.Thread(target=held), threading.Thread(target=dropping)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert outcome["error"] is not None
    assert outcome["seconds"] < 15  # not the 60 s collective timeout
