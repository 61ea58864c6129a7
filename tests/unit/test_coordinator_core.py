"""Property tests of the coordinator core, driven by a discrete-event simulator.

The simulator (coordinator_simulation.py) plays N workers against the real
`CoordinatorCore` with a fake clock: each step, a hypothesis-chosen worker takes its next
action (compute then request a group, execute and release a delivered group, give up a
long-poll, crash, or lose its lease). After every event the simulator checks what the gRPC
shell's clients would experience:

- no worker is in two executing groups, and a worker is handed a group only when it
  holds none (the lock vector);
- every group contains its initiator;
- overlapping groups execute in one global order (each worker's groups in id order);
- nobody waits on nothing: a waiting worker heads a real, undelivered group it arrived at;
- groups of a worker that leaves or loses its lease are cancelled and their waiting
  members told;
- a group executes only among workers that average the same tensors: a worker whose
  optimizer state joined its averaged buffer (a new schema) is never grouped with one
  whose has not;
- communicator ids: one member set per id forever, `create` exactly when the members do
  not hold it yet, reuse only of what every member holds, evictions never of a comm that
  is still needed;
- after the random phase, a fair schedule with no failures makes every live worker
  progress (no deadlock, no starvation), or ends the run for everyone.

Two scripted runs check a departure and a failed group the same way.
"""

from __future__ import annotations

import dataclasses

from coordinator_simulation import (
    PROGRESS_ROUNDS,
    PROPERTY_SETTINGS,
    Simulation,
    choices_st,
    run_settings,
    run_st,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ripples.coordinator.config import RunSettings


@PROPERTY_SETTINGS
@given(run=run_st, choices=choices_st)
def test_random_interleavings_keep_every_invariant_and_make_progress(
    run: RunSettings, choices: list[int]
) -> None:
    sim = Simulation(run)
    sim.random_phase(choices, allow_departures=False)
    sim.fair_phase()
    assert not sim.core.stopped


@PROPERTY_SETTINGS
@given(run=run_st, choices=choices_st)
def test_departures_cancel_groups_tell_members_and_the_rest_go_on(
    run: RunSettings, choices: list[int]
) -> None:
    sim = Simulation(run)
    sim.random_phase(choices, allow_departures=True)
    if len(sim.live()) < 2:
        assert sim.core.stopped and "fewer than 2 workers" in sim.core.stop_reason
    sim.fair_phase()


@settings(max_examples=50, deadline=None)
@given(run=run_st, choices=choices_st)
def test_same_seed_and_events_give_the_same_decisions(
    run: RunSettings, choices: list[int]
) -> None:
    traces = []
    for _ in range(2):
        sim = Simulation(dataclasses.replace(run, run_id="fixed"))
        sim.random_phase(choices, allow_departures=True)
        traces.append(sim.trace)
    assert traces[0] == traces[1]


@settings(max_examples=60, deadline=None)
@given(run=run_st, choices=choices_st, planned=st.integers(1, 12))
def test_the_iteration_budget_stops_every_worker(
    run: RunSettings, choices: list[int], planned: int
) -> None:
    sim = Simulation(run, planned_iterations=planned)
    sim.random_phase(choices, allow_departures=False)
    for _ in range(PROGRESS_ROUNDS):
        if sim.core.stopped:
            break
        sim.fair_phase(min_progress=1)
    assert sim.core.stopped and "budget" in sim.core.stop_reason
    sim.fair_phase()  # drains: everyone is told STOP at its next request
    assert all(w.mode == "stopped" for w in sim.live())
    assert sum(w.iteration for w in sim.workers.values()) >= planned * run.num_workers
    assert not sim.core.table.unfinished() or all(
        g.delivered for g in sim.core.table.unfinished())


def test_departure_cancels_a_pending_group_and_tells_its_waiting_member() -> None:
    """Paper Fig. 8 with a dead worker: 0 and 1 wait for 2, which loses its lease."""
    sim = Simulation(run_settings("random", 3, 3, 3, 5, False, seed=1))
    w0, w1, w2 = sim.workers.values()
    sim.act(w0)  # creates {0, 1, 2}; 0 arrives and waits
    group = sim.core.table.head(0)
    assert group is not None and group.members == (0, 1, 2)
    sim.act(w1)  # random GG: 1's own request adds a group behind the first; 1 waits
    assert w0.mode == w1.mode == "waiting"
    sim.expire(w2)
    assert w0.mode == "compute" and w1.mode == "compute"  # told CANCELLED, back to work
    assert ("reply", 0, "cancelled", None, None, False) in sim.trace
    assert sim.core.groups.num_cancelled >= 1 and sim.core.num_lease_expirations == 1
    sim.fair_phase()


def test_a_failed_group_gets_a_fresh_communicator_for_queued_groups() -> None:
    """A group queued behind a failed one on the same member set must not reuse its comm."""
    sim = Simulation(run_settings("random", 2, 2, 2, 5, False, seed=3))
    w0, w1 = sim.workers.values()
    sim.act(w0)
    sim.act(w1)  # both arrived: group 1 delivered; 1's own request queued group 2
    first = w0.group
    assert first is not None and w1.group is first and first.create_comm
    queued = [g for g in sim.core.table.unfinished() if g.group_id != first.group_id]
    assert queued and queued[0].comm_id == first.comm_id and not queued[0].create_comm
    sim.act(w0, fail_group=True)
    sim.act(w1)
    assert queued[0].comm_id != first.comm_id and queued[0].create_comm
    sim.fair_phase()
