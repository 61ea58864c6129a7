"""The outer step of local-step training (worker/dataplane/outer_state.py) against a
reference written from DiLoCo's formulas (arXiv 2311.08105, Algorithm 1, with torch's
Nesterov SGD as the outer optimizer):

    Δ_i = φ − x_i,  Δ̄ = mean Δ_i,  m ← μ m + Δ̄,  φ ← φ − η (Δ̄ + μ m),  x_i ← φ.

The groups synchronise through real gloo communicators (threads of this process, one
per member, on an in-memory store), as the workers' P-Reduce does."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
import torch.distributed as dist

from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import Communicator, CommunicatorFactory
from ripples.worker.dataplane.outer_state import OuterState, outer_preduce
from ripples.worker.dataplane.preduce import preduce

T = TypeVar("T")
TIMEOUT = 60.0
LR, MU = 0.7, 0.9


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                               torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _local_steps(model: torch.nn.Module, outer: OuterState | None, steps: int,
                 seed: int) -> None:
    """`steps` AdamW steps on data of its own (the inner optimizer, local as in DiLoCo)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 5, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if outer is not None:
            outer.take_anchor()
        optimizer.step()
        if outer is not None:
            outer.record_step()


def _in_group(size: int, work: Callable[[int, Communicator], T]) -> list[T]:
    """Run work(rank, communicator) in one thread per member of a real gloo group."""
    store = dist.HashStore()
    key = f"outer/{uuid.uuid4().hex[:8]}"
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            factory = CommunicatorFactory(store, torch.device("cpu"), TIMEOUT,
                                          gloo_hostname="127.0.0.1")
            results[rank] = work(rank, factory.build(key, rank, size, peers_within=TIMEOUT))
        except BaseException as err:  # reported below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a member did not finish its collective"
    assert not errors, errors
    return [results[r] for r in range(size)]


def _params(state: AveragedState) -> torch.Tensor:
    return state.flat[: sum(p.numel() for p in state.params)].clone()


def _diloco_reference(anchor: torch.Tensor, momentum: torch.Tensor,
                      models: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """DiLoCo's outer step, written from the formulas above: (new φ, new m)."""
    delta = torch.stack([anchor - x for x in models]).mean(0)
    new_momentum = MU * momentum + delta
    return anchor - LR * (delta + MU * new_momentum), new_momentum


def _torch_nesterov(anchor: torch.Tensor, momentum: torch.Tensor,
                    delta: torch.Tensor) -> torch.Tensor:
    """The same step by torch.optim.SGD(nesterov=True) (torchft's DiLoCo outer optimizer)."""
    p = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([p], lr=LR, momentum=MU, nesterov=True)
    sgd.state[p]["momentum_buffer"] = momentum.clone()  # the outer state so far
    p.grad = delta.clone()
    sgd.step()
    return p.detach()


def _synced_once(seed: int, compression: str = "none"
                 ) -> tuple[torch.nn.Module, AveragedState, OuterState]:
    """A worker that has been through one synchronisation already: a non-zero momentum,
    its anchor where the model is (the same for every call with one seed)."""
    model = _model(seed)
    state = AveragedState(model)
    outer = OuterState(state, lr=LR, momentum=MU, compression=compression)
    with torch.no_grad():
        outer.momentum.copy_(torch.linspace(-0.01, 0.02, outer.numel))
    return model, state, outer


def _close(actual: torch.Tensor, expected: torch.Tensor, compression: str,
           scale: torch.Tensor) -> None:
    """Equal up to float32 rounding, or with bf16 up to its rounding of values of about
    `scale`'s size (8 bits of mantissa: within 2^-8 of each, a few times over)."""
    if compression == "none":
        torch.testing.assert_close(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=0,
                                   atol=float(scale.abs().max()) * 2**-6)


@pytest.mark.parametrize("compression", ["none", "bf16"])
@pytest.mark.parametrize("same_anchor", [False, True], ids=["group-form", "same-anchor"])
def test_a_group_of_every_worker_takes_dilocos_outer_step(same_anchor: bool,
                                                          compression: str) -> None:
    workers = [_synced_once(0, compression) for _ in range(3)]
    anchor, momentum = workers[0][2].anchor.clone(), workers[0][2].momentum.clone()
    for rank, (model, _, outer) in enumerate(workers):
        _local_steps(model, outer, 4, seed=rank)
    models = [_params(state) for _, state, _ in workers]
    buffers = torch.stack([state.flat[outer.numel:] for _, state, outer in workers]).mean(0)
    expected_anchor, expected_momentum = _diloco_reference(anchor, momentum, models)
    delta = torch.stack([anchor - x for x in models]).mean(0)
    torch.testing.assert_close(_torch_nesterov(anchor, momentum, delta), expected_anchor)

    def sync(rank: int, comm: Communicator) -> tuple[str, bytes]:
        outer = workers[rank][2]
        outer_preduce(outer, comm, TIMEOUT, same_anchor=same_anchor)
        return workers[rank][1].fingerprint(), outer.momentum.numpy().tobytes()

    assert len(set(_in_group(3, sync))) == 1  # compressed or not: bit for bit
    for _, state, outer in workers:
        _close(outer.anchor - anchor, expected_anchor - anchor, compression, delta)
        _close(outer.momentum, expected_momentum, compression, expected_momentum)
        assert torch.equal(_params(state), outer.anchor)  # x ← φ
        torch.testing.assert_close(state.flat[outer.numel:], buffers)  # BatchNorm: averaged
        assert outer.steps_since_sync == 0


def test_one_local_step_with_lr_1_and_no_momentum_is_plain_averaging() -> None:
    """H = 1, η = 1, μ = 0: φ̂ = φ − (φ − x) = x, so the outer sync is P-Reduce, whatever
    the members' anchors (here each its own)."""
    outers, plain = [], []
    for rank in range(3):
        model = _model(rank)
        outer = OuterState(AveragedState(model), lr=1.0, momentum=0.0)
        _local_steps(model, outer, 1, seed=10 + rank)
        outers.append(outer)
        twin = _model(rank)
        twin.load_state_dict(model.state_dict())
        plain.append(AveragedState(twin))

    def sync(rank: int, comm: Communicator) -> None:
        outer_preduce(outers[rank], comm, TIMEOUT)
        preduce(plain[rank], comm, TIMEOUT)

    _in_group(3, sync)
    for outer, averaged in zip(outers, plain, strict=True):
        torch.testing.assert_close(outer.state.flat, averaged.flat, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_members_with_different_anchors_leave_bit_identical_and_apply_momentum_once(
        compression: str) -> None:
    """Groups mix workers from different synchronisations: each member steps from its own
    anchor and momentum, and all leave with the same model, anchor and momentum (the mean
    of the provisional steps). A member with no local step since its last sync (a second
    group in one round) contributes its anchor and momentum unchanged. With bf16 the
    momentum travels in bfloat16 and the anchors in float32."""
    workers = [_synced_once(seed, compression) for seed in range(3)]
    for rank, (model, _, outer) in enumerate(workers[:2]):
        _local_steps(model, outer, 3, seed=20 + rank)
        with torch.no_grad():
            outer.momentum.mul_(rank + 1.5)
    idle = workers[2][2]
    assert idle.steps_since_sync == 0
    provisional = []
    for _, state, outer in workers[:2]:  # the formula, member by member
        delta = outer.anchor - _params(state)
        m_hat = MU * outer.momentum + delta
        provisional.append((outer.anchor - LR * (delta + MU * m_hat), m_hat))
    provisional.append((idle.anchor.clone(), idle.momentum.clone()))
    expected_anchor = torch.stack([a for a, _ in provisional]).mean(0)
    expected_momentum = torch.stack([m for _, m in provisional]).mean(0)

    def sync(rank: int, comm: Communicator) -> tuple[str, bytes, bytes]:
        _, state, outer = workers[rank]
        outer_preduce(outer, comm, TIMEOUT)
        return (state.fingerprint(), outer.anchor.numpy().tobytes(),
                outer.momentum.numpy().tobytes())

    digests = _in_group(3, sync)
    assert len(set(digests)) == 1  # model, anchor and momentum: bit for bit
    for _, _, outer in workers:
        torch.testing.assert_close(outer.anchor, expected_anchor)  # float32 either way
        _close(outer.momentum, expected_momentum, compression, expected_momentum)


@pytest.mark.parametrize(("compression", "same_anchor"),
                         [("none", False), ("bf16", False), ("bf16", True)])
def test_an_abandoned_sync_leaves_model_anchor_and_momentum_as_they_were(
        compression: str, same_anchor: bool) -> None:
    model, state, outer = _synced_once(0, compression)
    _local_steps(model, outer, 2, seed=3)
    before = (state.flat.clone(), outer.anchor.clone(), outer.momentum.clone())
    staged = outer.stage(0.5, same_anchor=same_anchor)
    assert len(staged) == (2 if compression == "bf16" else 1)
    for buffer in staged:  # a failed collective may still write into its buffers
        buffer.fill_(float("nan"))
    outer.abandon()
    assert torch.equal(state.flat, before[0]) and torch.equal(outer.anchor, before[1])
    assert torch.equal(outer.momentum, before[2]) and outer.steps_since_sync == 2
    again = outer.stage(0.5, same_anchor=same_anchor)
    assert {t.data_ptr() for t in again}.isdisjoint(t.data_ptr() for t in staged)  # fresh


def test_bf16_error_feedback_loses_no_progress_over_many_syncs() -> None:
    """Alone in its group with η = 1, μ = 0 the same-anchor sync moves the anchor by the
    bf16 Δ it sent; what rounding took off is the residual e, owed with the next Δ. The
    model the run would have without rounding is the anchor minus e, and it moves by
    exactly each round's progress (up to float32 rounding), however many syncs: nothing
    is lost, while the anchor alone is off by at most one round's rounding."""
    model = _model(0)
    state = AveragedState(model)
    outer = OuterState(state, lr=1.0, momentum=0.0, compression="bf16")
    owed = torch.zeros(outer.numel)
    exact = _params(state)  # the model without rounding: every round's progress, summed
    for round_ in range(12):
        _local_steps(model, outer, 3, seed=40 + round_)
        delta = outer.anchor - _params(state)
        exact -= delta
        _in_group(1, lambda _rank, comm: outer_preduce(outer, comm, TIMEOUT, same_anchor=True))
        residual = outer.residual
        assert residual is not None
        assert residual.abs().max() <= (delta + owed).abs().max() * 2**-8
        owed = residual
        torch.testing.assert_close(outer.anchor - owed, exact, rtol=0, atol=1e-5)
        assert owed.abs().max() > 0  # bf16 did round: the test sees it
        assert torch.equal(_params(state), outer.anchor)
    outer.load_state_dict(outer.state_dict())  # a restore: the residual is not in it
    assert outer.residual is None


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_what_a_member_sends_is_its_group_bytes(compression: str) -> None:
    """The group form: [φ̂ | rest] in float32 and m̂ in float32 or bfloat16, or (outer
    momentum 0, where m never counts) no m̂ at all; the same-anchor form Δ in place of
    φ̂ and no m̂. The non-finite flag is one element more: float32 with the rest, or
    bfloat16 after a compressed Δ."""
    for momentum in (MU, 0.0):
        model = _model(0)
        state = AveragedState(model)
        outer = OuterState(state, lr=LR, momentum=momentum, compression=compression)
        _local_steps(model, outer, 2, seed=1)
        sent = sum(t.numel() * t.element_size() for t in outer.stage(0.5))
        outer.abandon()
        m_bytes = 0 if momentum == 0 else outer.numel * (2 if compression == "bf16" else 4)
        assert sent == outer.sent_bytes() == state.size_bytes + 4 + m_bytes
        same = outer.stage(0.5, same_anchor=True)
        assert sum(t.numel() * t.element_size() for t in same) == outer.sent_bytes(
            same_anchor=True) == state.size_bytes - (
            outer.numel * 2 - 2 if compression == "bf16" else -4)
        outer.abandon()


def test_the_outer_state_survives_a_state_dict_round_trip() -> None:
    """A worker restored from its checkpoint synchronises to the same bits as the worker
    that saved it would have."""
    model, state, outer = _synced_once(0)
    _local_steps(model, outer, 3, seed=5)
    twin = _model(9)
    twin.load_state_dict(model.state_dict())
    restored = OuterState(AveragedState(twin), lr=LR, momentum=MU)
    restored.load_state_dict(outer.state_dict())
    assert restored.steps_since_sync == 3
    for each in (outer, restored):  # each alone in a group of one: its own state only
        _in_group(1, lambda _rank, comm, each=each: outer_preduce(each, comm, TIMEOUT))
    assert torch.equal(outer.state.flat, restored.state.flat)
    assert torch.equal(outer.anchor, restored.anchor)
    assert torch.equal(outer.momentum, restored.momentum)


def test_another_outer_lr_on_resume_is_used_with_a_warning_and_another_model_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    _, _, outer = _synced_once(0)
    saved = outer.state_dict()
    assert saved["anchor"].device.type == "cpu" and saved["anchor"] is not outer.anchor
    other = OuterState(AveragedState(_model(0)), lr=0.5, momentum=MU)
    other.load_state_dict(saved)  # as a learning rate may change on resume
    assert other.lr == 0.5 and torch.equal(other.anchor, outer.anchor)
    assert "had outer_lr 0.7, this run has 0.5" in caplog.text
    wider = OuterState(AveragedState(torch.nn.Linear(5, 9)), lr=LR, momentum=MU)
    with pytest.raises(ValueError, match="outer anchor has shape .* not this model"):
        wider.load_state_dict(saved)


def test_the_anchor_is_the_model_the_first_step_finds_not_the_one_wrapped() -> None:
    """Weights loaded after the outer state was built (pretrained weights, a script's own
    resume) are the anchor: the first pseudo-gradient is the first round's progress only."""
    model = _model(0)
    outer = OuterState(AveragedState(model), lr=LR, momentum=MU)
    model.load_state_dict(_model(7).state_dict())  # after wrapping
    loaded = _params(outer.state)
    _local_steps(model, outer, 1, seed=1)
    assert torch.equal(outer.anchor, loaded)
    outer.restart_from_model()  # a checkpoint without outer state: anchor at the next step
    model.load_state_dict(_model(8).state_dict())
    _local_steps(model, outer, 1, seed=2)
    assert torch.equal(outer.anchor, _params(AveragedState(_model(8))))
    assert not outer.in_agreement and torch.count_nonzero(outer.momentum) == 0


def test_a_same_anchor_sync_with_no_step_since_the_last_applies_no_momentum() -> None:
    model, state, outer = _synced_once(0)
    outer.take_anchor()
    before = (outer.anchor.clone(), outer.momentum.clone())
    _in_group(1, lambda _rank, comm: outer_preduce(outer, comm, TIMEOUT, same_anchor=True))
    assert torch.equal(outer.anchor, before[0]) and torch.equal(outer.momentum, before[1])
    assert torch.equal(_params(state), before[0])


def test_a_joiner_heals_to_the_donors_anchor_and_momentum_not_its_model_mid_round() -> None:
    """The donor's steps since its last sync stay in the donor's next pseudo-gradient
    only: the joiner's model becomes the donor's anchor."""
    donor_model, donor_state, donor = _synced_once(0)
    _local_steps(donor_model, donor, 3, seed=4)
    expected = (donor.anchor.clone(), donor.momentum.clone(), _params(donor_state))
    joiner_model = _model(5)
    joiner_state = AveragedState(joiner_model)
    joiner = OuterState(joiner_state, lr=LR, momentum=MU)
    with torch.no_grad():
        donor_state.flat[outer_numel(donor):donor_state.model_numel].add_(1.0)  # buffers
    buffers = donor_state.flat[donor.numel:donor_state.model_numel].clone()
    members = [donor, joiner]
    _in_group(2, lambda rank, comm: members[rank].heal(
        comm, 0, members[rank].state.model_numel, TIMEOUT))
    assert torch.equal(joiner.anchor, expected[0]) and torch.equal(joiner.momentum, expected[1])
    assert torch.equal(_params(joiner_state), expected[0])
    assert torch.equal(joiner_state.flat[joiner.numel:joiner_state.model_numel], buffers)
    assert joiner.anchored and joiner.steps_since_sync == 0
    assert torch.equal(donor.anchor, expected[0]) and torch.equal(_params(donor_state), expected[2])
    assert donor.steps_since_sync == 3


def outer_numel(outer: OuterState) -> int:
    return outer.numel


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_a_gossip_exchange_spends_the_active_sides_progress_and_keeps_the_partners(
        compression: str) -> None:
    """On snapshots (the gossip thread never writes the model): the side that owes the
    exchange takes its provisional step; the partner picked mid-round contributes its
    anchor and momentum unchanged and keeps its progress (its model moves with the
    anchor). Both leave with one anchor and momentum; the deltas are what the models
    take at their next step boundary."""
    workers = [_synced_once(seed, compression) for seed in range(2)]
    for rank, (model, _, outer) in enumerate(workers):
        _local_steps(model, outer, 2 + rank, seed=30 + rank)
    seen = [state.flat.clone() for _, state, _ in workers]
    before = [(outer.anchor.clone(), outer.momentum.clone()) for _, _, outer in workers]
    n = workers[0][2].numel
    anchor0, momentum0 = before[0]
    delta0 = anchor0 - seen[0][:n]
    m_hat = MU * momentum0 + delta0
    expected_anchor = (anchor0 - LR * (delta0 + MU * m_hat) + before[1][0]) / 2
    expected_momentum = (m_hat + before[1][1]) / 2
    deltas = _in_group(2, lambda rank, comm: workers[rank][2].exchange(
        seen[rank], comm, TIMEOUT, spend=rank == 0))
    for *_, outer in workers:
        torch.testing.assert_close(outer.anchor, expected_anchor)
        _close(outer.momentum, expected_momentum, compression, expected_momentum)
    assert torch.equal(workers[0][2].anchor, workers[1][2].anchor)
    assert torch.equal(workers[0][2].momentum, workers[1][2].momentum)
    # The spender's model becomes the new anchor; the partner's moves with its anchor.
    torch.testing.assert_close(seen[0][:n] + deltas[0][:n], expected_anchor)
    torch.testing.assert_close(deltas[1][:n], expected_anchor - before[1][0])
    buffers = (seen[0][n:] + seen[1][n:]) / 2
    for rank in range(2):
        torch.testing.assert_close(seen[rank][n:] + deltas[rank][n:], buffers)
        assert torch.equal(workers[rank][1].flat, seen[rank])  # the model is not written


@pytest.mark.parametrize("compression", ["none", "bf16"])
@pytest.mark.parametrize("same_anchor", [False, True])
def test_a_member_with_a_nan_voids_the_outer_step_for_every_member(
        compression: str, same_anchor: bool) -> None:
    """The non-finite flag rides the synchronisation (the float32 buffer, or after the
    bfloat16 Δ): where a member's model holds a NaN, every member keeps its model,
    anchor, momentum and error-feedback residual, bit for bit."""

    def member(rank: int, comm: Communicator) -> list[torch.Tensor | None]:
        model = _model(0)  # equal starts: the same-anchor form needs equal anchors
        state = AveragedState(model)
        outer = OuterState(state, lr=LR, momentum=MU, compression=compression)
        _local_steps(model, outer, 3, seed=rank)
        outer_preduce(outer, comm, TIMEOUT)  # group form: now in agreement
        _local_steps(model, outer, 3, seed=10 + rank)
        if same_anchor:  # a residual to keep: one compressed Δ sent already
            outer_preduce(outer, comm, TIMEOUT, same_anchor=True)
            _local_steps(model, outer, 3, seed=20 + rank)
        if rank == 1:
            with torch.no_grad():
                state.flat[2] = float("nan")
        before = [state.flat.clone(), outer.anchor.clone(), outer.momentum.clone(),
                  None if outer.residual is None else outer.residual.clone()]
        outer_preduce(outer, comm, TIMEOUT, same_anchor=same_anchor)
        after = [state.flat, outer.anchor, outer.momentum, outer.residual]
        for old, new in zip(before, after, strict=True):
            assert (old is None) == (new is None)
            if old is not None:
                torch.testing.assert_close(new, old, rtol=0, atol=0, equal_nan=True)
        return [bool(torch.isfinite(state.flat).all())]

    assert _in_group(2, member) == [[True], [False]]
