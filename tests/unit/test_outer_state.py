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
from ripples.worker.dataplane.outer_state import OuterState
from ripples.worker.dataplane.preduce import outer_preduce, preduce

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


def _synced_once(seed: int) -> tuple[torch.nn.Module, AveragedState, OuterState]:
    """A worker that has been through one synchronisation already: a non-zero momentum,
    its anchor where the model is (the same for every call with one seed)."""
    model = _model(seed)
    state = AveragedState(model)
    outer = OuterState(state, lr=LR, momentum=MU)
    with torch.no_grad():
        outer.momentum.copy_(torch.linspace(-0.01, 0.02, outer.numel))
    return model, state, outer


@pytest.mark.parametrize("same_anchor", [False, True], ids=["group-form", "same-anchor"])
def test_a_group_of_every_worker_takes_dilocos_outer_step(same_anchor: bool) -> None:
    workers = [_synced_once(0) for _ in range(3)]
    anchor, momentum = workers[0][2].anchor.clone(), workers[0][2].momentum.clone()
    for rank, (model, _, outer) in enumerate(workers):
        _local_steps(model, outer, 4, seed=rank)
    models = [_params(state) for _, state, _ in workers]
    buffers = torch.stack([state.flat[outer.numel:] for _, state, outer in workers]).mean(0)
    expected_anchor, expected_momentum = _diloco_reference(anchor, momentum, models)
    delta = torch.stack([anchor - x for x in models]).mean(0)
    torch.testing.assert_close(_torch_nesterov(anchor, momentum, delta), expected_anchor)

    def sync(rank: int, comm: Communicator) -> None:
        outer_preduce(workers[rank][2], comm, TIMEOUT, same_anchor=same_anchor)

    _in_group(3, sync)
    for _, state, outer in workers:
        torch.testing.assert_close(outer.anchor, expected_anchor)
        torch.testing.assert_close(outer.momentum, expected_momentum)
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


def test_members_with_different_anchors_leave_bit_identical_and_apply_momentum_once() -> None:
    """Groups mix workers from different synchronisations: each member steps from its own
    anchor and momentum, and all leave with the same model, anchor and momentum (the mean
    of the provisional steps). A member with no local step since its last sync (a second
    group in one round) contributes its anchor and momentum unchanged."""
    workers = [_synced_once(seed) for seed in range(3)]
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
        torch.testing.assert_close(outer.anchor, expected_anchor)
        torch.testing.assert_close(outer.momentum, expected_momentum)


def test_an_abandoned_sync_leaves_model_anchor_and_momentum_as_they_were() -> None:
    model, state, outer = _synced_once(0)
    _local_steps(model, outer, 2, seed=3)
    before = (state.flat.clone(), outer.anchor.clone(), outer.momentum.clone())
    staged = outer.stage(0.5)
    staged.fill_(float("nan"))  # a failed collective may still write into its buffer
    outer.abandon()
    assert torch.equal(state.flat, before[0]) and torch.equal(outer.anchor, before[1])
    assert torch.equal(outer.momentum, before[2]) and outer.steps_since_sync == 2
    assert outer.stage(0.5).data_ptr() != staged.data_ptr()  # a fresh staging buffer


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


def test_a_checkpoint_of_another_outer_step_or_model_is_refused_naming_it() -> None:
    _, _, outer = _synced_once(0)
    saved = outer.state_dict()
    other = OuterState(AveragedState(_model(0)), lr=0.5, momentum=MU)
    with pytest.raises(ValueError, match="outer_lr 0.7, this run 0.5: resume with --outer-lr 0.7"):
        other.load_state_dict(saved)
    wider = OuterState(AveragedState(torch.nn.Linear(5, 9)), lr=LR, momentum=MU)
    with pytest.raises(ValueError, match="outer anchor has shape .* not this model"):
        wider.load_state_dict(saved)
