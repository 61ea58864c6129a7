"""Lock-step workers agree through the coordinator core's checkpoints.

Hypothesis interleaves N workers' iterations against a real `CoordinatorCore` (the clock
given by hand): the workers stop at one common iteration that nobody has passed yet, and
add their optimizer state to their averaged buffer after one common iteration, agreed
only once every worker's state exists and learned by each before its next collective
past it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore


@settings(max_examples=100, deadline=None)
@given(num_workers=st.integers(2, 8), interval=st.integers(1, 5),
       choices=st.lists(st.integers(0, 10**6), min_size=1, max_size=200),
       stop_after=st.integers(0, 150))
def test_lockstep_workers_agree_on_the_stop_iteration(
    num_workers: int, interval: int, choices: list[int], stop_after: int
) -> None:
    """Lock-step protocols stop at one common iteration that nobody has passed yet."""
    run = RunSettings(protocol="allreduce", num_workers=num_workers, checkpoint_interval=interval,
                      iterations=10**6)
    core = CoordinatorCore(run, now=0.0)
    ids = [core.register("node0", r, "cpu", r, 0.0) for r in range(num_workers)]
    for wid in ids:
        core.mark_ready(wid, 10**6, 0.0)
    iteration = dict.fromkeys(ids, 0)
    limit: dict[int, int] = {}  # stop iteration each worker learned
    steps = 0
    for choice in choices + list(range(10 * num_workers * (interval + 1) * 40)):
        active = [w for w in ids if iteration[w] < limit.get(w, 10**9)]
        if not active:
            break
        w = active[choice % len(active)]
        if iteration[w] % interval == 0 and w not in limit:
            stop_at = core.checkpoint(w, iteration[w], float(steps))
            if stop_at:
                assert stop_at >= iteration[w], "told to stop at an iteration already passed"
                limit[w] = stop_at
                continue
        iteration[w] += 1  # the collective of this iteration (all workers take part)
        steps += 1
        if steps == stop_after:
            core.stop("test", float(steps))
    if not core.stopped:
        core.stop("test", float(steps))
        for w in ids:  # workers learn it at their next checkpoint
            while w not in limit:
                if iteration[w] % interval == 0:
                    stop_at = core.checkpoint(w, iteration[w], float(steps))
                    if stop_at:
                        assert stop_at >= iteration[w]
                        limit[w] = stop_at
                        break
                iteration[w] += 1
    assert len(set(limit.values())) == 1, f"workers disagree: {limit}"


@settings(max_examples=100, deadline=None)
@given(num_workers=st.integers(2, 8), interval=st.integers(1, 5),
       ready_at=st.lists(st.integers(1, 40), min_size=8, max_size=8),
       choices=st.lists(st.integers(0, 10**6), min_size=1, max_size=300))
def test_lockstep_workers_adopt_their_optimizer_state_after_one_common_iteration(
    num_workers: int, interval: int, ready_at: list[int], choices: list[int]
) -> None:
    """Workers whose optimizer state appears at different iterations (skipped first steps)
    add it to their averaged buffer after one common iteration, agreed only once every
    worker's state exists, which each learns before its next collective past it."""
    run = RunSettings(protocol="ripples-static", num_workers=num_workers,
                      workers_per_node=num_workers, checkpoint_interval=interval,
                      iterations=10**6)
    core = CoordinatorCore(run, now=0.0)
    ids = [core.register("node0", r, "cpu", r, 0.0) for r in range(num_workers)]
    for wid in ids:
        core.mark_ready(wid, 10**6, 0.0)
    ready = {w: ready_at[i] for i, w in enumerate(ids)}
    iteration = dict.fromkeys(ids, 0)
    reported: set[int] = set()
    learned: dict[int, int] = {}
    for choice in choices + list(range(num_workers * 200)):
        w = ids[choice % num_workers]
        if iteration[w] % interval == 0:
            state_ready = iteration[w] >= ready[w]
            core.checkpoint(w, iteration[w], 0.0, optimizer_state_ready=state_ready)
            reported.update([w] if state_ready else [])
            agreed = core.adopt_state_after
            if agreed and w not in learned:
                assert reported == set(ids), "agreed before every worker's state existed"
                assert iteration[w] <= agreed, "told after its collective past the iteration"
                learned[w] = agreed
            assert agreed == learned.get(w, agreed), "the adoption iteration changed"
        if core.adopt_state_after and iteration[w] >= core.adopt_state_after:
            assert w in learned, f"worker {w} would sync past the adoption unaware"
        iteration[w] += 1
    assert set(learned) == set(ids) and len(set(learned.values())) == 1, learned
