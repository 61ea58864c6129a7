"""Lock-step ranks agree on the checkpoint step to restore, over a store.

Threads play the ranks of a lock-step run on a real torch.distributed HashStore, each with
its files in memory: they agree on the newest step every rank can load, a rank that lacks
it gets the file from the lowest holder through the store (which keeps no copy), and a
step nobody can load fails every rank, naming the steps.
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from ripples.worker.checkpoint_store import StoreExchange, agree_on_step

pytestmark = pytest.mark.usefixtures("single_process_worker")  # tests/unit/conftest.py


class _Files:
    """A rank's checkpoint files in memory: step -> bytes."""

    def __init__(self, rank: int, steps: list[int], unloadable: set[tuple[int, int]]) -> None:
        self.rank, self.unloadable = rank, unloadable
        self.data = {step: f"state of step {step} from rank {rank}".encode() for step in steps}

    def load(self, step: int) -> tuple[int, bytes] | None:
        return None if (self.rank, step) in self.unloadable else (step, self.data[step])

    def read(self, step: int) -> bytes:
        return self.data[step]

    def write(self, step: int, data: bytes) -> None:
        self.data[step] = data


def _agree(held: dict[int, list[int]], unloadable: set[tuple[int, int]] = frozenset()  # type: ignore[assignment]
           ) -> tuple[dict[int, object], dict[int, str]]:
    store = dist.HashStore()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}

    def rank(r: int) -> None:
        exchange = StoreExchange(store, "run", r, len(held), 10.0)
        try:
            results[r] = agree_on_step(exchange, held[r], _Files(r, held[r], unloadable))
        except RuntimeError as err:
            errors[r] = str(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(held))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    steps = {step for mine in held.values() for step in mine}
    assert not any(store.check([f"run/file/{step}"]) for step in steps)  # no copy is kept
    return results, errors


@pytest.mark.parametrize(("held", "unloadable", "expected"), [
    ({0: [6, 4, 2], 1: [6, 4, 2], 2: [6, 4, 2]}, set(), 6),
    ({0: [6, 4, 2], 1: [6, 4, 2], 2: [6, 4, 2]}, {(1, 6), (2, 4)}, 2),
    ({0: [], 1: [], 2: []}, set(), None),
])
def test_lockstep_ranks_agree_on_the_newest_step_every_rank_loads(
        held: dict[int, list[int]], unloadable: set[tuple[int, int]],
        expected: int | None) -> None:
    results, errors = _agree(held, unloadable)
    assert not errors
    steps = {r: None if found is None else found[0] for r, found in results.items()}  # type: ignore[index]
    assert steps == {0: expected, 1: expected, 2: expected}


@pytest.mark.parametrize("held", [
    {0: [], 1: [8, 4], 2: [8, 4]},  # rank 0 joined at a restart round on a host of its own
    {0: [4, 2], 1: [8, 4], 2: [8, 4]},  # rank 0 was killed before it saved step 8
    {0: [80, 40], 1: [280, 240], 2: [280, 240]},  # rank 0's directory is a stale one
])
def test_a_rank_without_the_newest_step_takes_it_from_the_lowest_holder(
        held: dict[int, list[int]]) -> None:
    """Lock-step workers hold the same state at the same step: a rank that lacks the run's
    newest step gets its file through the store, and the store keeps no copy."""
    results, errors = _agree(held)
    assert not errors
    newest = held[1][0]
    assert results == {0: (newest, f"state of step {newest} from rank 1".encode()),
                       1: (newest, f"state of step {newest} from rank 1".encode()),
                       2: (newest, f"state of step {newest} from rank 2".encode())}


def test_a_step_nobody_can_load_fails_every_rank_naming_the_steps() -> None:
    results, errors = _agree({0: [6], 1: [6]}, {(0, 6)})
    assert sorted(errors) == [0, 1] and "no checkpoint step ([6]) loads" in errors[0]


def test_a_round_that_runs_out_says_what_held_the_missing_ranks() -> None:
    # Rank 0 alone reaches the round; ranks 1 and 2 are held in a slow transfer, as on a
    # slow link: the error names it instead of only the ranks.
    store = dist.HashStore()
    asked: list[list[int]] = []

    def describe(ranks: list[int]) -> str:
        asked.append(ranks)
        return "rank 1 in the broadcast of rank 0's model, 48 MB for 2 s"

    exchange = StoreExchange(store, "run", 0, 3, 0.5, describe)
    with pytest.raises(TimeoutError) as caught:
        exchange.round("steps", "[]")
    assert asked == [[1, 2]]
    message = str(caught.value)
    assert "ranks [1, 2] did not reach the round (steps) within 0 s (the start timeout)" in message
    assert "they were: rank 1 in the broadcast of rank 0's model, 48 MB for 2 s" in message
