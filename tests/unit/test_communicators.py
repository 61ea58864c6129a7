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
