"""Property tests of the coordinator core, driven by a discrete-event simulator.

The simulator plays N workers against the real `CoordinatorCore` with a fake clock: each
step, a hypothesis-chosen worker takes its next action (compute then request a group,
execute and release a delivered group, give up a long-poll, crash, or lose its lease).
After every event the simulator checks what the gRPC shell's clients would experience:

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
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import (
    SUSPECT_HEARTBEATS,
    CoordinatorCore,
    CoordinatorError,
    Deliveries,
    GroupDecision,
    Outcome,
    Progress,
)
from ripples.coordinator.groups import GroupRecord, GroupState
from ripples.coordinator.registry import STARTUP_LEASE_FACTOR
from ripples.coordinator.schema import Schema

DT = 0.01  # simulated seconds per event
PROGRESS_ROUNDS = 400  # bound on the fair phase


@dataclasses.dataclass(kw_only=True)
class SimWorker:
    worker_id: int
    iteration: int = 0
    mode: str = "compute"  # compute | waiting | reducing | stopped | gone
    continuing: bool = False  # re-request without a new iteration (more / retry)
    group: GroupRecord | None = None
    more: bool = False
    delivered: list[int] = dataclasses.field(default_factory=list)
    cache: set[int] = dataclasses.field(default_factory=set)
    dropped: set[int] = dataclasses.field(default_factory=set)
    adopted: bool = False  # its optimizer state joined the averaged buffer


MODEL = ("param:w", (4,), "float32")
WITH_STATE = ("state:w.momentum_buffer", (4,), "float32")


class Simulation:
    """Workers acting on a real CoordinatorCore; asserts the invariants after each event."""

    def __init__(self, run: RunSettings, *, planned_iterations: int = 10**9) -> None:
        self.run = run
        self.now = 0.0
        self.core = CoordinatorCore(run, now=self.now)
        k = run.workers_per_node
        ids = [self.core.register(f"node{r // k}", r % k, "cpu", 1000 + r, self.now)
               for r in range(run.num_workers)]
        for wid in ids:
            self.core.mark_ready(wid, planned_iterations, self.now, _schema(MODEL))
        assert self.core.started_at is not None
        self.workers = {wid: SimWorker(worker_id=wid) for wid in ids}
        self.failed_groups: set[int] = set()
        self.comm_members: dict[int, tuple[int, ...]] = {}
        self.trace: list[tuple] = []

    # ---------------------------------------------------------------- queries
    def live(self) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.mode != "gone"]

    def actionable(self) -> list[SimWorker]:
        return [w for w in self.live() if w.mode in ("compute", "reducing")]

    # ---------------------------------------------------------------- events
    def tick(self) -> None:
        self.now += DT
        for w in self.live():  # every live daemon's heartbeat thread keeps its lease
            self.apply(self.core.heartbeat(w.worker_id, None, self.now))

    def act(self, w: SimWorker, *, fail_group: bool = False) -> None:
        """The worker's next step: request a group, or execute and release its group."""
        self.tick()
        if w.mode == "compute":
            if not w.continuing:
                w.iteration += 1
            w.continuing = False
            decision, deliveries = self.core.request_group(w.worker_id, w.iteration, self.now)
            self.trace.append(("request", w.worker_id, w.iteration))
            w.mode = "waiting"
            if decision is not None:
                self.receive(w, decision)
            self.apply(deliveries)
        elif w.mode == "reducing":
            group = w.group
            assert group is not None
            if fail_group:
                self.failed_groups.add(group.group_id)
            dead_peer = any(self.workers[m].mode == "gone" for m in group.members)
            ok = not dead_peer and group.group_id not in self.failed_groups
            if not ok:  # the daemon drops a communicator whose collective failed
                w.cache.discard(group.comm_id)
                w.dropped.add(group.comm_id)
            self.trace.append(("release", w.worker_id, group.group_id, ok))
            w.group = None
            w.mode, w.continuing = "compute", w.more
            self.apply(self.core.release(w.worker_id, group.group_id, ok,
                                         "" if ok else "simulated failure", self.now))
        else:
            raise AssertionError(f"worker {w.worker_id} cannot act in mode {w.mode}")
        self.check()

    def adopt(self, w: SimWorker) -> None:
        """Between two iterations, the worker's optimizer state joins what it averages."""
        assert w.mode == "compute" and not w.continuing and not w.adopted
        self.tick()
        self.trace.append(("adopt", w.worker_id))
        w.adopted = True
        self.core.check_schema(w.worker_id, _schema(MODEL, WITH_STATE))
        self.check()

    def abandon(self, w: SimWorker) -> None:
        """The server-side long-poll of a waiting worker ran out."""
        assert w.mode == "waiting"
        self.tick()
        decision = self.core.abandon_wait(w.worker_id, self.now)
        assert decision.outcome is Outcome.RETRY
        self.trace.append(("abandon", w.worker_id))
        w.mode, w.continuing = "compute", True
        self.check()

    def crash(self, w: SimWorker) -> None:
        self.tick()
        self.trace.append(("crash", w.worker_id))
        w.mode = "gone"
        self.apply(self.core.leave(w.worker_id, None, "simulated crash", self.now))
        self.check_gone(w)

    def expire(self, w: SimWorker) -> None:
        """The worker stops heartbeating; the others go on; the reaper runs."""
        self.now += self.run.lease_seconds + 1.0
        w.mode = "gone"
        for other in self.live():
            self.apply(self.core.heartbeat(other.worker_id, None, self.now))
        self.trace.append(("expire", w.worker_id))
        self.apply(self.core.expire_leases(self.now))
        assert self.core.workers[w.worker_id].state.value == "expired"
        self.check_gone(w)

    # ---------------------------------------------------------------- replies
    def apply(self, deliveries: Deliveries) -> None:
        for wid, decision in sorted(deliveries.items()):
            w = self.workers[wid]
            assert w.mode == "waiting", f"worker {wid} told {decision.outcome} while {w.mode}"
            self.receive(w, decision)

    def receive(self, w: SimWorker, decision: GroupDecision) -> None:
        group = decision.group
        self.trace.append(("reply", w.worker_id, decision.outcome.value,
                           group.group_id if group else None,
                           group.members if group else None, decision.more))
        if decision.outcome is Outcome.GROUP:
            assert group is not None
            assert w.group is None, f"worker {w.worker_id} got a second group"
            assert w.worker_id in group.members and group.initiator in group.members
            assert group.state is GroupState.EXECUTING
            layouts = {self.workers[m].adopted for m in group.members}
            assert len(layouts) == 1, f"group {group.group_id} joins two layouts"
            assert not w.delivered or w.delivered[-1] < group.group_id, (
                f"worker {w.worker_id} executes {group.group_id} after {w.delivered[-1]}")
            w.delivered.append(group.group_id)
            self.check_comm(w, group, decision.evictions)
            w.mode, w.group, w.more = "reducing", group, decision.more
        elif decision.outcome is Outcome.STOP:
            w.mode = "stopped"
        elif decision.outcome in (Outcome.CANCELLED, Outcome.NO_GROUP):
            w.mode, w.continuing = "compute", False
        else:
            raise AssertionError(f"unexpected reply {decision.outcome} to a request")

    # ---------------------------------------------------------------- checks
    def check_comm(self, w: SimWorker, group: GroupRecord, evictions: Sequence[int]) -> None:
        for comm_id in evictions:
            assert comm_id != group.comm_id, "evicted the comm of the group being delivered"
            w.cache.discard(comm_id)
            w.dropped.add(comm_id)
        known = self.comm_members.setdefault(group.comm_id, group.members)
        assert known == group.members, f"comm {group.comm_id} reused for another member set"
        if group.create_comm:
            assert group.comm_id not in w.cache | w.dropped, (
                f"worker {w.worker_id} told to create comm {group.comm_id} twice")
            w.cache.add(group.comm_id)
        else:
            assert group.comm_id in w.cache, (
                f"worker {w.worker_id} told to reuse comm {group.comm_id} it does not hold")

    def check(self) -> None:
        self.core.table.check_invariants()
        for w in self.live():
            if w.mode == "waiting":
                head = self.core.table.head(w.worker_id)
                assert head is not None, f"worker {w.worker_id} waits on no group"
                assert not head.delivered and w.worker_id in head.arrived
            if w.mode == "reducing":
                assert w.group is not None
        for g in self.core.table.unfinished():
            assert all(self.workers[m].mode != "gone" for m in g.members), (
                f"group {g.group_id} outlived a departed member")

    def check_gone(self, w: SimWorker) -> None:
        assert all(w.worker_id not in g.members for g in self.core.table.unfinished())
        assert self.core.table.is_idle(w.worker_id)
        self.check()

    # ---------------------------------------------------------------- schedules
    def random_phase(self, choices: Sequence[int], *, allow_departures: bool) -> None:
        rng = random.Random(0)
        for choice in choices:
            if self.core.stopped and not self.actionable():
                return
            kind = choice % 100
            waiting = [w for w in self.live() if w.mode == "waiting"]
            if kind < 6 and waiting:
                self.abandon(waiting[choice % len(waiting)])
            elif kind == 6 and allow_departures and len(self.live()) > 1:
                target = self.live()[choice % len(self.live())]
                (self.crash if choice % 2 else self.expire)(target)
            elif 12 <= kind < 15 and (ready := [w for w in self.actionable()
                                                if w.mode == "compute" and not w.continuing
                                                and not w.adopted]):
                self.adopt(ready[choice % len(ready)])
            elif self.actionable():
                options = self.actionable()
                w = options[(choice // 100) % len(options)]
                self.act(w, fail_group=(7 <= kind < 12 and rng.random() < 0.5))

    def fair_phase(self, min_progress: int = 3) -> None:
        """Round-robin with no failures: everyone progresses, or the run ends for all."""
        start = {w.worker_id: w.iteration for w in self.live()}
        for _ in range(PROGRESS_ROUNDS):
            self.before_fair_round()
            if self.core.stopped and all(w.mode == "stopped" for w in self.live()):
                return
            if all(w.iteration - start[w.worker_id] >= min_progress for w in self.live()):
                return
            movers = self.actionable()
            assert movers, "deadlock: every live worker waits; " + self.describe()
            for w in movers:
                if w.mode in ("compute", "reducing"):
                    self.act(w)
        pytest.fail("starvation: no progress within the bound; " + self.describe())

    def before_fair_round(self) -> None:
        """A hook for subclasses: events every round of the fair phase begins with."""

    def describe(self) -> str:
        workers = {w.worker_id: (w.mode, w.iteration, self.core.table.buffer(w.worker_id))
                   for w in self.workers.values()}
        return f"workers {workers}"


def _settings(policy: str, num_workers: int, workers_per_node: int, group_size: int,
              c_thres: int, inter_intra: bool, seed: int,
              max_comms_per_worker: int = 64) -> RunSettings:
    return RunSettings.build(protocol=f"ripples-{policy}", num_workers=num_workers,
                             workers_per_node=workers_per_node, group_size=group_size,
                             c_thres=c_thres, inter_intra=inter_intra, seed=seed,
                             iterations=10**6, max_comms_per_worker=max_comms_per_worker)


run_st = st.builds(
    _settings,
    policy=st.sampled_from(["random", "smart"]),
    num_workers=st.integers(2, 9),
    workers_per_node=st.integers(1, 4),
    group_size=st.integers(2, 4),
    c_thres=st.integers(1, 6),
    inter_intra=st.booleans(),
    seed=st.integers(0, 2**16),
    max_comms_per_worker=st.sampled_from([2, 3, 64]),
)
choices_st = st.lists(st.integers(0, 10**6), min_size=1, max_size=300)
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


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


def test_departure_cancels_a_pending_group_and_tells_its_waiting_member() -> None:
    """Paper Fig. 8 with a dead worker: 0 and 1 wait for 2, which loses its lease."""
    sim = Simulation(_settings("random", 3, 3, 3, 5, False, seed=1))
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
    sim = Simulation(_settings("random", 2, 2, 2, 5, False, seed=3))
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


def test_progress_reports_feed_the_loss_curve_and_the_target() -> None:
    run = dataclasses.replace(_settings("smart", 2, 2, 2, 5, False, seed=0), target_loss=0.5)
    core = CoordinatorCore(run, now=0.0)
    for r in range(2):
        core.mark_ready(core.register("node0", r, "cpu", r, 0.0), 100, 0.0)
    core.heartbeat(0, Progress(iteration=3, loss=0.9), 1.0)
    assert core.mean_loss() is None  # worker 1 has not reported yet
    core.heartbeat(1, Progress(iteration=3, loss=0.7), 1.5)
    core.heartbeat(0, Progress(iteration=5, loss=0.2), 2.0)
    assert core.time_to_target == pytest.approx(2.0) and core.stopped
    assert core.iterations_to_target == pytest.approx(4.0)  # (5 + 3) / 2 workers
    assert core.loss_curve[0] == pytest.approx((1.5, 0.8, 3.0))
    assert core.loss_curve[-1] == pytest.approx((2.0, 0.45, 4.0))


def test_own_time_per_iteration_is_measured_between_iterations_not_within_one() -> None:
    core = CoordinatorCore(_settings("smart", 2, 2, 2, 5, False, seed=0), now=0.0)
    wid = core.register("node0", 0, "cpu", 0, 0.0)
    w = core.workers[wid]

    def report(iteration: int, compute: float, preduce: float = 0.0) -> None:
        core.heartbeat(wid, Progress(iteration=iteration, compute_seconds=compute,
                                     preduce_seconds=preduce), 1.0)

    report(1, 0.0)  # counted before its time: iteration 1's time arrives later
    report(1, 5.0)  # warm-up, reported within iteration 1
    report(2, 5.0)
    assert w.own_seconds is None  # the first iteration (warm-up) sets no speed
    report(2, 5.5, 0.1)  # within iteration 2: the baseline stays at iteration 2's report
    report(3, 5.5, 0.1)
    assert w.own_seconds == pytest.approx(0.6)  # compute 0.5 + collective 0.1
    report(5, 7.9, 0.1)  # two iterations of 1.2 s
    assert w.own_seconds == pytest.approx(0.3 * 1.2 + 0.7 * 0.6)


@pytest.mark.parametrize("protocol", ["ripples-smart", "allreduce"])
def test_progress_sent_with_sync_requests_records_the_target_without_heartbeats(
    protocol: str,
) -> None:
    """A run shorter than one heartbeat interval still gets its time to target: progress
    rides on every group request (group-generator protocols) and every checkpoint
    (lock-step protocols)."""
    run = RunSettings(protocol=protocol, num_workers=2, workers_per_node=2,
                      iterations=100, target_loss=0.5)
    core = CoordinatorCore(run, now=0.0)
    ids = [core.register("node0", r, "cpu", r, 0.0) for r in range(2)]
    for wid in ids:
        core.mark_ready(wid, 100, 0.0)
    sync = core.checkpoint if protocol == "allreduce" else core.request_group

    sync(ids[0], 8, 0.05, Progress(iteration=8, loss=0.9))
    sync(ids[1], 8, 0.06, Progress(iteration=8, loss=0.6))
    assert core.time_to_target is None and core.loss_curve == [pytest.approx((0.06, 0.75, 8))]
    sync(ids[0], 16, 0.12, Progress(iteration=16, loss=0.3))
    assert core.time_to_target == pytest.approx(0.12)
    assert core.iterations_to_target == pytest.approx(12.0)
    assert core.loss_curve[-1] == pytest.approx((0.12, 0.45, 12.0))
    assert core.workers[ids[0]].progress.iteration == 16


def _registered(run: RunSettings, hosts: Sequence[str]) -> tuple[CoordinatorCore, list[int]]:
    core = CoordinatorCore(run, now=0.0)
    ids = [core.register(host, sum(h == host for h in hosts[:i]), "cpu", i, 0.0)
           for i, host in enumerate(hosts)]
    return core, ids


@pytest.mark.parametrize(("options", "pairs"), [
    # Lock-step protocols use every pair: a flag says so, not n(n-1)/2 edges.
    ({"protocol": "allreduce"}, None),
    ({"protocol": "lpp-sgd"}, None),
    ({"protocol": "hop", "topology": "ring"}, {(0, 1), (1, 2), (2, 3), (0, 3)}),
    # The static schedule on 2 nodes of 2: intra-node pairs and the cross-node pairings.
    ({"protocol": "ripples-static", "workers_per_node": 2}, {(0, 1), (2, 3), (0, 2), (1, 3)}),
    # ... and on 4 nodes of 1: every pair, so a flag again.
    ({"protocol": "ripples-static", "workers_per_node": 1}, None),
])
def test_the_coordinator_lists_the_edges_a_protocol_always_uses(
        options: dict[str, object], pairs: set[tuple[int, int]] | None) -> None:
    hosts = (["node0", "node0", "node1", "node1"] if options.get("workers_per_node", 2) == 2
             else ["node0", "node1", "node2", "node3"])
    core, _ = _registered(RunSettings.build(num_workers=4, iterations=10, **options), hosts)
    assert core.membership_formed and not core.stopped
    assert core.graph.edges_always_used
    assert core.graph.complete is (pairs is None)
    assert set(core.graph.edges) == (pairs or set())


def test_group_protocols_draw_only_the_groups_they_form() -> None:
    core, _ = _registered(RunSettings(protocol="ripples-smart", num_workers=3, iterations=10),
                          ["a", "a", "b"])
    assert not core.graph.edges_always_used


def test_ranks_are_fixed_when_the_last_worker_registers_and_the_clock_at_ready() -> None:
    core, ids = _registered(RunSettings(num_workers=3, iterations=10), ["node10", "node2", "node2"])
    assert core.membership_formed and core.started_at is None
    # Nodes by host name in natural order: node2 (two workers) before node10.
    assert [core.workers[w].rank for w in ids] == [2, 0, 1]
    with pytest.raises(CoordinatorError, match="already has its 3 workers"):
        core.register("node3", 0, "cpu", 9, 0.0)
    assert not core.mark_ready(ids[0], 10, 1.0)
    assert not core.mark_ready(ids[1], 10, 2.0)
    assert core.mark_ready(ids[2], 10, 3.0) and core.started_at == 3.0


def _schema(*tensors: tuple[str, tuple[int, ...], str]) -> Schema:
    return Schema(tensors=tensors, digest=repr(tensors))


def test_a_worker_averaging_other_tensors_is_refused_naming_the_first_difference() -> None:
    core, ids = _registered(RunSettings(num_workers=3, iterations=10), ["a", "a", "a"])
    good = _schema(("param:0.weight", (8, 4), "float32"), ("param:0.bias", (8,), "float32"))
    core.mark_ready(ids[0], 10, 0.0, good)
    core.mark_ready(ids[1], 10, 0.0, good)
    bad = _schema(("param:0.weight", (8, 5), "float32"), ("param:0.bias", (8,), "float32"))
    with pytest.raises(CoordinatorError, match=r"tensor 0 is 'param:0.weight' float32 \[8, 5\] "
                                               r"here but 'param:0.weight' float32 \[8, 4\]"):
        core.mark_ready(ids[2], 10, 0.0, bad)
    assert core.started_at is None
    core.check_schema(ids[2], good)  # after the first step: the reference of that stage
    short = _schema(("param:0.weight", (8, 4), "float32"))
    with pytest.raises(CoordinatorError, match="lacks 1 tensor"):
        core.check_schema(ids[1], short)
    # The refused worker leaves with its error: the run can never start, so it stops.
    core.leave(ids[2], None, "schema refused", 1.0)
    assert core.stopped and "before training started" in core.stop_reason


def test_a_member_lost_before_the_start_stops_the_run_with_its_reason() -> None:
    core, ids = _registered(RunSettings(num_workers=2, iterations=10, lease_seconds=5),
                            ["a", "a"])
    core.mark_ready(ids[0], 10, 0.0)
    core.expire_leases(6.0)
    assert core.stopped and "lease expired" in core.stop_reason


def test_a_starting_worker_gets_a_grace_beyond_its_lease() -> None:
    """Its start-up (imports, data, model) can starve its heartbeat thread on a loaded
    host; a chaos trial saw starting workers expire under a 2 s lease."""
    core, ids = _registered(RunSettings(num_workers=2, iterations=10, lease_seconds=5),
                            ["a", "a"])
    core.expire_leases(6.0)
    assert not core.stopped and len(core.live()) == 2
    core.expire_leases(5.0 * STARTUP_LEASE_FACTOR + 1)
    assert core.stopped and "lease expired" in core.stop_reason


def test_a_worker_whose_stream_broke_loses_its_lease_unless_it_heartbeats() -> None:
    """A SIGKILLed worker's connection closes at once: its groups are cancelled after
    SUSPECT_HEARTBEATS heartbeat intervals, not a whole lease later; a live worker whose
    stream broke renews its whole lease with its next heartbeat."""
    run = RunSettings(num_workers=3, iterations=100, lease_seconds=10,
                      heartbeat_interval_seconds=0.5)
    core, ids = _registered(run, ["a", "a", "a"])
    for wid in ids:
        core.mark_ready(wid, 100, 0.0)
    for wid in ids:
        core.heartbeat(wid, None, 1.0)  # leases end at 11.0
    assert core.suspect(ids[0], 2.0) == pytest.approx(2.0 + SUSPECT_HEARTBEATS * 0.5)
    assert core.suspect(ids[1], 2.0) is not None
    core.heartbeat(ids[1], None, 2.4)  # alive after all: its whole lease again
    core.expire_leases(2.0 + SUSPECT_HEARTBEATS * 0.5 + 0.01)
    assert [w.worker_id for w in core.live()] == ids[1:]
    gone = core.registry.workers[ids[0]]
    assert "connection closed and no heartbeat followed within 1.5 s" in gone.error
    core.expire_leases(11.5)  # worker 2's plain lease (no heartbeat since 1.0)
    assert "no heartbeat for 10.0 s" in core.registry.workers[ids[2]].error
    # Unknown, departed or not yet started workers: nothing to cut.
    assert core.suspect(ids[0], 13.0) is None and core.suspect(999, 13.0) is None


def test_a_run_shorter_than_one_curve_step_still_ends_its_curve_at_the_stop() -> None:
    """The first point waits for every worker's loss and, after a try that found one
    missing, for a curve step (0.2 s); a run whose budget ends inside that step (60 fast
    iterations on a loaded host) still shows its curve: the stop closes it."""
    run = RunSettings(protocol="ripples-smart", num_workers=2, workers_per_node=2,
                      iterations=3)
    core = CoordinatorCore(run, now=0.0)
    ids = [core.register("node0", r, "cpu", r, 0.0) for r in range(2)]
    for wid in ids:
        core.mark_ready(wid, 3, 0.0)

    def report(wid: int, iteration: int, now: float, loss: float) -> None:
        core.request_group(wid, iteration, now, Progress(iteration=iteration, loss=loss,
                                                         planned_iterations=3))

    report(ids[0], 1, 0.01, 2.0)  # worker 1 has not reported: no point yet
    report(ids[1], 1, 0.02, 1.8)
    assert core.loss_curve == []  # the retry is due at 0.21 s
    report(ids[0], 3, 0.04, 1.2)
    report(ids[1], 3, 0.05, 1.0)
    assert core.stopped and "iteration budget" in core.stop_reason
    assert core.loss_curve == [pytest.approx((0.05, 1.1, 3.0))]
    core.stop("again", 0.3)  # the first reason stays and the curve gains no point
    assert len(core.loss_curve) == 1
