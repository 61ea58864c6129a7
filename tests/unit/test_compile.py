"""torch.compile and the flat buffer: a P-Reduce re-points the parameters (`p.data`) at
the buffer holding the group's average; a compiled model must compute with the new
values, never with the storage it saw when it was compiled."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

from ripples.worker.dataplane.averaged_state import AveragedState

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                       reason="torch.compile's CPU backend needs a C compiler (cc or gcc)"),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _average_with(state: AveragedState, other: torch.Tensor) -> None:
    """What a P-Reduce of two members does on this side: stage, sum, commit (a swap)."""
    staged = state.stage(0.5)
    # The SUM collective, with the peer's staged half (its non-finite flag, last: 0).
    staged[:-1].add_(other, alpha=0.5)
    state.commit()


def test_a_compiled_model_computes_with_the_averaged_parameters() -> None:
    model = _model()
    eager = copy.deepcopy(model)
    state = AveragedState(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    compiled = torch.compile(model)
    peer = torch.randn_like(state.flat)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 8, generator=generator)
        y = torch.randint(0, 4, (16,), generator=generator)
        for m, o in ((compiled, opt), (eager, eager_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        before = model[0].weight.data_ptr()
        _average_with(state, peer)
        assert model[0].weight.data_ptr() != before  # re-pointed at the other buffer
        with torch.no_grad():  # the eager model gets the same average by value
            eager_flat = torch.cat([t.reshape(-1) for t in
                                    [*eager.parameters(), eager[1].running_mean,
                                     eager[1].running_var]])
            averaged = 0.5 * eager_flat + 0.5 * peer
            offset = 0
            for t in [*eager.parameters(), eager[1].running_mean, eager[1].running_var]:
                t.copy_(averaged[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        torch.testing.assert_close(model.state_dict(), eager.state_dict())
        probe = torch.randn(16, 8, generator=generator)
        torch.testing.assert_close(compiled(probe), eager(probe), rtol=1e-4, atol=1e-5)
