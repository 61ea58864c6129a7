"""adpsgd's and a2cid2's workers in the simulator, as their runtime loop (runtime.py):
the compute loop never waits; each step owes averagings (StepCredit, capped backlog); a
communication thread asks for a partner while it owes one, and otherwise listens in
polls of LISTEN_POLL_SECONDS (if its variant listens) or waits for owed work. With local
steps (H) the averagings are owed per round of H steps, at its end; with the outer
optimizer an exchange spends a worker's progress when it owes one (OuterState.exchange)."""

from __future__ import annotations

import math

import torch

from ripples.coordinator.decisions import GroupDecision, Outcome
from ripples.protocols.gossip.runtime import (
    LISTEN_POLL_SECONDS,
    MAX_BACKLOG_STEPS,
    REQUEST_WAIT_SECONDS,
)
from ripples.protocols.gossip.settings import GossipSettings
from ripples.protocols.gossip.state import StepCredit
from ripples.protocols.gossip.variants import VARIANTS
from ripples.sim.worker_model import SimHost, SimulatedWorkers, SimWorker


class GossipWorkers(SimulatedWorkers):
    waits_hold_compute = False  # the communication thread waits, not the compute loop
    comm_overlaps_compute = True

    def __init__(self, sim: SimHost) -> None:
        super().__init__(sim)
        self.variant = VARIANTS[sim.config.protocol]
        rate_com = sim.settings.settings(GossipSettings).rate_com
        self.rate_com = rate_com
        self.max_backlog = max(2, MAX_BACKLOG_STEPS * math.ceil(rate_com))
        n = sim.config.workers
        self.owed = [0] * n
        """Per rank: averagings its steps owe."""
        self.idle = [False] * n
        """Per rank: its communication thread waits for owed work."""
        self.credit: list[StepCredit | None] = [None] * n
        self.local_steps = sim.settings.local_steps

    def start(self, w: SimWorker) -> None:
        self.credit[w.rank] = StepCredit(self.rate_com, torch.Generator().manual_seed(
            self.sim.config.seed * 1000 + w.rank + 17), poisson=self.variant.poisson)
        self._comm_next(w)
        self.sim.start_iteration(w)

    def on_compute(self, w: SimWorker) -> None:
        credit = self.credit[w.rank]
        assert credit is not None
        round_ends = w.iteration % self.local_steps == 0
        passive = w.wid in self.sim.core.graph.passive
        owed = 0 if passive or not round_ends else credit.next_step()
        self.owed[w.rank] = min(self.owed[w.rank] + owed, self.max_backlog)
        self.sim.start_iteration(w)
        if self.idle[w.rank] and self.owed[w.rank] > 0:
            self.idle[w.rank] = False
            self._comm_next(w)

    def poll_seconds(self, w: SimWorker) -> float:
        return LISTEN_POLL_SECONDS if w.listen else REQUEST_WAIT_SECONDS

    def on_decision(self, w: SimWorker, decision: GroupDecision) -> None:
        if decision.outcome is Outcome.RETRY:
            self._comm_next(w)
            return
        if decision.outcome is Outcome.NO_GROUP and not w.listen:
            self._settle(w)
        self.sim.later(LISTEN_POLL_SECONDS, w)

    def on_group_end(self, w: SimWorker) -> None:
        if (self.variant.pairs_at_once or not w.more) and not w.listen:
            self._settle(w)
        self._comm_next(w)

    def on_timer(self, w: SimWorker) -> None:
        self._comm_next(w)

    def spends(self, w: SimWorker) -> bool:
        """The exchange is its own while it owes one (the runtime's `_outer_exchange`)."""
        return self.owed[w.rank] > 0

    def _settle(self, w: SimWorker) -> None:
        self.owed[w.rank] = max(0, self.owed[w.rank] - 1)

    def _comm_next(self, w: SimWorker) -> None:
        """The communication thread asks for its next exchange, listens, or waits."""
        if w.done or w.in_group or w.wait_since is not None:
            return
        if self.owed[w.rank] > 0:
            self.sim.request(w, listen=False)
        elif self.variant.listens:
            self.sim.request(w, listen=True)
        else:
            self.idle[w.rank] = True
