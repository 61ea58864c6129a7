"""state_dicts that torch.save writes at their own size (ripples/state_dicts.py): a model
and an optimizer whose tensors are views into an averaged state's flat buffer, as in a
distributed run, save what a plain model and optimizer save, load back into the views,
and keep their live tensors where they are."""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch
from torch import nn

from ripples.state_dicts import (
    compact_on_cpu,
    compact_state_dicts,
    is_view_of_more,
    state_dict_views,
)
from ripples.worker.dataplane.averaged_state import AveragedState


class Net(nn.Module):
    """A BatchNorm (a float buffer, averaged, and an integer one, not) between linear
    layers; `tied`: two modules share one weight (as GPT-2's embedding and output)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 48, bias=False)
        self.norm = nn.BatchNorm1d(48)
        self.hidden = nn.Linear(48, 48)
        self.out = nn.Linear(48, 48, bias=False)
        if tied:
            self.out.weight = self.hidden.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.norm(self.embed(x)))))


def _trained(tied: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model after one Adam step (its state exists)."""
    torch.manual_seed(0)
    model = Net(tied)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    return model, opt


def _size(value: object) -> int:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return len(buffer.getvalue())


def _averaged(tied: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, AveragedState]:
    """A model and optimizer laid out as in a distributed run, with the hooks."""
    model, opt = _trained(tied)
    state = AveragedState(model)
    state.adopt_optimizer_state(opt)
    compact_state_dicts(model, opt)
    return model, opt, state


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_saves_are_the_size_of_a_plain_model_and_optimizer(tied: bool) -> None:
    model, opt, state = _averaged(tied)
    plain_model, plain_opt = _trained(tied)
    with state_dict_views():  # what torch.save wrote before: the whole buffer each time
        assert _size(model.state_dict()) > 2 * _size(plain_model.state_dict())
    for ours, plain in [(model.state_dict(), plain_model.state_dict()),
                        (opt.state_dict(), plain_opt.state_dict()),
                        ({"model": model.state_dict(), "optimizer": opt.state_dict()},
                         {"model": plain_model.state_dict(),
                          "optimizer": plain_opt.state_dict()})]:
        assert _size(ours) == pytest.approx(_size(plain), rel=0.02)
    assert state.numel > 0


def test_tied_weights_are_copied_once_per_call() -> None:
    model, _, _ = _averaged(tied=True)
    saved = model.state_dict()
    assert saved["out.weight"] is saved["hidden.weight"]
    assert not is_view_of_more(saved["out.weight"])


def test_the_live_tensors_stay_views_and_loading_writes_into_them() -> None:
    model, opt, state = _averaged()
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    assert all(not is_view_of_more(t) for t in saved_model.values())
    momenta = [s["exp_avg"] for s in opt.state.values()]
    assert all(is_view_of_more(m) for m in momenta)  # the optimizer's own state untouched
    assert state.moved_away() is None
    expected = {k: v.clone() for k, v in saved_model.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    assert state.moved_away() is None  # the parameters still live in the flat buffer
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_keep_vars_submodules_and_views_on_request() -> None:
    model, opt, _ = _averaged()
    kept = model.state_dict(keep_vars=True)
    assert kept["hidden.weight"] is model.hidden.weight
    assert not is_view_of_more(model.hidden.state_dict()["weight"])
    assert model.norm.state_dict()["num_batches_tracked"].dtype == torch.long
    with state_dict_views():
        assert is_view_of_more(model.state_dict()["hidden.weight"])
        assert any(is_view_of_more(v) for s in opt.state_dict()["state"].values()
                   for v in s.values())


def test_compact_on_cpu_copies_only_views_and_keeps_the_metadata() -> None:
    flat = torch.arange(10.0)
    own = torch.ones(3)
    state: OrderedDict[str, object] = OrderedDict(
        view=flat[2:5], own=own, nested=[(flat[:2], 7)])
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    copied = compact_on_cpu(state)
    assert copied._metadata == {"": {"version": 1}}
    assert torch.equal(copied["view"], flat[2:5]) and not is_view_of_more(copied["view"])
    assert copied["own"].data_ptr() == own.data_ptr()  # nothing to copy
    (pair,) = copied["nested"]
    assert isinstance(pair, tuple) and pair[1] == 7 and not is_view_of_more(pair[0])
