"""Gossip protocols: the exchange arithmetic, A2CiD2's mixing, and the coordinator's pairing."""

from __future__ import annotations

import math
import random

import pytest
import torch
from coordinator_simulation import PROPERTY_SETTINGS, Simulation, SimWorker
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, CoordinatorError, Outcome
from ripples.coordinator.pairing import FifoPairing
from ripples.coordinator.topology import build_topology
from ripples.protocols.gossip.state import (
    GossipState,
    MomentumParameters,
    StepCredit,
    exchange_delta,
)

# ------------------------------------------------------------------ exchange arithmetic


def _exchange(a: GossipState, b: GossipState) -> float:
    """One pairwise exchange as two communication threads run it (the collective is the
    sum of the two halves)."""
    mine_a, mine_b = torch.empty_like(a.flat), torch.empty_like(b.flat)
    a.current(out=mine_a)
    b.current(out=mine_b)
    pair_a = mine_a / 2 + mine_b / 2
    pair_b = pair_a.clone()
    distance = exchange_delta(mine_a, pair_a)
    assert exchange_delta(mine_b, pair_b) == pytest.approx(distance)
    a.add_delta(pair_a)
    b.add_delta(pair_b)
    return distance


def test_pairwise_averaging_preserves_the_sum_and_reports_the_distance() -> None:
    gen = torch.Generator().manual_seed(0)
    states = [GossipState(torch.randn(1000, generator=gen, dtype=torch.float64),
                          MomentumParameters()) for _ in range(5)]
    total = sum(s.flat for s in states)
    x0, x1 = states[0].flat.clone(), states[1].flat.clone()
    assert _exchange(states[0], states[1]) == pytest.approx(float((x0 - x1).square().sum()))
    for s in states:
        s.apply_and_publish()
    assert torch.allclose(states[0].flat, (x0 + x1) / 2)
    assert torch.allclose(states[1].flat, (x0 + x1) / 2)
    rng = random.Random(1)
    for _ in range(40):  # exchanges between steps, deltas applied later, local steps too
        i, j = rng.sample(range(5), 2)
        _exchange(states[i], states[j])
        k = rng.randrange(5)
        step = torch.randn(1000, generator=gen, dtype=torch.float64)
        states[k].flat.add_(step)
        total += step
        states[k].apply_and_publish()
    for s in states:
        s.apply_and_publish()
    assert torch.allclose(sum(s.flat for s in states), total)


def test_a_delta_reaches_the_model_exactly_once() -> None:
    s = GossipState(torch.zeros(4), MomentumParameters())
    s.add_delta(torch.ones(4))
    seen = torch.empty(4)
    s.current(out=seen)  # partners already see it before the boundary
    assert torch.equal(seen, torch.ones(4))
    assert s.apply_and_publish()
    assert not s.apply_and_publish()
    assert torch.equal(s.flat, torch.ones(4))


def test_mixing_matches_its_closed_form() -> None:
    eta, tau = 0.3, 1.7
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    x_tilde = torch.tensor([0.0, 4.0, 0.5], dtype=torch.float64)
    s = GossipState(x.clone(), MomentumParameters(eta=eta, alpha_tilde=1.0))
    assert s.y is not None
    s.y.copy_(x_tilde - x)
    s.mix(tau)
    e = math.exp(-2 * eta * tau)
    a, b = (1 + e) / 2, (1 - e) / 2
    assert torch.allclose(s.flat, a * x + b * x_tilde)
    assert torch.allclose(s.flat + s.y, b * x + a * x_tilde)
    # Mixing conserves x + x~, and two half-steps equal one step.
    s2 = GossipState(x.clone(), MomentumParameters(eta=eta, alpha_tilde=1.0))
    assert s2.y is not None
    s2.y.copy_(x_tilde - x)
    s2.mix(tau / 2)
    s2.mix(tau / 2)
    assert torch.allclose(s2.flat, s.flat) and torch.allclose(s2.y, s.y)
    assert torch.allclose(2 * s.flat + s.y, x + x_tilde)


def test_an_exchange_moves_the_momentum_copy_by_alpha_tilde() -> None:
    alpha_tilde = 1.87
    xi, xj = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    si = GossipState(xi.clone(), MomentumParameters(eta=0.1, alpha_tilde=alpha_tilde))
    sj = GossipState(xj.clone(), MomentumParameters(eta=0.1, alpha_tilde=alpha_tilde))
    _exchange(si, sj)
    si.apply_and_publish()
    assert si.y is not None
    assert torch.allclose(si.flat, (xi + xj) / 2)
    x_tilde = si.flat + si.y  # was xi (y = 0): now xi + alpha~ (xj - xi)
    assert torch.allclose(x_tilde, xi + alpha_tilde * (xj - xi))


@pytest.mark.parametrize(("rate", "poisson"), [(1.0, False), (0.5, False), (2.5, False),
                                               (1.0, True), (3.0, True), (0.25, True)])
def test_averagings_per_step_follow_the_rate(rate: float, poisson: bool) -> None:
    credit = StepCredit(rate, torch.Generator().manual_seed(3), poisson=poisson)
    owed = [credit.next_step() for _ in range(4000)]
    mean = sum(owed) / len(owed)
    if not poisson:
        assert mean == pytest.approx(rate, abs=1e-3)
        assert max(owed) - min(owed) <= 1
    elif rate >= 1:  # max(1, Poisson(rate)): never a step without an averaging
        assert min(owed) >= 1
        expected = rate + math.exp(-rate)  # E[max(1, N)] = E[N] + P(N = 0)
        assert mean == pytest.approx(expected, rel=0.06)
    else:  # one averaging every max(1, Poisson(1/rate)) steps
        assert set(owed) == {0, 1}
        gap = 1 / rate + math.exp(-1 / rate)
        assert mean == pytest.approx(1 / gap, rel=0.1)


# ------------------------------------------------------------------ FIFO pairing


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 10), topology=st.sampled_from(["ring", "complete", "exponential"]),
       events=st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=80))
def test_fifo_pairing_joins_only_neighbours_oldest_first(
        n: int, topology: str, events: list[tuple[bool, int]]) -> None:
    graph = build_topology(topology, n)
    pairing = FifoPairing()
    busy: set[int] = set()  # paired and not yet available again
    for offer, raw in events:
        w = raw % n
        if offer and w not in pairing:
            busy.discard(w)
            queue = pairing.waiting()
            partner = pairing.offer(w, graph.neighbours_of(w))
            first = next((q for q in queue if q in graph.neighbours_of(w)), None)
            assert partner == first  # the neighbour that waited longest, or none
            if partner is not None:
                assert partner not in busy and partner not in pairing
                busy.update((w, partner))
        elif not offer:
            was_waiting = w in pairing
            assert pairing.withdraw(w) == was_waiting
            assert w not in pairing
        queued = pairing.waiting()
        assert len(set(queued)) == len(queued)
        for a in queued:  # no two waiting workers could have been paired
            assert not any(b in graph.neighbours_of(a) for b in queued if b != a)


def test_fifo_pairing_offers_and_withdrawals() -> None:
    pairing = FifoPairing()
    assert pairing.offer(0, [1, 3]) is None
    assert pairing.offer(2, [1, 3]) is None
    assert pairing.offer(1, [0, 2]) == 0  # 0 came first
    assert pairing.waiting() == (2,)
    assert pairing.withdraw(2) and not pairing.withdraw(2)
    with pytest.raises(ValueError, match="already waiting"):
        pairing.offer(5, None)
        pairing.offer(5, None)


# ------------------------------------------------------------------ the coordinator


def _started(protocol: str, n: int = 4, **fields: object) -> CoordinatorCore:
    core = CoordinatorCore(RunSettings.build(protocol=protocol, num_workers=n,
                                             iterations=10**6, **fields), now=0.0)
    ids = [core.register("node0", r, "cpu", 100 + r, 0.0) for r in range(n)]
    for wid in ids:
        core.mark_ready(wid, 10**6, 0.0)
    assert core.started_at is not None and not core.stopped
    return core


def test_a2cid2_pairs_available_neighbours_first_in_first_out() -> None:
    core = _started("a2cid2", topology="ring")  # 0-1-2-3-0
    assert core.request_group(0, 1, 0.1)[0] is None
    assert core.request_group(2, 1, 0.2)[0] is None  # not 0's neighbour: both wait
    decision, others = core.request_group(1, 1, 0.3)  # neighbour of both; 0 waited longest
    assert decision is not None and decision.outcome is Outcome.GROUP
    assert decision.group is not None and decision.group.members == (0, 1)
    assert others[0].group is decision.group
    decision, others = core.request_group(3, 1, 0.4)
    assert decision is not None and decision.group is not None
    assert decision.group.members == (2, 3) and 2 in others


def test_a2cid2_wait_ends_with_retry_and_a_worker_without_live_neighbours_is_told() -> None:
    core = _started("a2cid2", topology="ring")
    assert core.request_group(0, 1, 0.1)[0] is None
    assert core.abandon_wait(0, 5.0).outcome is Outcome.RETRY
    assert core.groups.pairing is not None and 0 not in core.groups.pairing
    core.leave(1, None, "", 5.1)
    core.leave(3, None, "", 5.2)
    decision, _ = core.request_group(0, 2, 5.3)
    assert decision is not None and decision.outcome is Outcome.NO_GROUP


def test_adpsgd_listener_is_served_as_soon_as_a_neighbour_picks_it() -> None:
    core = _started("adpsgd", topology="ring")
    assert core.request_group(1, 0, 0.1, listen=True)[0] is None
    assert core.request_group(3, 0, 0.1, listen=True)[0] is None
    decision, others = core.request_group(0, 1, 0.2)  # picks 1 or 3: both listen
    assert decision is not None and decision.group is not None
    partner = next(m for m in decision.group.members if m != 0)
    assert partner in (1, 3) and others[partner].group is decision.group
    assert not decision.more
    assert core.workers[partner].request_count == 0  # listening is not a slowdown tick


def test_adpsgd_bipartite_passive_workers_only_listen() -> None:
    core = _started("adpsgd", topology="ring", adpsgd_mode="bipartite")
    assert core.graph.passive == frozenset({1, 3})
    with pytest.raises(CoordinatorError, match="passive"):
        core.request_group(1, 1, 0.1)
    with pytest.raises(CoordinatorError, match="a2cid2.s workers do not listen"):
        _started("a2cid2").request_group(0, 1, 0.1, listen=True)


def test_consensus_distance_is_estimated_from_pair_distances() -> None:
    core = _started("a2cid2", topology="complete")
    assert core.consensus_distance() is None
    core.request_group(0, 1, 0.1)
    decision, _ = core.request_group(1, 1, 0.2)
    assert decision is not None and decision.group is not None
    gid = decision.group.group_id
    core.release(0, gid, True, "", 0.3, squared_distance=6.0)
    core.release(1, gid, True, "", 0.3, squared_distance=6.0)
    # E||x_i - x_j||^2 = 2n/(n-1) D for n = 4: D = 6 * 3/8.
    assert core.consensus_distance() == pytest.approx(6.0 * 3 / 8)
    with pytest.raises(CoordinatorError, match="squared_distance"):
        core.release(0, gid, True, "", 0.4, squared_distance=float("nan"))


def test_topology_reaches_the_group_generator_and_the_views() -> None:
    core = _started("ripples-random", n=6, topology="ring", group_size=2)
    assert core.neighbours_of(0) == (1, 5)
    assert core.graph.edges == [(0, 1), (0, 5), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert core.graph.spectral_gap == pytest.approx(build_topology("ring", 6).spectral_gap())
    for it in range(1, 30):
        decision, _ = core.request_group(0, it, 0.1 * it)
        if decision is None:
            continue
        assert decision.group is not None
        assert set(decision.group.members) - {0} <= {1, 5}
        for m in decision.group.members:
            core.release(m, decision.group.group_id, True, "", 0.1 * it)


# ------------------------------------------------------------------ simulated runs


class GossipSimulation(Simulation):
    """The core simulator with gossip requests: adpsgd workers may listen instead of
    initiating; a2cid2 workers wait in the pairing queue rather than at a group."""

    def __init__(self, run: RunSettings, listen_bits: list[bool]) -> None:
        super().__init__(run)
        self.listen_bits = listen_bits or [False]
        self.num_requests = 0

    def act(self, w: SimWorker, *, fail_group: bool = False) -> None:
        if w.mode != "compute" or self.run.protocol != "adpsgd":
            super().act(w, fail_group=fail_group)
            return
        listen = self.listen_bits[self.num_requests % len(self.listen_bits)] \
            and w.worker_id not in self.core.graph.passive or w.worker_id in self.core.graph.passive
        self.num_requests += 1
        if not listen:
            super().act(w, fail_group=fail_group)
            return
        self.tick()
        w.iteration += 1  # a listener computes on; it serves partners between its steps
        w.continuing = False
        decision, deliveries = self.core.request_group(w.worker_id, w.iteration, self.now,
                                                       listen=True)
        w.mode = "waiting"
        if decision is not None:
            self.receive(w, decision)
        self.apply(deliveries)
        self.check()

    def receive(self, w, decision) -> None:  # type: ignore[no-untyped-def]
        super().receive(w, decision)
        if decision.group is not None:
            a, b = decision.group.members
            assert b in self.core.neighbours_of(a), f"pair {a, b} are not neighbours"

    def check(self) -> None:
        self.core.table.check_invariants()
        for w in self.live():
            if w.mode != "waiting":
                continue
            head = self.core.table.head(w.worker_id)
            record = self.core.workers[w.worker_id]
            if self.core.groups.pairing is not None:
                assert w.worker_id in self.core.groups.pairing and head is None
            elif head is None:
                assert record.listening, f"worker {w.worker_id} waits on nothing"
            else:
                assert not head.delivered and w.worker_id in head.arrived
        for g in self.core.table.unfinished():
            assert len(g.members) == 2

    def before_fair_round(self) -> None:
        # A listening request ends after a short poll in the real system, so a listener
        # whose neighbours are all gone cannot stall the fair phase.
        for w in self.live():
            if w.mode == "waiting" and self.core.workers[w.worker_id].listening:
                self.abandon(w)


gossip_run_st = st.builds(
    lambda protocol, n, topology, seed: RunSettings.build(
        protocol=protocol, num_workers=n, topology=topology, seed=seed, iterations=10**6,
        adpsgd_mode="bipartite" if protocol == "adpsgd-bipartite" else "serialised")
    if protocol != "adpsgd-bipartite" else RunSettings.build(
        protocol="adpsgd", num_workers=2 * (n // 2) + 2, topology="ring", seed=seed,
        iterations=10**6, adpsgd_mode="bipartite"),
    protocol=st.sampled_from(["adpsgd", "a2cid2", "adpsgd-bipartite"]),
    n=st.integers(2, 9),
    topology=st.sampled_from(["complete", "ring", "exponential", "ring-based"]),
    seed=st.integers(0, 2**16),
)


@PROPERTY_SETTINGS
@given(run=gossip_run_st, choices=st.lists(st.integers(0, 10**6), min_size=1, max_size=300),
       listen_bits=st.lists(st.booleans(), max_size=8))
# Found by this property: worker 1 of an a2cid2 ring of 6 waits for a partner, then both
# its neighbours (0 and 2) leave: it must be answered, not left waiting for nobody.
@example(run=RunSettings.build(protocol="a2cid2", num_workers=6, topology="ring", seed=0,
                               iterations=10**6), choices=[6, 0, 6], listen_bits=[])
def test_gossip_pairs_join_neighbours_once_at_a_time_and_never_deadlock(
        run: RunSettings, choices: list[int], listen_bits: list[bool]) -> None:
    sim = GossipSimulation(run, listen_bits)
    sim.random_phase(choices, allow_departures=True)
    if sim.core.stopped:
        return
    if run.protocol == "a2cid2" or sim.core.graph.passive:
        sim.listen_bits = [False]
    sim.fair_phase()

