"""The consensus model's average, made by the client one published model at a time
(ripples/consensus.py): the same average and consensus distance as averaging them all at
once, each tensor in its dtype, non-floating tensors from the first model."""

from __future__ import annotations

import pytest
import torch

from ripples.consensus import RunningAverage, average_state_dicts, encode_model


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g).half(),
            "steps": torch.tensor(seed, dtype=torch.int64)}


def test_the_running_average_equals_the_average_of_all_at_once() -> None:
    models = [_model(s) for s in range(5)]
    average = RunningAverage()
    for i, m in enumerate(models):
        average.add(encode_model(100 + i, m))
    expected, distance = average_state_dicts(models)
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
