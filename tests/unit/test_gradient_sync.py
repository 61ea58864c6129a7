"""allreduce's switch for DDP's gradient-accumulation spellings, on a plain module: what
the forward pre-hook tells DDP (`apply`) under each spelling, and what it leaves alone.
(tests/integration/test_gradient_accumulation.py runs it under DDP with real workers.)"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ripples.protocols.allreduce.gradient_sync import GradientSyncSwitch


def _switched(model: nn.Module) -> tuple[GradientSyncSwitch, list[bool]]:
    told: list[bool] = []
    return GradientSyncSwitch(model, told.append), told


def _forward(model: nn.Module) -> None:
    model(torch.zeros(1, 2))


def test_each_spelling_skips_the_sync_of_the_forwards_it_covers() -> None:
    model = nn.Linear(2, 2)
    switch, told = _switched(model)
    assert model.require_backward_grad_sync is True  # as on a DDP wrapper
    _forward(model)
    model.require_backward_grad_sync = False
    _forward(model)
    model.require_backward_grad_sync = True
    with model.no_sync():  # type: ignore[operator]
        _forward(model)
        with switch.no_sync():  # opt.no_sync() inside model.no_sync()
            _forward(model)
        _forward(model)
    _forward(model)
    # forward, forward with the attribute False, then no_sync's entries, forwards and
    # exits (each tells DDP at once, as replicate's set_requires_gradient_sync does).
    assert told == [True, False, False, False, False, False, False, False, True, True]


def test_after_the_stop_no_spelling_turns_the_sync_back_on() -> None:
    model = nn.Linear(2, 2)
    switch, told = _switched(model)
    switch.stop()
    model.require_backward_grad_sync = True
    with switch.no_sync():
        pass
    _forward(model)
    assert told == [False, False, False, False]


def test_a_module_s_own_names_are_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    class Own(nn.Linear):
        require_backward_grad_sync = "a setting of its own"

        def no_sync(self) -> str:
            return "mine"

    model = Own(2, 2)
    with caplog.at_level(logging.WARNING):
        switch, told = _switched(model)
    assert model.no_sync() == "mine"
    assert model.require_backward_grad_sync == "a setting of its own"
    assert "defines its own no_sync" in caplog.text and "is not a bool" in caplog.text
    _forward(model)
    with switch.no_sync():  # opt.no_sync() still works
        _forward(model)
    assert told == [True, False, False, True]
