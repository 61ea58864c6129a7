"""A discrete-event simulator of workers against the real `CoordinatorCore`, fake clock.

Each step, a chosen worker takes its next action (compute then request a group, execute
and release a delivered group, give up a long-poll, adopt its optimizer state into its
averaged buffer, crash, or lose its lease). After every event the simulator checks what
the gRPC shell's clients would experience (the invariants test_coordinator_core.py lists);
`fair_phase` then asserts that a fair schedule with no failures makes every live worker
progress or ends the run for everyone. Also the hypothesis strategies of the runs and
event choices it is driven with (test_coordinator_core.py, test_gossip.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, Deliveries, GroupDecision, Outcome
from ripples.coordinator.groups import GroupRecord, GroupState
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
            self.core.mark_ready(wid, planned_iterations, self.now, make_schema(MODEL))
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
        self.core.check_schema(w.worker_id, make_schema(MODEL, WITH_STATE))
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


def run_settings(policy: str, num_workers: int, workers_per_node: int, group_size: int,
              c_thres: int, inter_intra: bool, seed: int,
              max_comms_per_worker: int = 64) -> RunSettings:
    return RunSettings.build(protocol=f"ripples-{policy}", num_workers=num_workers,
                             workers_per_node=workers_per_node, group_size=group_size,
                             c_thres=c_thres, inter_intra=inter_intra, seed=seed,
                             iterations=10**6, max_comms_per_worker=max_comms_per_worker)


run_st = st.builds(
    run_settings,
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


def make_schema(*tensors: tuple[str, tuple[int, ...], str]) -> Schema:
    return Schema(tensors=tensors, digest=repr(tensors))
