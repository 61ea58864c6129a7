"""Restart rounds of lock-step runs in the pure coordinator core (torchelastic's
re-rendezvous): a member that fails, or a worker that joins, ends every member's part;
the workers register anew, the membership forms again (all of them, or at least
min_workers after the join window), each new member continues its rank's count, and
the training clock goes on from where it paused."""

from __future__ import annotations

import pytest

from ripples.coordinator import snapshot
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, CoordinatorError, Progress, WorkerState
from ripples.coordinator.restart_rounds import RESTART_GIVE_UP_WINDOWS, RESTART_STRAGGLER_WINDOWS
from ripples.coordinator.schema import Schema

MODEL = Schema(tensors=(("param:w", (4,), "float32"),), digest="model")
WINDOW = 15.0


def _ready(core: CoordinatorCore, ids: list[int], now: float, *,
           checkpointing: bool = True) -> None:
    """Ready, and (`checkpointing`) holding a checkpoint of step 10, as a heartbeat says."""
    for wid in ids:
        core.mark_ready(wid, 100, now, MODEL)
        if checkpointing:
            core.heartbeat(wid, Progress(iteration=10, checkpoint_step=10,
                                         planned_iterations=100), now)


def _started(protocol: str = "allreduce", n: int = 3, *, checkpointing: bool = True,
             **kw: object) -> tuple[CoordinatorCore, list[int]]:
    settings = RunSettings(protocol=protocol, num_workers=n, iterations=100,
                           join_window_seconds=WINDOW, **kw)  # type: ignore[arg-type]
    core = CoordinatorCore(settings, now=0.0)
    ids = [core.register(f"node{r}", 0, "cpu", 100 + r, 0.0) for r in range(n)]
    _ready(core, ids, 0.0, checkpointing=checkpointing)
    assert core.started_at == 0.0
    return core, ids


def _register(core: CoordinatorCore, hosts: list[str], now: float) -> list[int]:
    return [core.register(host, 0, "cpu", 500 + i, now) for i, host in enumerate(hosts)]


def test_a_failed_member_restarts_every_worker_which_continue_their_ranks() -> None:
    core, ids = _started()
    for wid in ids:
        core.heartbeat(wid, Progress(iteration=40, checkpoint_step=32,
                                     planned_iterations=100), 10.0)
    core.leave(ids[1], None, "RuntimeError: connection closed by peer", 20.0)
    assert core.restarts == 1 and not core.stopped and not core.membership_formed
    assert core.started_at is None  # the clock pauses while the workers restart
    # Every member is told to restart, the failed one too (its leave opened the round).
    assert all(core.rejoins(wid).startswith("restart round 1: rank 1 (worker 1) failed")
               for wid in ids)
    assert {core.workers[w].state for w in ids} == {WorkerState.LEFT, WorkerState.FAILED}
    new = _register(core, ["node2", "node0", "node1"], 25.0)
    assert core.membership_formed and core.registry.generation == 1
    assert sorted(core.workers[w].rank for w in new) == [0, 1, 2]
    for w in new:  # each continues its rank from the checkpoint it restores, counted once
        rank = core.workers[w].rank
        assert core.workers[ids[rank]].replaced_by == w
        assert core.workers[w].progress.iteration == 32
    assert core.mean_iterations() == pytest.approx(32.0)
    _ready(core, new, 30.0)
    assert core.elapsed(30.0) == pytest.approx(20.0)  # 20 s before, none while restarting
    assert not any(core.rejoins(w) for w in new)


def test_a_round_forms_with_fewer_workers_after_the_join_window_and_a_joiner_scales_up() -> None:
    core, ids = _started(min_workers=2)
    core.expire_leases(11.0)  # no heartbeat since 0: node0's lease ran out first
    assert core.restarts == 1 and core.rounds.expected_back == {("node1", 0), ("node2", 0)}
    new = _register(core, ["node1", "node2"], 12.0)  # the two the round ended are back
    core.expire_leases(11.0 + WINDOW - 1)
    assert not core.membership_formed  # node0 (or a replacement) may still come
    core.expire_leases(11.0 + WINDOW)
    assert core.membership_formed and core.registry.size == 2
    _ready(core, new, 30.0)
    assert core.started_at is not None
    # The run's iteration is its live workers' (rank 2's departed record stays counted
    # in the totals, not in the mean).
    for w in new:
        core.heartbeat(w, Progress(iteration=60, checkpoint_step=10, planned_iterations=100),
                       31.0)
    assert core.mean_iterations() == pytest.approx(60.0)
    # A worker that asks to join while the run is below num_workers opens another round,
    # which max_restarts does not count (it counts failures).
    joiner = core.register("node0", 0, "cpu", 900, 40.0)
    assert core.restarts == 2 and core.rounds.failures == 1 and not core.membership_formed
    assert all(core.rejoins(w) for w in new) and not core.rejoins(joiner)
    again = _register(core, ["node1", "node2"], 45.0)
    assert core.membership_formed and core.registry.size == 3
    assert core.registry.generation == 2
    assert sorted(core.workers[w].rank for w in [*again, joiner]) == [0, 1, 2]


def test_a_full_lockstep_run_asks_a_joiner_to_wait_for_a_round() -> None:
    core, _ = _started()
    with pytest.raises(CoordinatorError) as err:
        core.register("node9", 0, "cpu", 1, 5.0)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert "restart round opens" in str(err.value)


def test_without_checkpoints_a_failure_stops_the_run_saying_why() -> None:
    core, ids = _started(checkpointing=False)
    core.leave(ids[0], None, "killed", 5.0)
    assert core.stopped and core.restarts == 0
    assert "no restart: rank 1 (worker 1) holds no checkpoint" in core.stop_reason
    assert not core.rejoins(ids[1])
    assert core.members_lost  # a survivor held in a collective ends (HeartbeatReply)


def test_restarts_stop_once_max_restarts_are_spent() -> None:
    core, ids = _started(max_restarts=1)
    core.leave(ids[0], None, "killed", 5.0)
    new = _register(core, ["node0", "node1", "node2"], 6.0)
    _ready(core, new, 7.0)
    core.leave(new[2], None, "killed again", 8.0)
    assert core.stopped and "max_restarts (1) spent" in core.stop_reason


def test_a_graceful_leave_shrinks_the_run_without_counting_as_a_failure() -> None:
    # A SIGTERM before a preemption: the leaver is not expected back; the others restart
    # and form a round of 2 after the join window. max_restarts (0) does not count it.
    core, ids = _started(min_workers=2, max_restarts=0)
    core.leave(ids[1], None, "", 5.0, reason="asked to stop (a signal or request_stop)")
    assert core.restarts == 1 and core.rounds.failures == 0 and not core.stopped
    assert core.rounds.expected_back == {("node0", 0), ("node2", 0)}
    assert not core.rejoins(ids[1]) and core.rejoins(ids[0]).startswith("restart round 1")
    new = _register(core, ["node0", "node2"], 7.0)
    core.expire_leases(5.0 + WINDOW)
    assert core.membership_formed and core.registry.size == 2
    assert sorted(core.workers[w].rank for w in new) == [0, 1]


def test_a_graceful_leave_stops_a_static_schedule_run() -> None:
    settings = RunSettings(protocol="ripples-static", num_workers=4, workers_per_node=2,
                           iterations=100, join_window_seconds=WINDOW)
    core = CoordinatorCore(settings, now=0.0)
    ids = [core.register(f"node{r // 2}", r % 2, "cpu", 100 + r, 0.0) for r in range(4)]
    _ready(core, ids, 0.0)
    core.leave(ids[0], None, "", 5.0, reason="asked to stop")
    assert core.stopped and core.restarts == 0
    assert "no restart: the static schedule cannot shrink" in core.stop_reason
    assert not core.members_lost  # a graceful leave: the others stop at one agreed step


def test_a_round_nobody_comes_back_to_stops_the_run() -> None:
    core, ids = _started()
    core.leave(ids[0], None, "killed", 5.0)
    _register(core, ["node0"], 6.0)  # below min_workers (2)
    core.expire_leases(5.0 + WINDOW)
    assert not core.stopped
    core.expire_leases(5.0 + RESTART_GIVE_UP_WINDOWS * WINDOW)
    assert core.stopped
    assert "of the 2 workers needed registered within 90 s" in core.stop_reason


def test_the_static_schedule_waits_for_every_worker_of_its_full_hosts() -> None:
    settings = RunSettings(protocol="ripples-static", num_workers=4, workers_per_node=2,
                           iterations=100, join_window_seconds=WINDOW)
    core = CoordinatorCore(settings, now=0.0)
    ids = [core.register(f"node{r // 2}", r % 2, "cpu", 100 + r, 0.0) for r in range(4)]
    _ready(core, ids, 0.0)
    core.leave(ids[0], None, "killed", 5.0)
    for r in range(1, 4):
        core.register(f"node{r // 2}", r % 2, "cpu", 200 + r, 6.0)
    core.expire_leases(6.0 + 2 * WINDOW - 10)
    assert core.restarts == 1 and not core.membership_formed and not core.stopped


def test_group_protocols_never_restart() -> None:
    core, ids = _started("ripples-smart", n=3)
    core.leave(ids[0], None, "killed", 5.0)
    assert core.restarts == 0 and not core.stopped and not core.rejoins(ids[1])


def test_an_open_round_survives_a_coordinator_restart() -> None:
    core, ids = _started()
    core.leave(ids[0], None, "killed", 5.0)
    _register(core, ["node0"], 6.0)
    restored = snapshot.restore(snapshot.take(core, 7.0, 1000.0), 100.0, 2, wall=1001.0)
    assert restored.restarts == 1 and restored.restart_began_at == 100.0
    assert all(restored.rejoins(w) for w in ids[1:])
    new = _register(restored, ["node1", "node2"], 101.0)
    assert restored.membership_formed and restored.registry.generation == 1
    _ready(restored, [w.worker_id for w in restored.live()], 102.0)
    assert restored.elapsed(102.0) == pytest.approx(5.0)
    assert len(new) == 2


def test_a_worker_whose_lease_expired_registers_anew_instead_of_dying() -> None:
    """A long pause cost it its lease: alive after all, it restarts and joins the round
    its expiry opened (or, once the run formed without it, opens one to grow back)."""
    core, ids = _started()
    for wid in ids[:2]:
        core.heartbeat(wid, Progress(iteration=20, checkpoint_step=10,
                                     planned_iterations=100), 9.0)
    core.expire_leases(10.5)  # ids[2] last beat at 0
    assert core.restarts == 1 and core.workers[ids[2]].state is WorkerState.EXPIRED
    assert "its lease expired" in core.rejoins(ids[2])


def test_an_empty_host_opens_no_round() -> None:
    core, ids = _started(min_workers=2)
    core.leave(ids[0], None, "killed", 5.0)
    new = _register(core, ["node1", "node2"], 6.0)
    core.expire_leases(5.0 + WINDOW)
    _ready(core, new, 30.0)
    with pytest.raises(CoordinatorError) as err:
        core.register("", 0, "cpu", 1, 31.0)
    assert err.value.code == "INVALID_ARGUMENT" and core.restarts == 1


def test_a_round_waits_for_its_restarting_workers_before_it_forms_with_fewer() -> None:
    """A worker blocked in a collective restarts later than the others (its backstop,
    then its imports): the round waits for it beyond the join window, up to
    RESTART_STRAGGLER_WINDOWS windows, rather than form without it and need another."""
    core, ids = _started(n=4, min_workers=2)
    core.leave(ids[0], None, "RuntimeError: connection reset", 5.0)  # alive: it said so
    assert core.rounds.expected_back == {(f"node{r}", 0) for r in range(4)}
    back = _register(core, ["node1", "node2", "node3"], 8.0)
    core.expire_leases(5.0 + WINDOW)
    assert not core.membership_formed  # node0 restarts too
    later = 5.0 + RESTART_STRAGGLER_WINDOWS * WINDOW
    for w in back:  # their leases are kept while they wait
        core.heartbeat(w, None, later - 1.0)
    core.expire_leases(later)
    assert core.membership_formed and core.registry.size == 3

