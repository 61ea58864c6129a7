"""The int8 wire of a group's outer synchronisation (worker/dataplane/modular_wire.py):
the anchors' low bits travel, every member decodes the same integers and leaves with the
same bits, within half a step of the float average; a block whose members disagree past
the width is caught by its checksum and kept by every member; a NaN voids everything.
Real gloo groups (threads of this process), as in test_outer_state.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ripples.coordinator.config import RunSettings
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.dataplane.modular_wire import (
    BASE_WIDTH,
    BLOCK,
    LEVELS,
    RELATIVE_FLOOR,
    WIDEN,
    checksum_weights,
    payload_layout,
    sent_bytes,
)
from ripples.worker.dataplane.outer_state import OuterState, outer_preduce
from tests.unit.test_outer_state import _in_group, _local_steps, _model

TIMEOUT = 60.0
LR, MU = 0.7, 0.9


def _big_model() -> torch.nn.Module:
    """Several blocks of 128 parameters, and BatchNorm buffers (the rest)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 40), torch.nn.BatchNorm1d(40),
                               torch.nn.ReLU(), torch.nn.Linear(40, 3))


def _models(build: Callable[[], torch.nn.Module], size: int) -> list[torch.nn.Module]:
    """One model per member, built here before the members' threads start: torch's
    global generator, which seeds them, is shared by every thread, and members seeding it
    side by side would start from different models."""
    return [build() for _ in range(size)]


def _int8_member(model: torch.nn.Module, steps: int, seed: int
                 ) -> tuple[AveragedState, OuterState]:
    """A member's state and int8 outer state over `model`, after `steps` local steps."""
    state = AveragedState(model)
    outer = OuterState(state, lr=LR, momentum=MU, compression="int8")
    _local_steps(model, outer, steps, seed=seed)
    return state, outer


def _provisional(outer: OuterState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This member's φ̂ and m̂ as the synchronisation will stage them, and the bound of
    its proposed width's step (its largest |φ̂ − φ| + |φ − x|), computed on copies."""
    flat = outer.state.flat[: outer.numel]
    anchor_hat = outer.anchor - flat
    moment = torch.empty_like(anchor_hat)
    outer.provisional_step(anchor_hat, moment, spend=outer.steps_since_sync > 0)
    step = ((anchor_hat - outer.anchor).abs() + (outer.anchor - flat).abs()).max()
    return anchor_hat, moment, step


def test_members_leave_with_the_same_bits_within_half_a_step_of_the_float_average() -> None:
    """Members whose anchors differ (each took its own steps from its own model): after
    one synchronisation every member holds the same anchor and model, bit for bit, each
    within s/2 of the mean of the provisional anchors, and its own provisional momentum;
    the rest (BatchNorm's buffers) is averaged in float32."""

    models = _models(_big_model, 3)

    def member(rank: int, comm: Communicator) -> list[torch.Tensor]:
        model = models[rank]
        with torch.no_grad():  # different anchors: a model of its own
            for p in model.parameters():
                p.add_(0.01 * (rank + 1))
        state, outer = _int8_member(model, 3, seed=rank)
        anchor_hat, moment, step = _provisional(outer)
        rest = state.flat[outer.numel :].clone()
        outer_preduce(outer, comm, TIMEOUT)
        assert outer.modular is not None and int(outer.modular.voided_blocks) == 0
        assert torch.equal(outer.state.flat[: outer.numel], outer.anchor)
        assert torch.equal(outer.momentum, moment)
        assert outer.steps_since_sync == 0
        return [outer.anchor.clone(), anchor_hat, step.reshape(1), rest,
                state.flat[outer.numel :].clone()]

    results = _in_group(3, member)
    anchors = [r[0] for r in results]
    assert all(torch.equal(anchors[0], a) for a in anchors[1:])
    mean = torch.stack([r[1] for r in results]).mean(dim=0)
    largest = max(float(r[1].abs().max()) for r in results)
    # The agreed width is at most the largest proposal: its step, or the floor.
    width = max(BASE_WIDTH * float(r[2]) for r in results) + RELATIVE_FLOOR * largest
    assert float((anchors[0] - mean).abs().max()) <= width / LEVELS / 2 * (1 + 1e-4)
    assert float((anchors[0] - mean).abs().max()) > 0  # it did round: the test sees it
    rest = torch.stack([r[3] for r in results]).mean(dim=0)
    for r in results:
        torch.testing.assert_close(r[4], rest, rtol=1e-6, atol=1e-7)


def test_a_block_whose_members_disagree_past_the_width_is_kept_by_every_member() -> None:
    """One member's anchor and model lie 10 away in the second block only (its steps
    are far smaller, and so its proposed width): its decode is wrong somewhere, the
    checksum says so, and every member keeps its own anchor, model and momentum in that
    block, averages the others, and widens."""
    second = slice(BLOCK, 2 * BLOCK)

    models = _models(_big_model, 2)

    def member(rank: int, comm: Communicator) -> list[torch.Tensor]:
        model = models[rank]
        state, outer = _int8_member(model, 2, seed=rank)
        if rank == 1:
            with torch.no_grad():
                outer.anchor[second] += 10.0
                state.flat[second] += 10.0
        before = [state.flat[: outer.numel].clone(), outer.anchor.clone(),
                  outer.momentum.clone()]
        outer_preduce(outer, comm, TIMEOUT)
        wire = outer.modular
        assert wire is not None
        assert int(wire.voided_blocks) == 1
        assert float(wire.width) == BASE_WIDTH * WIDEN
        for old, new in zip(before, [state.flat[: outer.numel], outer.anchor,
                                     outer.momentum], strict=True):
            assert torch.equal(old[second], new[second])
        assert not torch.equal(before[1][:BLOCK], outer.anchor[:BLOCK])  # averaged
        return [outer.anchor.clone()]

    a, b = (r[0] for r in _in_group(2, member))
    assert torch.equal(a[:BLOCK], b[:BLOCK]) and torch.equal(a[2 * BLOCK :], b[2 * BLOCK :])
    assert float((a[second] - b[second]).abs().min()) > 9  # each kept its own


def test_a_member_with_a_nan_voids_the_synchronisation_for_every_member() -> None:
    """The non-finite flag travels with the rest: where a member's model holds a NaN,
    every member keeps its model, anchor, momentum and width, bit for bit."""

    models = _models(lambda: _model(0), 2)

    def member(rank: int, comm: Communicator) -> bool:
        model = models[rank]
        state, outer = _int8_member(model, 3, seed=rank)
        if rank == 1:
            with torch.no_grad():
                state.flat[2] = float("nan")
        before = [state.flat.clone(), outer.anchor.clone(), outer.momentum.clone()]
        outer_preduce(outer, comm, TIMEOUT)
        for old, new in zip(before, [state.flat, outer.anchor, outer.momentum], strict=True):
            torch.testing.assert_close(new, old, rtol=0, atol=0, equal_nan=True)
        assert outer.modular is not None
        assert float(outer.modular.width) == BASE_WIDTH
        assert int(outer.modular.voided_blocks) == 0
        return bool(torch.isfinite(state.flat).all())

    assert _in_group(2, member) == [True, False]


def test_what_a_member_sends_is_its_group_bytes_about_one_byte_a_parameter() -> None:
    model = _big_model()
    state = AveragedState(model)
    outer = OuterState(state, lr=LR, momentum=MU, compression="int8")
    blocks = -(-outer.numel // BLOCK)
    rest = state.flat.numel() - outer.numel
    payload = sum(size for _, size in payload_layout(outer.numel, (rest + 1) * 4))
    assert payload == blocks * 8 + -(-(rest + 1) * 4 // 8) * 8 + blocks * BLOCK
    assert outer.sent_bytes() == payload + blocks * 4 + blocks
    assert sent_bytes(1_000_000, 0, 4) < 1.11 * 1_000_000  # a byte, a checksum per block
    with pytest.raises(ValueError, match="modular_preduce"):
        outer.stage(0.5)


def test_the_checksum_weights_are_distinct() -> None:
    weights = checksum_weights(torch.device("cpu"))
    assert weights.numel() == BLOCK and weights.unique().numel() == BLOCK
    assert int(weights.min()) >= 1 and int(weights.max()) < 2 ** 20


@pytest.mark.parametrize("options, expected", [
    ({"protocol": "allreduce"}, "int8 is for the groups of ripples-smart, ripples-random "
     "and ripples-static, not allreduce: it travels in an all-gather"),
    ({"protocol": "adpsgd"}, "not adpsgd: .* a gossip exchange has no int8 wire"),
])
def test_int8_is_refused_where_it_has_no_wire_or_would_not_pay(
        options: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        RunSettings.build(task="digits", num_workers=4, local_steps=4,
                          outer_optimizer="nesterov", outer_compression="int8", **options)
    for protocol in ("ripples-smart", "ripples-random", "ripples-static"):
        RunSettings.build(protocol=protocol, task="digits", num_workers=4, local_steps=4,
                          outer_optimizer="nesterov", outer_compression="int8")
    RunSettings.build(protocol="ripples-smart", task="digits", num_workers=4, local_steps=4,
                      outer_optimizer="nesterov", outer_compression="int8", overlap=True)
