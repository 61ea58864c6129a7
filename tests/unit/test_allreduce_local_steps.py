"""`allreduce` with local steps and the outer optimizer (DiLoCo's form), its worker
runtime in this process: a gloo group of one worker on an in-memory store, the model and
its averaged state as ripples.Optimizer builds them. The schedule (a synchronisation at
every multiple of H, one more at a stop between two), the outer step and the checkpoint
of the anchor and momentum, against DiLoCo written from its definition with torch's
Nesterov SGD (tests/integration/test_local_steps.py runs several workers)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ripples.coordinator.config import RunSettings
from ripples.protocols.allreduce.runtime import AllReduceProtocol
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import CommunicatorCache, CommunicatorFactory
from ripples.worker.metrics import ProtocolMetrics
from ripples.worker.protocol import ProtocolContext

H, STEPS, OUTER_LR, OUTER_MOMENTUM = 3, 7, 0.7, 0.9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _protocol(model: nn.Module, **options: object) -> AllReduceProtocol:
    config = RunSettings.build(protocol="allreduce", num_workers=2, iterations=STEPS,
                               checkpoint_interval=1000, **options).to_proto()
    store = dist.HashStore()
    state = AveragedState(model)
    ctx = ProtocolContext(
        client=CoordinatorClient("127.0.0.1:9"),  # never called: no checkpoint RPC is due
        worker_id=1, rank=0, num_workers=1, config=config, membership=pb.Membership(),
        model=model, state=state,
        comms=CommunicatorCache(CommunicatorFactory(store, torch.device("cpu"), 30.0)),
        store=store, device=torch.device("cpu"), stop_requested=threading.Event(),
        progress=pb.Progress, metrics=ProtocolMetrics(None, []))
    return AllReduceProtocol(ctx)


@pytest.mark.parametrize("outer", ["nesterov", "none"])
def test_one_worker_follows_dilocos_schedule_and_outer_step(outer: str) -> None:
    nesterov = outer == "nesterov"
    model = _model()
    options = {"outer_optimizer": outer, "local_steps": H}
    if nesterov:
        options |= {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM}
    protocol = _protocol(model, **options)
    try:
        assert not protocol.syncs_gradients and (protocol.outer is not None) == nesterov
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        reference = _model()
        anchor = copy.deepcopy(reference)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
        outer_opt = torch.optim.SGD(anchor.parameters(), lr=OUTER_LR if nesterov else 1.0,
                                    momentum=OUTER_MOMENTUM if nesterov else 0.0,
                                    nesterov=nesterov)
        synced = []
        for step in range(1, STEPS + 1):
            _train_step(model, opt, step)
            protocol.after_step(step)
            verdict = protocol.should_stop(step, STEPS)
            if protocol.synced_at == step:
                synced.append(step)
            _train_step(reference, ref_opt, step)
            if step % H == 0 or step == STEPS:  # DiLoCo: Δ = φ − x, the outer step, x ← φ
                for p, q in zip(anchor.parameters(), reference.parameters(), strict=True):
                    p.grad = (p - q).detach()
                outer_opt.step()
                reference.load_state_dict(anchor.state_dict())
        assert synced == [3, 6, 7]  # every multiple of H, then the stop at 7
        assert verdict is not None and verdict.stop
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        if nesterov:
            assert protocol.outer is not None
            saved = protocol.state_dict()
            assert torch.equal(saved["outer"]["anchor"], protocol.outer.anchor)  # type: ignore[index]
    finally:
        protocol.close()


def test_the_anchor_and_momentum_come_back_from_a_checkpoint_and_start_afresh_without() -> None:
    model = _model()
    protocol = _protocol(model, local_steps=2, outer_optimizer="nesterov")
    try:
        outer = protocol.outer
        assert outer is not None
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for step in (1, 2, 3):
            _train_step(model, opt, step)
            protocol.after_step(step)
        saved = copy.deepcopy(protocol.state_dict())
        anchor, momentum = outer.anchor.clone(), outer.momentum.clone()
        assert bool(momentum.any()) and outer.steps_since_sync == 1
        protocol.load_state_dict({})  # another protocol's checkpoint: afresh from the model
        assert torch.equal(outer.anchor, protocol.ctx.state.flat[: outer.numel])
        assert not bool(outer.momentum.any()) and outer.steps_since_sync == 0
        protocol.load_state_dict(saved)
        assert torch.equal(outer.anchor, anchor) and torch.equal(outer.momentum, momentum)
        assert outer.steps_since_sync == 1
    finally:
        protocol.close()
