"""P-Reduce over real gloo communicators in real processes (spawned, loopback)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import random
import time

import torch
import torch.distributed as dist

from ripples.bench.members import run_members
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import (
    CommunicatorCache,
    CommunicatorFactory,
    connect_store,
)
from ripples.worker.dataplane.preduce import DeltaAverager, preduce

NUM_WORKERS = 4


def _rounds(seed: int, num_rounds: int) -> list[list[tuple[int, ...]]]:
    """Random partitions of the workers into groups of 2-3, the same in every process."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(num_rounds):
        order = list(range(NUM_WORKERS))
        rng.shuffle(order)
        cut = rng.choice([2, NUM_WORKERS - 2, 3 if NUM_WORKERS > 3 else 2])
        rounds.append([tuple(sorted(order[:cut])), tuple(sorted(order[cut:]))])
    return rounds


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _worker(rank: int, port: int, rounds: list[list[tuple[int, ...]]], out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 30)
    cache = CommunicatorCache(CommunicatorFactory(store, torch.device("cpu"), 30,
                                                  gloo_hostname="127.0.0.1"))
    model = _model(rank)
    params = AveragedState(model)
    ids: dict[tuple[int, ...], int] = {}
    for groups in rounds:
        group = next(g for g in groups if rank in g)
        comm_id = ids.setdefault(group, len(ids))  # same set -> same id, in every process
        comm = cache.get(f"test/{'-'.join(map(str, group))}", group.index(rank), len(group),
                         create=True)
        del comm_id
        preduce(params, comm, 30)
    # Tensors go through the queue as lists: a tensor would travel as a file descriptor
    # that the parent must fetch from this process, which may have exited by then.
    out.put((rank, params.flat.tolist(), [p.data_ptr() for p in model.parameters()],
             params.flat.data_ptr(), cache.num_hits, cache.num_misses))
    cache.close()


def test_dynamic_groups_average_exactly_without_hanging() -> None:
    rounds = _rounds(seed=7, num_rounds=40)
    # Every worker's reply, and every worker exited 0 (run_members raises otherwise).
    results = {rank: (torch.tensor(flat), ptrs, flat_ptr, hits, misses)
               for rank, flat, ptrs, flat_ptr, hits, misses
               in run_members(_worker, NUM_WORKERS, rounds, replies=NUM_WORKERS,
                              timeout_seconds=120)}

    # Replay the same rounds on plain tensors: every P-Reduce is an exact group mean.
    expected = {r: AveragedState(_model(r)).flat.clone() for r in range(NUM_WORKERS)}
    for groups in rounds:
        for g in groups:
            mean = sum(expected[m] for m in g) / len(g)
            for m in g:
                expected[m] = mean.clone()
    for r in range(NUM_WORKERS):
        flat, ptrs, flat_ptr, hits, misses = results[r]
        torch.testing.assert_close(flat, expected[r], rtol=1e-5, atol=1e-6)
        assert ptrs[0] == flat_ptr, "parameters stay views into the flat buffer"
        assert misses <= 7 and hits + misses == len(rounds), "communicators are cached"
    # Averaging preserves the workers' parameter sum (doubly stochastic).
    total0 = sum(AveragedState(_model(r)).flat for r in range(NUM_WORKERS))
    total = sum(results[r][0] for r in range(NUM_WORKERS))
    torch.testing.assert_close(total, total0, rtol=1e-4, atol=1e-4)


def _lonely_member(port: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 10)
    factory = CommunicatorFactory(store, torch.device("cpu"), 3, gloo_hostname="127.0.0.1")
    model = _model(0)
    params = AveragedState(model)
    before = params.flat.clone()
    t0 = time.monotonic()
    try:
        # Rank 1 of this group never shows up: building or reducing must fail in time.
        comm = factory.build("lonely", 0, 2)
        preduce(params, comm, 3)
        out.put(("no error", 0.0, True))
    except (RuntimeError, TimeoutError, dist.DistError) as err:
        out.put((type(err).__name__, time.monotonic() - t0, torch.equal(before, params.flat)))


def test_missing_member_fails_in_time_and_keeps_the_local_model() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_lonely_member, args=(store.port, out))
    proc.start()
    kind, seconds, unchanged = out.get(timeout=90)
    proc.join(timeout=30)
    assert kind != "no error"
    assert seconds < 30, f"a missing peer must fail within the timeout, took {seconds:.1f} s"
    assert unchanged, "a failed P-Reduce must leave the parameters untouched"


class _UpdaterWritesDuringTheExchange:
    """A communicator through which an 'updater' writes to the live model after the
    averaging process took its snapshot and before the average comes back: the window
    in which LPP-SGD's updaters keep running (Algorithm 1, lines 13-16)."""

    def __init__(self, comm: object, live: torch.Tensor, update: torch.Tensor) -> None:
        self.comm, self.live, self.update = comm, live, update
        self.size = comm.size  # type: ignore[attr-defined]

    def allreduce_sum_(self, tensor: torch.Tensor, timeout_seconds: float) -> None:
        self.live.add_(self.update)
        self.comm.allreduce_sum_(tensor, timeout_seconds)  # type: ignore[attr-defined]


def _delta_worker(rank: int, port: int, _config: None, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 30)
    factory = CommunicatorFactory(store, torch.device("cpu"), 30, gloo_hostname="127.0.0.1")
    comm = factory.build("delta", rank, 2)
    live = torch.full((5,), float(10 * rank))  # rank 0: zeros, rank 1: tens
    update = torch.arange(5, dtype=torch.float32) * (rank + 1)
    averager = DeltaAverager(live)
    wishes = averager.average(_UpdaterWritesDuringTheExchange(comm, live, update), 30,
                              controls=(float(rank), 2.0))
    out.put((rank, live.tolist(), wishes))  # a list: see _worker


def test_the_delta_rule_keeps_updates_made_during_an_averaging_round() -> None:
    results = {rank: (torch.tensor(live), wishes) for rank, live, wishes
               in run_members(_delta_worker, 2, None, replies=2, timeout_seconds=120)}
    mean_of_snapshots = torch.full((5,), 5.0)
    for rank, (live, wishes) in results.items():
        update = torch.arange(5, dtype=torch.float32) * (rank + 1)
        # The average of the snapshots, plus what the updater wrote meanwhile: kept.
        torch.testing.assert_close(live, mean_of_snapshots + update)
        assert wishes == (1.0, 4.0)  # each control value is summed (0 + 1, 2 + 2)
    # Overwriting with the average (plain model averaging) would have lost the updates.
    assert not torch.equal(results[1][0], mean_of_snapshots)


def _flagged_worker(rank: int, port: int, poisoned: int, out: mp.Queue) -> None:
    """Three rounds among 3 members: a P-Reduce with member `poisoned` holding a NaN (the
    flag rides the collective: every member keeps its own state), then one without it
    among the other two (their average), then all three again."""
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 30)
    cache = CommunicatorCache(CommunicatorFactory(store, torch.device("cpu"), 30,
                                                  gloo_hostname="127.0.0.1"))
    params = AveragedState(_model(rank))
    if rank == poisoned:
        with torch.no_grad():
            params.flat[3] = float("nan")
    start = params.flat.tolist()
    everyone = cache.get("flag/all", rank, 3, create=True)
    preduce(params, everyone, 30)
    after_first = params.flat.tolist()
    if rank != poisoned:
        pair = [r for r in range(3) if r != poisoned]
        preduce(params, cache.get("flag/pair", pair.index(rank), 2, create=True), 30)
    after_pair = params.flat.tolist()
    preduce(params, everyone, 30)
    out.put((rank, start, after_first, after_pair, params.flat.tolist()))
    cache.close()


def test_a_member_with_a_nan_voids_the_group_average_and_no_peer_takes_it_in() -> None:
    poisoned = 1
    results = {rank: [torch.tensor(v) for v in values] for rank, *values
               in run_members(_flagged_worker, 3, poisoned, replies=3, timeout_seconds=120)}
    for rank, (start, after_first, after_pair, last) in results.items():
        # Both groups with the NaN were void: each member kept exactly its own values.
        torch.testing.assert_close(after_first, start, rtol=0, atol=0, equal_nan=True)
        if rank == poisoned:
            assert torch.isnan(last).any()
            continue
        assert torch.isfinite(after_pair).all() and torch.isfinite(last).all()
        torch.testing.assert_close(last, after_pair, rtol=0, atol=0)
    # The pair without it averaged as usual.
    healthy = [r for r in range(3) if r != poisoned]
    mean = sum(results[r][0] for r in healthy) / 2
    for r in healthy:
        torch.testing.assert_close(results[r][2], mean, rtol=1e-6, atol=1e-6)
