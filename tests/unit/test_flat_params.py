"""The flat parameter buffer: views, staging, and the optimizer state it can adopt."""

from __future__ import annotations

import copy

import pytest
import torch

from ripples.worker.flat_params import FlatParameters


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= t.data_ptr() < start + flat.numel() * flat.element_size()


def test_adopted_momentum_lives_in_the_buffer_and_sgd_keeps_working_on_it() -> None:
    model = _model(0)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    flat = FlatParameters(model)
    num_params = flat.numel
    _step(model, opt, 1)
    _step(reference, ref_opt, 1)
    assert flat.adopt_optimizer_state(opt) == 4  # one momentum buffer per parameter
    assert flat.numel == 2 * num_params
    for p in model.parameters():
        assert _inside(p, flat.flat) and _inside(opt.state[p]["momentum_buffer"], flat.flat)
    for seed in (2, 3):  # later steps update the adopted views in place
        _step(model, opt, seed)
        _step(reference, ref_opt, seed)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"])
    with pytest.raises(RuntimeError, match="already adopted"):
        flat.adopt_optimizer_state(opt)


def test_an_average_through_the_staging_buffer_averages_parameters_and_momentum() -> None:
    models = [_model(seed) for seed in (0, 1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    flats = [FlatParameters(m) for m in models]
    for seed, (model, opt, flat) in enumerate(zip(models, opts, flats, strict=True)):
        _step(model, opt, seed)
        flat.adopt_optimizer_state(opt)
    expected = (flats[0].flat + flats[1].flat) / 2
    staged = [f.stage(0.5) for f in flats]
    total = staged[0] + staged[1]  # what the SUM collective leaves in every member
    for flat, buffer in zip(flats, staged, strict=True):
        buffer.copy_(total)
        flat.commit()
        torch.testing.assert_close(flat.flat, expected)
    for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p0, p1)
        torch.testing.assert_close(opts[0].state[p0]["momentum_buffer"],
                                   opts[1].state[p1]["momentum_buffer"])
    _step(models[0], opts[0], 7)  # the committed views train on
    assert not torch.equal(models[0][0].weight, models[1][0].weight)


def test_adam_moments_are_adopted_but_not_its_step_counter() -> None:
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    flat = FlatParameters(model)
    _step(model, opt, 1)
    assert flat.adopt_optimizer_state(opt) == 8  # exp_avg and exp_avg_sq per parameter
    for p in model.parameters():
        assert _inside(opt.state[p]["exp_avg_sq"], flat.flat)
        assert not _inside(opt.state[p]["step"], flat.flat)
    _step(model, opt, 2)
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


def test_an_optimizer_without_state_adopts_nothing() -> None:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = FlatParameters(model)
    size = flat.numel
    _step(model, opt, 1)
    assert flat.adopt_optimizer_state(opt) == 0 and flat.numel == size
