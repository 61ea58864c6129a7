"""A P-Reduce in the background (--overlap, worker/dataplane/background.py), over real gloo
between member processes: the group's mean lands as x ← x + (x̄_t − x_t), keeping what
each member trained meanwhile; the outer step lands on its new anchor with those steps on
top; a member's NaN voids it for every member; a collective a peer never joins fails at
its deadline without touching the state; the int8 wire's outer step lands late as its
foreground form would, with the steps taken meanwhile on top."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import time

import pytest
import torch

from ripples.bench.members import run_members
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.background import BackgroundAverage
from ripples.worker.dataplane.communicators import (
    CommunicatorCache,
    CommunicatorFactory,
    connect_store,
)
from ripples.worker.dataplane.outer_state import OuterState, outer_preduce

DEADLINE_SECONDS = 60.0


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.Linear(16, 2))


def _update(rank: int, numel: int) -> torch.Tensor:
    """What member `rank` trains into its state while its P-Reduce is in flight."""
    return torch.arange(numel, dtype=torch.float32) * 1e-3 * (rank + 1)


def _land(background: BackgroundAverage) -> int:
    """Poll (never waiting) until the P-Reduce lands; returns the polls it took."""
    polls, deadline = 0, time.monotonic() + DEADLINE_SECONDS
    while True:
        polls += 1
        if background.poll():
            return polls
        assert time.monotonic() < deadline, "the background P-Reduce never landed"
        time.sleep(0.001)


def _member(rank: int, port: int, poisoned: int, out: mp.Queue) -> None:
    """Two background P-Reduces among 3 members, each with an update made while it is in
    flight: the first clean, the second with member `poisoned` holding a NaN."""
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 30)
    cache = CommunicatorCache(CommunicatorFactory(store, torch.device("cpu"), 30,
                                                  gloo_hostname="127.0.0.1"))
    state = AveragedState(_model(rank))
    background = BackgroundAverage(state)
    comm = cache.get("bg/all", rank, 3, create=True)
    update = _update(rank, state.numel)
    rounds = []
    for round_index in range(2):
        if round_index == 1 and rank == poisoned:
            with torch.no_grad():
                state.flat[5] = float("nan")
        started_from = state.flat.clone()
        background.start(comm, DEADLINE_SECONDS)
        with torch.no_grad():
            state.flat.add_(update)  # the steps the worker takes meanwhile
        _land(background)
        rounds.append((started_from.tolist(), state.flat.tolist()))
    out.put((rank, rounds))
    cache.close()


def test_the_mean_lands_late_keeping_the_steps_taken_meanwhile_and_a_nan_voids_it() -> None:
    poisoned = 2
    results = dict(run_members(_member, 3, poisoned, replies=3, timeout_seconds=120))
    starts = {r: [torch.tensor(s) for s, _ in rounds] for r, rounds in results.items()}
    ends = {r: [torch.tensor(e) for _, e in rounds] for r, rounds in results.items()}
    mean = sum(starts[r][0] for r in range(3)) / 3
    for rank in range(3):
        update = _update(rank, mean.numel())
        # Round 1: the group's mean of the states it started from, plus the member's own
        # update made while the collective ran (overwriting would have lost it).
        torch.testing.assert_close(ends[rank][0], mean + update, rtol=1e-5, atol=1e-5)
        # Round 2: member 2's NaN voided the mean for every member: each keeps its own.
        torch.testing.assert_close(ends[rank][1], starts[rank][1] + update, rtol=0, atol=0,
                                   equal_nan=True)
        if rank != poisoned:
            assert torch.isfinite(ends[rank][1]).all()


def _outer_member(rank: int, port: int, compression: str, out: mp.Queue) -> None:
    """The outer step in the background: each member anchors, takes a round of made-up
    local progress, starts the group's synchronisation, and takes one more step (update)
    while it is in flight."""
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 30)
    cache = CommunicatorCache(CommunicatorFactory(store, torch.device("cpu"), 30,
                                                  gloo_hostname="127.0.0.1"))
    state = AveragedState(_model(rank))
    outer = OuterState(state, lr=0.7, momentum=0.5, compression=compression)
    with torch.no_grad():
        outer.take_anchor()
        state.flat.mul_(1.0 + 0.1 * rank)  # the round's local progress
    outer.record_step()
    background = BackgroundAverage(state, outer)
    background.start(cache.get("bg/outer", rank, 3, create=True), DEADLINE_SECONDS)
    with torch.no_grad():
        state.flat.add_(_update(rank, state.numel))  # a step taken meanwhile
    outer.record_step()
    _land(background)
    out.put((rank, state.flat.tolist(), outer.anchor.tolist(), outer.steps_since_sync))
    cache.close()


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_the_outer_step_lands_late_with_the_steps_taken_meanwhile_on_its_new_anchor(
        compression: str) -> None:
    results = {rank: rest for rank, *rest in
               run_members(_outer_member, 3, compression, replies=3, timeout_seconds=120)}
    initial = [AveragedState(_model(r)).flat for r in range(3)]
    n = sum(p.numel() for p in _model(0).parameters())
    anchors = torch.stack([f[:n] for f in initial])
    delta = (anchors - torch.stack([f[:n] * (1.0 + 0.1 * r)
                                    for r, f in enumerate(initial)])).mean(0)
    # The group's outer step on the mean anchor and pseudo-gradient (momentum from 0),
    # in float32 on the wire even with compression (only the momentum travels in bf16).
    expected_anchor = anchors.mean(0) - 0.7 * (1 + 0.5) * delta
    for rank, (flat, anchor, steps) in results.items():
        torch.testing.assert_close(torch.tensor(anchor), expected_anchor, rtol=1e-5, atol=1e-6)
        # The model: the new anchor plus the step taken while the collective ran, which
        # the next synchronisation counts.
        update = _update(rank, len(flat))
        torch.testing.assert_close(torch.tensor(flat)[:n], expected_anchor + update[:n],
                                   rtol=1e-5, atol=1e-5)
        assert steps == 1


def _int8_member(rank: int, port: int, _config: None, out: mp.Queue) -> None:
    """The int8 wire's synchronisation twice from the same state: in the foreground, and
    in the background with a step taken while its three collectives run."""
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 30)
    cache = CommunicatorCache(CommunicatorFactory(store, torch.device("cpu"), 30,
                                                  gloo_hostname="127.0.0.1"))
    results = []
    for form in ("foreground", "background"):
        state = AveragedState(_model(0))  # one start: the anchors agree in their high bits
        outer = OuterState(state, lr=0.7, momentum=0.5, compression="int8")
        with torch.no_grad():
            outer.take_anchor()
            state.flat.mul_(1.0 + 0.01 * rank)  # the round's local progress
        outer.record_step()
        comm = cache.get(f"int8/{form}", rank, 3, create=True)
        polls = 0
        if form == "foreground":
            outer_preduce(outer, comm, DEADLINE_SECONDS)
        else:
            background = BackgroundAverage(state, outer)
            background.start(comm, DEADLINE_SECONDS)
            with torch.no_grad():
                state.flat.add_(_update(rank, state.numel))  # a step taken meanwhile
            outer.record_step()
            polls = _land(background)
        assert outer.modular is not None
        results.append((state.flat.tolist(), outer.anchor.tolist(), outer.steps_since_sync,
                        int(outer.modular.voided_blocks), polls))
    out.put((rank, results))
    cache.close()


def test_the_int8_wire_lands_late_with_the_foreground_s_anchor_and_the_steps_taken_since(
        ) -> None:
    """In the background the int8 wire's three collectives each start when the one
    before is seen done, and the result is the foreground's, bit for bit in the anchor,
    with the step taken meanwhile on top of the model."""
    results = dict(run_members(_int8_member, 3, None, replies=3, timeout_seconds=120))
    n = sum(p.numel() for p in _model(0).parameters())
    anchors = [torch.tensor(results[r][1][1]) for r in range(3)]
    for rank, (foreground, background) in results.items():
        fg_flat, fg_anchor, fg_steps, fg_voided, _ = foreground
        bg_flat, bg_anchor, bg_steps, bg_voided, polls = background
        assert (fg_steps, bg_steps, fg_voided, bg_voided) == (0, 1, 0, 0)
        assert torch.equal(torch.tensor(bg_anchor), torch.tensor(fg_anchor))
        assert torch.equal(torch.tensor(bg_anchor), anchors[0])  # every member's
        assert not torch.equal(anchors[0], AveragedState(_model(0)).flat[:n])  # it moved
        update = _update(rank, len(bg_flat))
        torch.testing.assert_close(torch.tensor(bg_flat), torch.tensor(fg_flat) + update,
                                   rtol=1e-6, atol=1e-6)
        assert polls >= 1


def _stalled_pair(rank: int, port: int, form: str, out: mp.Queue) -> None:
    """Member 1 builds the communicator but never joins the collective: member 0's
    background P-Reduce (`form`: of the state, or the int8 wire's outer step) must fail
    at its deadline and leave its state as it was."""
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, 60)
    cache = CommunicatorCache(CommunicatorFactory(store, torch.device("cpu"), 60,
                                                  gloo_hostname="127.0.0.1"))
    comm = cache.get("bg/stalled", rank, 2, create=True)
    if rank == 1:  # alive, but busy elsewhere until member 0 is done
        store.wait(["bg/stalled/done"], datetime.timedelta(seconds=90))
        out.put((rank, "", 0.0, True))
        return
    state = AveragedState(_model(rank))
    outer = (OuterState(state, lr=0.7, momentum=0.5, compression="int8")
             if form == "int8" else None)
    before = state.flat.clone()
    background = BackgroundAverage(state, outer)
    background.start(comm, 2.0)
    t0 = time.monotonic()
    error = ""
    while not error and time.monotonic() - t0 < 60:
        try:
            background.poll()
        except TimeoutError as err:
            error = str(err)
        time.sleep(0.01)
    seconds = time.monotonic() - t0
    cache.drop("bg/stalled", abort=True)
    store.set("bg/stalled/done", "1")
    out.put((rank, error, seconds, torch.equal(before, state.flat) and not background.in_flight))


@pytest.mark.parametrize("form", ["state", "int8"])
def test_a_peer_that_never_joins_fails_the_background_p_reduce_at_its_deadline(
        form: str) -> None:
    results = {rank: rest for rank, *rest in
               run_members(_stalled_pair, 2, form, replies=2, timeout_seconds=120)}
    error, seconds, unchanged = results[0]
    assert "did not finish in 2 s" in error
    assert seconds < 50, f"the deadline is 2 s; it failed only after {seconds:.0f} s"
    assert unchanged, "a failed background P-Reduce must leave the state untouched"

