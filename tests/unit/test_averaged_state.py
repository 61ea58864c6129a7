"""The averaged state's flat buffer: parameters, float buffers, the optimizer state it
adopts, staging, the schema workers compare and the non-finite gate."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ripples.worker.dataplane.averaged_state import AveragedState


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
    flat = AveragedState(model)
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
    # load_state_dict replaces the optimizer's state tensors: adopting again moves the new
    # ones into the buffer, with their values.
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    assert not any(_inside(opt.state[p]["momentum_buffer"], flat.flat)
                   for p in model.parameters())
    assert flat.adopt_optimizer_state(opt) == 4
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert _inside(opt.state[p]["momentum_buffer"], flat.flat)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"])


def test_an_average_through_the_staging_buffer_averages_parameters_and_momentum() -> None:
    models = [_model(seed) for seed in (0, 1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    flats = [AveragedState(m) for m in models]
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
    flat = AveragedState(model)
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
    flat = AveragedState(model)
    size = flat.numel
    _step(model, opt, 1)
    assert flat.adopt_optimizer_state(opt) == 0 and flat.numel == size


def _bn_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                               torch.nn.Linear(6, 2))


def test_float_buffers_are_averaged_with_the_parameters_and_keep_updating() -> None:
    model = _bn_model(0)
    state = AveragedState(model)
    bn = model[1]
    assert [n for n in state.names if n.startswith("buffer:")] == [
        "buffer:1.running_mean", "buffer:1.running_var"]  # not num_batches_tracked (int)
    assert _inside(bn.running_mean, state.flat) and _inside(bn.running_var, state.flat)
    before = bn.running_mean.clone()
    model(torch.randn(16, 4) + 3.0)  # a training forward updates the statistics in place
    assert not torch.equal(bn.running_mean, before) and _inside(bn.running_mean, state.flat)
    other = _bn_model(0)
    other_state = AveragedState(other)
    other(torch.randn(16, 4) - 3.0)
    staged = [state.stage(0.5), other_state.stage(0.5)]
    total = staged[0] + staged[1]
    for s, buffer in zip((state, other_state), staged, strict=True):
        buffer.copy_(total)
        s.commit()
    torch.testing.assert_close(bn.running_mean, other[1].running_mean)
    assert _inside(bn.running_mean, state.flat)


def test_the_schema_names_every_averaged_tensor_in_buffer_order() -> None:
    model = _bn_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = AveragedState(model)
    schema = state.schema()
    assert [t.name for t in schema.tensors] == [
        "param:0.weight", "param:0.bias", "param:1.weight", "param:1.bias", "param:3.weight",
        "param:3.bias", "buffer:1.running_mean", "buffer:1.running_var"]
    assert list(schema.tensors[0].shape) == [6, 4] and schema.tensors[0].dtype == "float32"
    assert AveragedState(_bn_model(5)).schema().digest == schema.digest  # values do not count
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    state.adopt_optimizer_state(opt)
    names = [t.name for t in state.schema().tensors]
    assert names[8:] == [f"state:{n}.momentum_buffer" for n in
                         ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias")]
    assert state.schema().digest != schema.digest


def test_the_gate_names_the_first_non_finite_tensor() -> None:
    model = _bn_model(0)
    state = AveragedState(model)
    assert state.nonfinite() is None
    with torch.no_grad():
        model[1].running_var[2] = float("inf")
    assert state.nonfinite() == "buffer:1.running_var"
    with torch.no_grad():
        model[0].bias[0] = float("nan")
    assert state.nonfinite() == "param:0.bias"


def test_mixed_dtypes_are_refused_with_what_to_do() -> None:
    model = _model(0)
    model[2].to(torch.float64)
    with pytest.raises(ValueError, match="must share one dtype and device.*model.to"):
        AveragedState(model)


def test_optimizer_state_is_complete_once_every_trainable_parameter_has_one() -> None:
    """State appears at a parameter's first applied step; a frozen parameter needs none."""
    model = _model(0)
    model[2].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    flat = AveragedState(model)
    assert flat.missing_optimizer_state(opt) == "0.weight"
    model[0].weight.grad = torch.zeros_like(model[0].weight)  # only one has a gradient
    opt.step()
    assert flat.missing_optimizer_state(opt) == "0.bias"
    _step(model, opt, 1)
    assert flat.missing_optimizer_state(opt) is None


def test_a_scalar_parameters_step_counter_is_not_averaged() -> None:
    """A 0-dim parameter's Adam step has its shape; it counts steps and stays out."""
    model = torch.nn.Module()
    model.scale = torch.nn.Parameter(torch.tensor(2.0))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    flat = AveragedState(model)
    (model.scale ** 2).backward()
    opt.step()
    assert flat.adopt_optimizer_state(opt) == 2  # exp_avg and exp_avg_sq only
    assert flat.optimizer_state_labels() == ["state:scale.exp_avg", "state:scale.exp_avg_sq"]
    assert not _inside(opt.state[model.scale]["step"], flat.flat)


def test_a_model_moved_after_wrapping_is_noticed() -> None:
    model = _model(0)
    flat = AveragedState(model)
    assert flat.moved_away() is None
    model.double()  # new storage for every parameter
    assert flat.moved_away() == "0.weight"


def test_the_fingerprint_tells_initial_models_apart_by_their_bytes() -> None:
    """What the start compares (Every worker starts from one model): equal for models
    built with one seed, different for a seed per rank or one ulp, blind to the
    optimizer state."""
    a, b, c = (AveragedState(_model(seed)) for seed in (0, 0, 1))
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    model = _model(0)
    state = AveragedState(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    _step(model, optimizer, 0)  # lr 0: the model stays, momentum appears
    state.adopt_optimizer_state(optimizer)
    assert state.fingerprint() == a.fingerprint()
    with torch.no_grad():
        b.flat[3] = torch.nextafter(b.flat[3], torch.tensor(math.inf))
    assert a.fingerprint() != b.fingerprint()
