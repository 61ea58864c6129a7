"""The relay of a worker of several ranks (worker/replica.py), between two real processes
that form their group as `ripples run` makes them: rank 0's messages reach rank 1 whole
(one that does not fit the first frame too), the ranks agree on a group's outcome, and a
rank that expects another message than rank 0 sent fails at once, naming both."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch
from helpers import free_port

from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import replica_pb2 as rpb
from ripples.worker.launch_env import LaunchEnv
from ripples.worker.replica import FRAME_BYTES, Replica, ReplicaMismatch

LONG_RUN_ID = "r" * (3 * FRAME_BYTES)


def _rank(rank: int, address: str, out: Any) -> None:
    env = LaunchEnv(launcher="ripples", ranks_per_worker=2, replica_rank=rank,
                    replica_address=address)
    replica = Replica(env, torch.device("cpu"))
    try:
        start = replica.relay("start", rpb.ReplicaStart(
            worker_id=7, config=pb.RunConfig(run_id=LONG_RUN_ID)) if rank == 0 else None,
            rpb.ReplicaStart())
        assert isinstance(start, rpb.ReplicaStart)
        outcome = replica.agree(rank == 0, 1.5)
        if rank == 0:
            replica.send("step", rpb.ReplicaStep(completed=3))
            replica.settle()
            out.put((rank, start.config.run_id == LONG_RUN_ID, outcome, ""))
            return
        try:
            replica.receive("group-reply", rpb.ReplicaReply())
            mismatch = ""
        except ReplicaMismatch as err:
            mismatch = str(err)
        out.put((rank, start.config.run_id == LONG_RUN_ID and start.worker_id == 7, outcome,
                 mismatch))
    except Exception as err:  # noqa: BLE001 (reported to the test)
        out.put((rank, False, None, f"{type(err).__name__}: {err}"))


def test_relayed_messages_agreement_and_a_mismatch_between_two_ranks() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, address, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    (_, long0, outcome0, error0), (_, long1, outcome1, mismatch) = results
    assert long0 and long1, results
    assert outcome0 == outcome1 == (False, 3.0)  # rank 1's shard failed; distances summed
    assert not error0
    assert "expected rank 0's group-reply message #1" in mismatch
    assert "received its step message #1" in mismatch
