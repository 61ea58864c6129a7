"""What a lock-step worker knows of its collectives: how long it has waited in one, which
peers a failed one waited for, what it says, and the collective timeout each protocol
gets by default."""

from __future__ import annotations

import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.wire import MAX_COLLECTIVE_CHARS, progress_from_proto, progress_to_proto
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.collective_watch import (
    TIMEOUT_OPTION,
    CollectiveWatch,
    backend_message,
    describe_peers,
    describe_ranks,
    explain_failure,
)

GLOO_TIMEOUT = RuntimeError(
    "Got the following error when running the callback: RuntimeError: [/__w/pytorch/"
    "pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "2000ms for recv operation to complete\n\nAt:\n  runtime.py(125): done")
GLOO_CLOSED = RuntimeError(
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [127.0.0.1]:25003. This is typically caused by a remote worker crashing.")


def _worker(worker_id: int, rank: int, state: int, *, waiting: float = 0.0,
            iteration: int = 7, error: str = "") -> pb.WorkerStatus:
    return pb.WorkerStatus(worker_id=worker_id, rank=rank, host=f"node{rank}", state=state,
                           iteration=iteration, error=error,
                           progress=pb.Progress(iteration=iteration,
                                                collective_wait_seconds=waiting))


def test_the_watch_counts_overlapping_marks_from_the_first_entry() -> None:
    watch = CollectiveWatch()
    assert watch.waiting() == ("", 0.0)
    watch.enter("the gradient all-reduce of step 3")  # DDP's first bucket
    watch.enter("the gradient all-reduce of step 3")  # the second, in flight with it
    watch.leave()
    what, seconds = watch.waiting()
    assert what == "the gradient all-reduce of step 3" and seconds >= 0.0
    watch.leave()
    assert watch.waiting() == ("", 0.0)
    with watch.inside("the P-Reduce of step 4 with ranks [0, 1]"):
        assert watch.waiting()[0].startswith("the P-Reduce")


def test_a_failure_is_reported_in_its_own_words_not_in_torch_s_wrapping() -> None:
    watch = CollectiveWatch()
    watch.failure = "the gradient all-reduce of step 3 timed out after 60 s"
    wrapped = RuntimeError(f"Got the following error when running the callback: "
                           f"RuntimeError: {watch.failure}\n\nAt:\n  runtime.py(9): done")
    assert watch.error_text(RuntimeError, wrapped) == f"RuntimeError: {watch.failure}"
    assert watch.error_text(KeyError, KeyError("x")) == "KeyError: 'x'"
    assert backend_message(GLOO_TIMEOUT) == (
        "Timed out waiting 2000ms for recv operation to complete")
    assert backend_message(GLOO_CLOSED) == "Connection closed by peer [127.0.0.1]:25003"


def test_the_peers_a_collective_waited_for_are_the_gone_and_the_busy_ones() -> None:
    status = pb.RunStatus(workers=[
        _worker(0, 0, pb.WORKER_STATE_COMPUTING),  # alive, in no collective: busy
        _worker(1, 1, pb.WORKER_STATE_COMPUTING, waiting=12.0),  # this worker
        _worker(2, 2, pb.WORKER_STATE_REDUCING, waiting=11.5),  # waiting too: not named
        _worker(3, 3, pb.WORKER_STATE_EXPIRED, error="lease expired: no heartbeat for 10 s"),
    ])
    peers = describe_peers(status, worker_id=1)
    assert peers == ("worker 3 (rank 3, host node3) expired (lease expired: no heartbeat "
                     "for 10 s); worker 0 (rank 0, host node0), done with step 7: alive "
                     "(heartbeating) but not in a collective, busy between steps (an "
                     "evaluation or a save on some ranks only?)")
    assert describe_peers(None, 1) == ""
    assert describe_peers(pb.RunStatus(workers=[status.workers[2]]), 1) == ""


def test_a_timeout_names_the_collective_the_peers_and_the_option() -> None:
    message = explain_failure("the gradient all-reduce of step 8", GLOO_TIMEOUT,
                              timeout_seconds=2, peers="worker 0 (rank 0, host node0)")
    assert message.startswith("the gradient all-reduce of step 8 timed out after 2 s (the "
                              "collective timeout); waiting for worker 0 (rank 0, host node0)")
    assert TIMEOUT_OPTION in message
    for spelling in ("--collective-timeout-seconds", "collective_timeout_seconds",
                     "[run]", "[coordinator.serve]", "RunSettings.collective_timeout_seconds"):
        assert spelling in TIMEOUT_OPTION
    assert message.endswith("[Timed out waiting 2000ms for recv operation to complete]")
    closed = explain_failure("the gradient all-reduce of step 8", GLOO_CLOSED,
                             timeout_seconds=1800, peers="")
    assert closed == ("the gradient all-reduce of step 8 failed: a peer's connection closed "
                      "(its process ended: see its error). [Connection closed by peer "
                      "[127.0.0.1]:25003]")


@pytest.mark.parametrize(("protocol", "default"), [
    ("allreduce", 1800.0), ("ripples-static", 1800.0), ("ripples-smart", 60.0),
    ("adpsgd", 60.0), ("hop", 60.0)])
def test_lock_step_protocols_wait_long_for_a_peer_by_default(protocol: str,
                                                            default: float) -> None:
    settings = RunSettings.build(protocol=protocol, num_workers=4, workers_per_node=2,
                                 iterations=10)
    assert settings.collective_timeout_seconds == 0
    assert settings.to_proto().collective_timeout_seconds == default
    explicit = RunSettings.build(protocol=protocol, num_workers=4, workers_per_node=2,
                                 iterations=10, collective_timeout_seconds=5)
    assert explicit.to_proto().collective_timeout_seconds == 5


def test_a_negative_collective_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="collective_timeout_seconds must be at least 0, got -1"):
        RunSettings.build(protocol="allreduce", collective_timeout_seconds=-1)


def test_ranks_a_wait_ran_out_on_are_described_by_what_they_were_doing() -> None:
    held = _worker(3, 1, pb.WORKER_STATE_COMPUTING, waiting=118.4)
    held.progress.collective = "the broadcast of rank 0's model at the start, 0.482 MB"
    replaced = _worker(2, 2, pb.WORKER_STATE_EXPIRED, error="lease expired. gone")
    replacement = _worker(6, 2, pb.WORKER_STATE_COMPUTING, iteration=40)
    failed = _worker(4, 3, pb.WORKER_STATE_FAILED, error="OSError: disk full. More words")
    status = pb.RunStatus(workers=[_worker(1, 0, pb.WORKER_STATE_COMPUTING), held, replaced,
                                   failed, replacement])
    said = describe_ranks(status, [1, 2, 3, 5])
    assert said == (
        "rank 1 (worker 3, host node1) in the broadcast of rank 0's model at the start, "
        "0.482 MB for 118 s; rank 2 (worker 6, host node2) not in a collective, at step 40; "
        "rank 3 (worker 4, host node3) failed (OSError: disk full); "
        "ranks [5] not registered with the coordinator")
    assert describe_ranks(None, [1]) == ""


def test_a_collective_s_words_reach_the_coordinator_with_the_progress() -> None:
    watch = CollectiveWatch()
    with watch.inside("DDP's start (its broadcast of rank 0's values, 0.48 MB)"):
        what, waited = watch.waiting()
    assert what.startswith("DDP's start") and waited >= 0
    progress = pb.Progress(collective="x" * 1000, collective_wait_seconds=3.0)
    kept = progress_from_proto(progress)
    assert kept.collective == "x" * MAX_COLLECTIVE_CHARS  # bounded: a status lists thousands
    assert progress_to_proto(kept).collective == kept.collective
