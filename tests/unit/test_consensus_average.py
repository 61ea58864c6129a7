"""The consensus model's average, made one model at a time (ripples/consensus.py): the
same average and consensus distance as averaging them all at once, each tensor in its
dtype, non-floating tensors from the first model."""

from __future__ import annotations

import pytest
import torch

from ripples.consensus import RunningAverage, average_state_dicts, encode_model


def _all_at_once(models: list[dict[str, torch.Tensor]], names: set[str]
                 ) -> tuple[dict[str, torch.Tensor], float]:
    """The reference: every model stacked, averaged in float64."""
    average, squared = {}, 0.0
    for name, tensor in models[0].items():
        if not tensor.is_floating_point():
            average[name] = tensor
            continue
        stacked = torch.stack([m[name].double() for m in models])
        mean = stacked.mean(dim=0)
        if name in names:
            squared += float(((stacked - mean) ** 2).sum())
        average[name] = mean.to(tensor.dtype)
    return average, squared / len(models)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g).half(),
            "steps": torch.tensor(seed, dtype=torch.int64)}


def test_the_running_average_equals_the_average_of_all_at_once() -> None:
    models = [_model(s) for s in range(5)]
    average = RunningAverage()
    for i, m in enumerate(models):
        average.add(encode_model(100 + i, m))
    expected, distance = _all_at_once(models, {"w", "b"})
    result = average.state_dict()
    assert result.keys() == expected.keys()
    for name, tensor in expected.items():
        assert result[name].dtype == tensor.dtype
        torch.testing.assert_close(result[name], tensor)
    assert result["steps"].item() == 0  # the first model's counter
    assert average.consensus_distance == pytest.approx(distance, rel=1e-9)
    assert average.iterations == [100, 101, 102, 103, 104]


def test_models_of_another_shape_are_refused_and_nothing_is_no_average() -> None:
    average = RunningAverage()
    with pytest.raises(ValueError, match="no model"):
        average.state_dict()
    average.add(encode_model(1, _model(0)))
    other = _model(1)
    other["w"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="differ"):
        average.add(encode_model(2, other))
    assert average.consensus_distance == 0.0 and average.iterations == [1]


def test_the_distance_can_be_over_some_tensors_only() -> None:
    models = [_model(s) for s in range(3)]
    expected, distance = _all_at_once(models, {"w"})
    average, measured = average_state_dicts(models, distance_over={"w"})
    for name, tensor in expected.items():
        torch.testing.assert_close(average[name], tensor)
    assert measured == pytest.approx(distance, rel=1e-9)
