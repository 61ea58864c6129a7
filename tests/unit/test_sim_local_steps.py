"""Local steps and the outer optimizer in the simulator (`ripples simulate --set
local_steps=H --set outer_optimizer=nesterov`): when the simulated workers synchronise,
what a synchronisation sends, and what it does to the consensus model (OuterState's rule,
docs/local-steps.md). Small runs on the simulator's fake clock; every figure is
deterministic for its seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ripples.coordinator.config import RunSettings
from ripples.protocols.gossip.state import StepCredit
from ripples.sim.config import SimConfig, SimResult
from ripples.sim.engine import Simulation, simulate
from ripples.sim.models import CommModel, ComputeModel, ConsensusModel, ConsensusState
from ripples.sim.outer_step import OuterStep
from ripples.sim.worker_model import SimWorker
from tests.integration.helpers import ripples_cli

NESTEROV = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.5}
INSTANT_LINKS = CommModel(inter_host_bandwidth=1e30, intra_host_bandwidth=1e30)
"""Links so fast that a collective's bytes add nothing a float can hold to its seconds:
runs that send different bytes keep the same schedule."""


def config(protocol: str, *, workers: int = 8, iterations: int = 40,
           **options: object) -> SimConfig:
    return SimConfig(protocol=protocol, workers=workers, iterations=iterations,
                     run_options=options)


@pytest.mark.parametrize("protocol", ["ripples-smart", "ripples-random"])
def test_the_group_generator_is_asked_at_multiples_of_h_only(protocol: str) -> None:
    sim = Simulation(config(protocol, local_steps=4, **NESTEROV))
    asked: dict[int, set[int]] = {}
    request = sim.request

    def counted(w: SimWorker, *, listen: bool = False) -> None:
        asked.setdefault(w.rank, set()).add(w.iteration)
        request(w, listen=listen)

    sim.request = counted  # type: ignore[method-assign]
    result = sim.run()
    assert result.stop_reason.startswith("iteration budget reached")
    for w in sim.workers:  # every round's end, and nothing between
        assert asked.get(w.rank, set()) == set(range(4, w.iteration + 1, 4)), w.rank
    every_step = simulate(config(protocol))
    assert result.groups < every_step.groups / 2


def test_allreduce_runs_one_collective_per_round_and_ends_a_partial_one() -> None:
    # 30 iterations at H = 4: rounds end at 4, 8, ..., 28, and the budget at 30 ends
    # inside a round with one more all-reduce (the plain mean).
    result = simulate(config("allreduce", iterations=30, local_steps=4))
    assert result.groups == math.ceil(30 / 4) and result.mean_group_size == 8
    assert simulate(config("allreduce", iterations=30)).groups == 30
    assert result.consensus_distance < 1e-20  # the stop's mean leaves them equal


def test_gossip_owes_its_exchanges_per_round_of_h_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    next_step = StepCredit.next_step

    def counted(self: StepCredit) -> int:
        calls.append(1)
        return next_step(self)

    monkeypatch.setattr(StepCredit, "next_step", counted)
    sim = Simulation(config("adpsgd", local_steps=4, **NESTEROV))
    result = sim.run()
    assert result.stop_reason.startswith("iteration budget reached")
    assert len(calls) == sum(w.iteration // 4 for w in sim.workers)  # once per round
    every_step = simulate(config("adpsgd"))
    assert result.averagings_per_iteration < every_step.averagings_per_iteration / 2


def test_a_round_of_h_steps_waits_for_the_slowest_once_per_round() -> None:
    comm = CommModel()
    ring = comm.allreduce_seconds(8, spans_hosts=True)
    slow = ComputeModel(scenario="slow-5x", jitter=0.0)
    plain = simulate(SimConfig(protocol="allreduce", workers=8, iterations=40, compute=slow,
                               comm=comm, run_options={"local_steps": 4}))
    assert plain.seconds_per_iteration == pytest.approx(0.5 + ring / 4, rel=1e-9)
    assert plain.bytes_per_worker_iteration == pytest.approx(comm.model_bytes / 4)
    # DiLoCo's form: the pseudo-gradients, once the first synchronisation (anchors and
    # momenta as well: twice the bytes) has made the anchors agree.
    diloco = simulate(SimConfig(protocol="allreduce", workers=8, iterations=40, compute=slow,
                                comm=comm, run_options={"local_steps": 4, **NESTEROV}))
    ring2 = comm.allreduce_seconds(8, spans_hosts=True, vectors=2)
    assert diloco.seconds_per_iteration == pytest.approx(
        0.5 + (9 * ring + ring2) / 40, rel=1e-9)
    assert diloco.bytes_per_worker_iteration == pytest.approx(11 * comm.model_bytes / 40)
    assert diloco.consensus_distance < 1e-20
    # bf16: the pseudo-gradients in half a vector; the first sync's momentum too.
    bf16 = simulate(SimConfig(protocol="allreduce", workers=8, iterations=40, compute=slow,
                              comm=comm, run_options={"local_steps": 4, **NESTEROV,
                                                      "outer_compression": "bf16"}))
    assert bf16.bytes_per_worker_iteration == pytest.approx(
        (1.5 + 9 * 0.5) * comm.model_bytes / 40)


def test_the_group_forms_bytes_follow_the_momentum_and_compression() -> None:
    """As OuterState.sent_bytes: the anchor and the momentum (2 vectors), the momentum
    in bf16 (1.5), no momentum at μ = 0 (1, as plain averaging)."""
    def run(**options: object) -> float:
        return simulate(SimConfig(protocol="ripples-smart", workers=8, iterations=40,
                                  comm=INSTANT_LINKS, run_options={"local_steps": 4, **options})
                        ).bytes_per_worker_iteration

    plain = run()
    assert run(**NESTEROV) == pytest.approx(2 * plain)
    assert run(**NESTEROV, outer_compression="bf16") == pytest.approx(1.5 * plain)


@pytest.mark.parametrize("protocol", ["ripples-smart", "allreduce"])
def test_nesterov_with_lr_1_and_momentum_0_is_plain_averaging(protocol: str) -> None:
    def run(**options: object) -> SimResult:
        return simulate(SimConfig(protocol=protocol, workers=8, iterations=40,
                                  comm=INSTANT_LINKS, run_options={"local_steps": 4, **options}))

    plain = run()
    outer = run(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0)
    # The same schedule (the bytes differ, the seconds do not) ...
    assert (outer.sim_seconds, outer.groups, outer.iterations) == (
        plain.sim_seconds, plain.groups, plain.iterations)
    # ... and the same numbers, to rounding (φ − (φ − x) is x up to an ulp).
    assert [t for t, _ in outer.consensus_curve] == [t for t, _ in plain.consensus_curve]
    np.testing.assert_allclose([d for _, d in outer.consensus_curve],
                               [d for _, d in plain.consensus_curve], rtol=1e-9, atol=1e-15)
    assert outer.optimum_gap == pytest.approx(plain.optimum_gap, rel=1e-9)
    # With μ = 0 the momentum never counts and is not sent: the same bytes.
    assert outer.bytes_per_worker_iteration == plain.bytes_per_worker_iteration
    # A real outer step moves the models elsewhere.
    nesterov = run(**NESTEROV)
    assert nesterov.optimum_gap != pytest.approx(plain.optimum_gap, rel=1e-3)


def reference_sync(x: np.ndarray, anchor: np.ndarray, momentum: np.ndarray,
                   spend: list[bool], lr: float, mu: float
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """docs/local-steps.md's rule, member by member: the provisional steps, their means,
    and the members' new vectors."""
    k = len(spend)
    provisional, moments = [], []
    for j in range(k):
        if spend[j]:
            delta = anchor[j] - x[j]
            m_hat = mu * momentum[j] + delta
            provisional.append(anchor[j] - lr * (delta + mu * m_hat))
            moments.append(m_hat)
        else:
            provisional.append(anchor[j])
            moments.append(momentum[j])
    new_anchor = sum(provisional) / k
    new_momentum = sum(moments) / k
    new_x = np.array([new_anchor if spend[j] else x[j] + new_anchor - anchor[j]
                      for j in range(k)])
    return new_anchor, new_momentum, new_x


def test_the_outer_step_is_outer_states_rule() -> None:
    rng = np.random.default_rng(5)
    state = ConsensusState(ConsensusModel(dim=3), 4, seed=1,
                           outer=OuterStep(lr=0.7, momentum=0.5))
    state.x[:] = rng.normal(size=(4, 3))
    state.anchor[:] = rng.normal(size=(4, 3))
    state.momentum[:] = rng.normal(size=(4, 3))
    state.steps[:] = [5, 5, 3, 7]
    state.spent_at[:] = [1, 5, 0, 2]  # rank 1 took no step since its last spent sync
    ranks = [0, 1, 2]
    x, anchor, momentum = state.x.copy(), state.anchor.copy(), state.momentum.copy()
    # Rank 2 is a partner picked mid-round (gossip): it keeps its progress.
    state.average(ranks, state.snapshot(ranks, own=[True, True, False]))
    want_anchor, want_momentum, want_x = reference_sync(
        x[ranks], anchor[ranks], momentum[ranks], [True, False, False], 0.7, 0.5)
    for r in ranks:  # every member leaves with the group's anchor and momentum
        np.testing.assert_allclose(state.anchor[r], want_anchor, rtol=1e-12)
        np.testing.assert_allclose(state.momentum[r], want_momentum, rtol=1e-12)
    np.testing.assert_allclose(state.x[ranks], want_x, rtol=1e-12)
    np.testing.assert_array_equal(state.x[0], state.anchor[0])  # spent: x is the anchor
    assert list(state.spent_at) == [5, 5, 0, 2]  # only the spender's count moves
    np.testing.assert_array_equal(state.x[3], x[3])  # not in the group: untouched


def test_with_every_worker_and_equal_anchors_it_is_dilocos_step() -> None:
    rng = np.random.default_rng(6)
    lr, mu = 0.7, 0.5
    state = ConsensusState(ConsensusModel(dim=4), 5, seed=2, outer=OuterStep(lr=lr, momentum=mu))
    phi, m = rng.normal(size=4), rng.normal(size=4)
    state.anchor[:], state.momentum[:] = phi, m
    state.x[:] = rng.normal(size=(5, 4))
    state.steps[:] = 3
    x = state.x.copy()
    state.average(list(range(5)), state.snapshot(list(range(5))))
    grad = (phi - x).mean(axis=0)  # DiLoCo: m ← μ m + Δ̄, φ ← φ − η (Δ̄ + μ m)
    want_m = mu * m + grad
    want_phi = phi - lr * (grad + mu * want_m)
    np.testing.assert_allclose(state.momentum, np.tile(want_m, (5, 1)), rtol=1e-12)
    np.testing.assert_allclose(state.x, np.tile(want_phi, (5, 1)), rtol=1e-12)


def test_protocols_that_refuse_local_steps_refuse_them_in_the_simulator() -> None:
    options = {"local_steps": 4}
    with pytest.raises(ValueError) as real:
        RunSettings.build(protocol="a2cid2", task="simulated", num_workers=8,
                          iterations=10, **options).validate()
    assert "a2cid2 takes no local_steps" in str(real.value)
    with pytest.raises(ValueError) as simulated:
        simulate(config("a2cid2", **options))
    assert str(simulated.value) == str(real.value)  # the real check, word for word
    with pytest.raises(ValueError, match="a2cid2 takes no local_steps or outer_optimizer"):
        config("a2cid2", outer_optimizer="nesterov").settings()
    # A shard's run names a root, which takes no local steps (a head would hold two
    # anchors), in the simulator as in the service.
    with pytest.raises(ValueError, match="a shard's head would hold two anchors"):
        simulate(SimConfig(protocol="ripples-smart", workers=16, iterations=10, shards=2,
                           run_options=options))
    bad = ripples_cli("simulate", "--workers", "8", "--protocol", "a2cid2",
                      "--set", "local_steps=16", "--set", "outer_optimizer=nesterov")
    assert bad.returncode == 2 and "a2cid2 takes no local_steps" in bad.stderr
