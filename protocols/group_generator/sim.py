"""ripples-random's and ripples-smart's workers in the simulator, as their runtime loop
(runtime.py): compute an iteration, ask for a group, wait until it is delivered,
P-Reduce, release it; `more` asks again at once; a server-side wait of
GROUP_POLL_SECONDS ends in a retry. In a sharded run a shard's head takes its every
inter_period-th group at the root coordinator instead. With local steps (H) a worker asks
after every H-th step only, and trains on between."""

from __future__ import annotations

from ripples.coordinator.decisions import GroupDecision, Outcome
from ripples.protocols.group_generator.runtime import GROUP_POLL_SECONDS
from ripples.sim.worker_model import SimulatedWorkers, SimWorker


class GroupWorkers(SimulatedWorkers):
    def on_compute(self, w: SimWorker) -> None:
        sim = self.sim
        if w.iteration % sim.settings.local_steps:  # inside a round of local steps
            sim.start_iteration(w)
            return
        inter = w.root_wid >= 0 and w.iteration % sim.config.inter_period == 0
        w.core_at = sim.root if inter else w.shard
        sim.request(w)

    def poll_seconds(self, w: SimWorker) -> float:
        return GROUP_POLL_SECONDS

    def on_decision(self, w: SimWorker, decision: GroupDecision) -> None:
        if decision.outcome is Outcome.RETRY:
            self.sim.request(w)
        else:  # no group, or it was cancelled: train on
            self.sim.start_iteration(w)

    def on_group_end(self, w: SimWorker) -> None:
        if w.more:
            self.sim.request(w)
        else:
            self.sim.start_iteration(w)
