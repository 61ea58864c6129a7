"""A worker whose training loop ended is done, not lost (pure coordinator core): a run of a
script ends when every worker's loop has ended, never because the first ones to finish
left; lock-step peers end together; a failure still counts against min_workers. And the
start compares the members' initial models: the ranks that differ from rank 0's copy it."""

from __future__ import annotations

import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, Progress
from ripples.coordinator.membership import differing_ranks
from ripples.coordinator.schema import Schema

MODEL = Schema(tensors=(("param:w", (4,), "float32"),), digest="model")


def _started(protocol: str = "ripples-smart", n: int = 4, *, planned: int = 0,
             fingerprints: list[str] | None = None, **kw: object) -> tuple[
        CoordinatorCore, list[int]]:
    core = CoordinatorCore(RunSettings(protocol=protocol, num_workers=n, **kw),  # type: ignore[arg-type]
                           now=0.0)
    ids = [core.register(f"node{r}", 0, "cpu", 100 + r, 0.0) for r in range(n)]
    for k, wid in enumerate(ids):
        core.mark_ready(wid, planned, 0.0, MODEL, fingerprints[k] if fingerprints else "same")
    assert core.started_at is not None
    return core, ids


def _at(iteration: int, planned: int = 0) -> Progress:
    return Progress(iteration=iteration, loss=1.0, planned_iterations=planned)


@pytest.mark.parametrize("protocol", ["ripples-smart", "ripples-random", "adpsgd"])
def test_workers_done_early_leave_the_slowest_training_until_its_loop_ends(
        protocol: str) -> None:
    """The default min_workers (2) stopped the slowest worker when the others' loops had
    ended; now the run ends only with the last loop, and says so."""
    core, ids = _started(protocol)
    for wid in ids[1:]:
        core.leave(wid, _at(301), "", 1.0, "its training loop ended after 301 steps",
                   done=True)
        assert not core.stopped
    assert [w.worker_id for w in core.live()] == ids[:1]
    core.leave(ids[0], _at(301), "", 2.0, "its training loop ended after 301 steps",
               done=True)
    assert core.stopped and not core.stopped_by_failure
    assert core.stop_reason == ("every worker's training loop ended (the training loop of "
                                "rank 0 (worker 0) ended after 301 steps, the last)")


def test_a_worker_at_its_own_budget_is_done_and_the_reason_names_the_budget() -> None:
    core, ids = _started(n=2, planned=50)
    core.leave(ids[1], _at(50, 50), "", 1.0, "iteration budget reached")
    assert not core.stopped  # done by its budget, though its leave did not say done
    core.leave(ids[0], _at(50, 50), "", 2.0, "iteration budget reached", done=True)
    assert "rank 0 (worker 0) finished its 50 planned iterations" in core.stop_reason


def test_a_failure_still_counts_against_min_workers_and_names_the_rank() -> None:
    core, ids = _started(n=3, min_workers=2)
    core.leave(ids[2], _at(10), "", 1.0, "its loop ended", done=True)
    assert not core.stopped
    core.leave(ids[1], _at(10), "RuntimeError: boom", 2.0)
    assert core.stopped and core.stopped_by_failure
    assert "fewer than 2 workers remain (rank 1 (worker 1) failed: RuntimeError: boom)" \
        in core.stop_reason


def test_a_signal_is_no_normal_end_the_run_shrinks_to_min_workers() -> None:
    core, ids = _started(n=2, min_workers=2)
    core.leave(ids[1], _at(10), "", 1.0, "asked to stop (a signal or request_stop)")
    assert core.stopped and "fewer than 2 workers remain" in core.stop_reason


@pytest.mark.parametrize("protocol", ["allreduce", "ripples-static"])
def test_a_lockstep_worker_whose_loop_ended_ends_the_run_without_a_restart(
        protocol: str) -> None:
    """Lock-step peers end together: no restart round and no "holds no checkpoint"
    refusal after a normal end."""
    core, ids = _started(protocol, n=2, workers_per_node=1, checkpoint_interval=5)
    core.leave(ids[0], _at(301), "", 1.0, "its training loop ended after 301 steps",
               done=True)
    assert core.stopped and not core.stopped_by_failure and core.restarts == 0
    assert core.stop_reason == (f"the training loop of rank 0 (worker 0) ended after 301 "
                                f"steps ({protocol}'s workers end together: each waits for "
                                "its peers)")


def test_the_start_names_the_ranks_whose_initial_model_differs_from_rank_0s() -> None:
    core, _ = _started(fingerprints=["a", "b", "a", "c"])
    assert core.start_differing_ranks == (1, 3)
    assert core.start_models_note().startswith("ranks 1, 3 built a model whose initial "
                                               "values differ from rank 0's")
    same, _ = _started(fingerprints=["a"] * 4)
    assert same.start_differing_ranks == () and same.start_models_note() == ""


def test_no_copy_is_asked_when_a_member_sent_no_fingerprint() -> None:
    core, _ = _started(fingerprints=["a", "", "b", "a"])
    assert core.start_differing_ranks == ()
    assert differing_ranks([]) == ()
