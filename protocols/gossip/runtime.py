"""`adpsgd` and `a2cid2`: wait-free pairwise gossip with graph neighbours.

The compute loop never waits for communication. After each gradient step it adds the
deltas of the exchanges finished meanwhile, mixes A2CiD2's momentum, publishes a snapshot
and tells the communication thread how many averagings the step owes. The communication
thread owns every collective and every coordinator request of the protocol:

- `adpsgd` (AD-PSGD, the Ripples paper's Fig. 3): for each owed averaging it asks the
  coordinator to pair it with a random neighbour (the coordinator's group table orders
  overlapping pairs, so no cycle of waits exists on any graph); while it owes nothing it
  *listens*, so a partner that picks it is served at once rather than after its next
  step (AD-PSGD's passive side). Bipartite mode: passive workers only listen.
- `a2cid2`: while it owes averagings it is *available*; the coordinator pairs available
  neighbours first-in-first-out. With momentum (the default) the model also follows
  A2CiD2's continuous mixing with its momentum copy (state.py).

What differs between the two is their `GossipVariant` (spec.py).

adpsgd with local steps (`--local-steps H`) owes `--rate-com` exchanges per round of H
steps; with `--outer-optimizer nesterov` an exchange is the outer form of the pair on
the exchanged snapshot (OuterState.exchange; docs/local-steps.md, "Gossip").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import torch

from ripples.protocols.gossip.settings import GossipSettings
from ripples.protocols.gossip.state import (
    GossipState,
    MomentumParameters,
    StepCredit,
    exchange_delta,
)
from ripples.protocols.gossip.variants import VARIANTS
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.dataplane.group_sync import heal_in_group
from ripples.worker.dataplane.local_rounds import local_steps
from ripples.worker.dataplane.outer_state import OuterState
from ripples.worker.dataplane.preduce import copy_from_donor
from ripples.worker.metrics import MetricSpec
from ripples.worker.protocol import (
    COORDINATOR_RETRY_SECONDS,
    Protocol,
    ProtocolContext,
    StreamInterrupted,
    SyncResult,
    heal_from_peer,
    max_peer_wait_seconds,
    run_group_collective,
)

logger = logging.getLogger(__name__)

LISTEN_POLL_SECONDS = 0.05
"""adpsgd: a listening request returns after this long with no partner, so an averaging
owed by the next step starts at most this late."""
REQUEST_WAIT_SECONDS = 5.0
"""Server-side bound on one wait for a partner; the thread then asks again."""
MAX_BACKLOG_STEPS = 2
"""Owed averagings are capped at this many steps' worth: a worker whose partners are all
busy drops the excess (counted) instead of averaging in a burst later."""
JOIN_SECONDS = 30.0


DROPPED_METRIC = MetricSpec(
    "ripples_worker_gossip_dropped_exchanges", "counter",
    "Gossip: owed pairwise averagings dropped because the backlog was full (exchanges "
    "finish slower than --rate-com asks).")


class GossipProtocol(Protocol):
    """Runs the communication thread and applies its results at step boundaries."""

    name = "gossip"
    metrics = (DROPPED_METRIC,)

    def __init__(self, ctx: ProtocolContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        settings = GossipSettings.of_config(cfg)
        variant = VARIANTS.get(cfg.protocol)
        if variant is None:
            raise ValueError(f"GossipProtocol does not run protocol {cfg.protocol!r}")
        self.variant = variant
        constants = ctx.membership.gossip
        momentum = MomentumParameters(eta=constants.eta, alpha_tilde=constants.alpha_tilde) \
            if variant.momentum and settings.momentum else MomentumParameters()
        self.passive = constants.passive
        self.timeout = cfg.collective_timeout_seconds
        self.local_steps = local_steps(cfg)
        """adpsgd with local steps: a round is this many steps, and --rate-com counts the
        exchanges owed per round."""
        self.outer = OuterState.of_config(ctx.state, cfg)
        self._spent_at = 0
        """The communication thread's: the step whose progress its last spent exchange
        took (outer optimizer)."""
        self.stream = ctx.client.open_group_stream(ctx.worker_id)
        if ctx.membership.replacement:  # copy a live peer's model before anything starts
            heal_from_peer(ctx, self.stream, self._heal, max_peer_wait_seconds(cfg))
        self.state = GossipState(ctx.state.flat, momentum)
        self._mine = torch.empty_like(ctx.state.flat)  # this side of an exchange
        self.credit = StepCredit(settings.rate_com, torch.Generator().manual_seed(
            cfg.seed * 1000 + ctx.rank + 17), poisson=variant.poisson)
        self.max_backlog = max(2, MAX_BACKLOG_STEPS * math.ceil(settings.rate_com))
        self.num_dropped = 0  # owed averagings dropped at the backlog cap
        self.dropped_metric = ctx.metrics.declare(*self.metrics)[DROPPED_METRIC.name]
        self.step_seconds = 0.0  # A2CiD2's delta: running estimate of one step's duration
        self._last_boundary = time.perf_counter()
        # Shared with the communication thread, under _cond.
        self._cond = threading.Condition()
        self._owed = 0
        self._iteration = 0
        self._finished: list[float] = []  # seconds of each exchange since the boundary
        self._num_failed = 0
        self._stop_reason = ""
        self._error: BaseException | None = None
        self._closing = False
        self._coordinator_lost = False  # the communication thread cannot reach it
        self._outage_steps = 0  # steps in a row the compute thread made meanwhile
        self._thread = threading.Thread(target=self._communicate, daemon=True,
                                         name=f"gossip-{ctx.worker_id}")
        self._thread.start()

    # ------------------------------------------------------------ compute thread
    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"gossip communication failed: {self._error}") \
                    from self._error
            reason = self._stop_reason
        if reason:
            return SyncResult(stop=True, stop_reason=reason)
        if self.ctx.stop_requested.is_set():
            return self.ctx.coordinator_stop()
        return None

    def after_step(self, completed: int) -> SyncResult:
        t0 = time.perf_counter()
        elapsed = t0 - self._last_boundary
        self._last_boundary = t0
        if completed > 1:  # the first step includes warm-up: it does not set the clock
            self.step_seconds = elapsed if self.step_seconds == 0 else \
                0.5 * elapsed + 0.5 * self.step_seconds
        if self.step_seconds > 0:
            self.state.mix(elapsed / self.step_seconds)
        self.state.apply_and_publish()
        self._bound_outage()
        round_ends = completed % self.local_steps == 0
        owed = 0 if self.passive or not round_ends else self.credit.next_step()
        with self._cond:
            self._iteration = completed
            total = self._owed + owed
            self._owed = min(total, self.max_backlog)
            dropped = total - self._owed
            self.num_dropped += dropped
            if dropped:
                self.dropped_metric.inc(dropped)
            finished, self._finished = self._finished, []
            failed, self._num_failed = self._num_failed, 0
            self._cond.notify_all()
        boundary = time.perf_counter() - t0
        return SyncResult(
            preduce_seconds=boundary, num_groups=len(finished) + failed,
            num_failed_groups=failed,
            group_sizes=(2,) * len(finished),
            preduce_durations=tuple(finished),
            preduce_bytes=len(finished) * self._exchange_bytes())

    def _exchange_bytes(self) -> int:
        """What one exchange feeds into its collective(s): the flat state, or the outer
        form's buffers; gossip's collectives carry no non-finite flag."""
        if self.outer is None:
            return self.ctx.state.size_bytes
        return self.outer.sent_bytes(flag=False)

    def _bound_outage(self) -> None:
        """While the coordinator is unreachable, train on alone for up to the run's
        outage_local_steps steps in a row, then wait for it (the heartbeat ends the wait
        once the outage window is over)."""
        with self._cond:
            if not self._coordinator_lost:
                self._outage_steps = 0
                return
            self._outage_steps += 1
            if self._outage_steps <= self.ctx.config.outage_local_steps:
                return
            logger.warning("%d steps without the coordinator: waiting for it",
                           self._outage_steps - 1)
            while (self._coordinator_lost and not self._closing and self._error is None
                   and not self.ctx.stop_requested.is_set()):
                self._cond.wait(COORDINATOR_RETRY_SECONDS)

    def state_dict(self) -> dict[str, object]:
        """A2CiD2's momentum copy (held as x~ - x): the model alone does not carry it."""
        return {} if self.state.y is None else {"momentum_copy": self.state.y}

    def load_state_dict(self, state: dict[str, object]) -> None:
        copy = state.get("momentum_copy")
        self.state.restart(copy if isinstance(copy, torch.Tensor) else None)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(JOIN_SECONDS)
        if self._thread.is_alive():
            logger.warning("gossip thread still busy after %.0f s; leaving it", JOIN_SECONDS)
        self.stream.close()

    # ------------------------------------------------------------ communication thread
    def _communicate(self) -> None:
        try:
            with torch.no_grad():
                self._serve()
        except BaseException as err:  # handed to the compute thread, which raises it
            logger.error("gossip thread failed: %s", err)
            with self._cond:
                self._error = err

    def _next_request(self) -> tuple[bool, int] | None:
        """Wait until there is something to ask for: (listen, iteration), or None to end."""
        with self._cond:
            while True:
                if self._closing:
                    return None
                if self._owed > 0:
                    return False, self._iteration
                if self.variant.listens:
                    return True, self._iteration
                self._cond.wait(1.0)

    def _serve(self) -> None:
        waited_since: float | None = None
        while (request := self._next_request()) is not None:
            listen, iteration = request
            wait = LISTEN_POLL_SECONDS if listen else REQUEST_WAIT_SECONDS
            try:
                reply = self.stream.request(iteration, wait, self.ctx.progress(),
                                            listen=listen)
            except StreamInterrupted as err:  # training goes on; averaging resumes later
                with self._cond:
                    if not self._coordinator_lost:
                        logger.warning("no averaging while the coordinator is unreachable: "
                                       "%s", err)
                    self._coordinator_lost = True
                time.sleep(COORDINATOR_RETRY_SECONDS)
                continue
            with self._cond:
                self._coordinator_lost = False
                self._cond.notify_all()
            for comm_id in reply.evict_comm_ids:
                self.ctx.comms.drop(self._key(comm_id))
            if reply.outcome == pb.GROUP_OUTCOME_STOP:
                with self._cond:
                    self._stop_reason = reply.detail or "stopped by the coordinator"
                return
            if reply.outcome == pb.GROUP_OUTCOME_RETRY:
                if not listen:
                    waited_since = waited_since or time.perf_counter()
                    waited = time.perf_counter() - waited_since
                    if waited > max_peer_wait_seconds(self.ctx.config):
                        raise TimeoutError(f"no partner for {waited:.0f} s: {reply.detail}")
                continue
            waited_since = None
            if reply.outcome == pb.GROUP_OUTCOME_GROUP:
                self._exchange(reply.group)
                settled = self.variant.pairs_at_once or (not listen and not reply.more)
            else:  # NO_GROUP (no live neighbour) or CANCELLED (the partner left)
                logger.info("no averaging: %s", reply.detail)
                settled = reply.outcome == pb.GROUP_OUTCOME_NO_GROUP
                if settled:
                    time.sleep(LISTEN_POLL_SECONDS)
            if settled and not listen:
                with self._cond:
                    self._owed = max(0, self._owed - 1)

    def _key(self, comm_id: int) -> str:
        return f"gossip/{self.ctx.config.run_id}/{comm_id}"

    def _heal(self, group: pb.Group) -> tuple[float, bool]:
        """A replacement's heal group, before the exchanges start: take the donor's model."""
        donor = list(group.members).index(group.heal_donor)
        return run_group_collective(self.ctx, self.stream, group, self._key(group.comm_id),
                                    lambda comm: heal_in_group(self.ctx.state, self.outer, comm,
                                                               donor, self.timeout))

    def _exchange(self, group: pb.Group) -> None:
        """Average with the partner; the result reaches the model at the next boundary.
        In a heal group this worker is the donor: it sends its model, which stays as is."""
        collective = self._donate_to(group) if group.heal else self._average_with
        seconds, ok = run_group_collective(self.ctx, self.stream, group,
                                           self._key(group.comm_id), collective)
        with self._cond:
            if ok:
                self._finished.append(seconds)
            else:
                self._num_failed += 1

    def _donate_to(self, group: pb.Group) -> Callable[[Communicator], None]:
        donor = list(group.members).index(group.heal_donor)

        def donate(comm: Communicator) -> None:
            self.state.current(out=self._mine)  # what partners see: snapshot + deltas
            if self.outer is not None:
                self.outer.heal(comm, donor, self.ctx.state.model_numel, self.timeout,
                                seen=self._mine)
                return
            copy_from_donor(self._mine, comm, donor, self.timeout)
        return donate

    def _average_with(self, comm: Communicator) -> float | None:
        """One exchange on `comm`: hands the delta to the state, returns ||w_i - w_j||^2
        (None with the outer optimizer, whose partner's model is not seen)."""
        mine = self._mine
        self.state.current(out=mine)
        if self.outer is not None:
            self._outer_exchange(mine, comm)
            return None
        # A fresh buffer per exchange: a failed collective may still write into its
        # buffer later (docs/data-plane.md rule 4).
        pair = torch.mul(mine, 1.0 / comm.size)
        comm.allreduce_sum_(pair, self.timeout)
        distance = exchange_delta(mine, pair)
        self.state.add_delta(pair)
        return distance

    def _outer_exchange(self, mine: torch.Tensor, comm: Communicator) -> None:
        """An exchange with the outer optimizer (docs/local-steps.md): this worker spends
        its progress when the exchange is its own (it owes one: the end of a round) and
        it stepped since its last spent exchange; as the partner picked mid-round, or
        with nothing new, it contributes its anchor and momentum and keeps its progress."""
        assert self.outer is not None
        with self._cond:
            iteration, own = self._iteration, self._owed > 0
        spend = own and iteration > self._spent_at
        delta = self.outer.exchange(mine, comm, self.timeout, spend=spend)
        if spend:
            self._spent_at = iteration
        self.state.add_delta(delta)
