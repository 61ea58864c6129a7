"""A group member that died after the coordinator delivered the group is noticed in
seconds when its peers build the group's communicator, not after the collective timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from ripples.worker.dataplane.communicators import CommunicatorFactory


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
