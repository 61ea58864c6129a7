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
    try:
        return AllReduceProtocol(ctx)
    except BaseException:  # no default group left behind for later tests
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def _step(protocol: AllReduceProtocol, model: nn.Module, opt: torch.optim.Optimizer,
          step: int) -> None:
    """One step as ripples.Optimizer drives it (StepSynchronizer): anchor before the
    first local step, count it after, then the protocol's synchronisation."""
    if protocol.outer is not None:
        protocol.outer.take_anchor()
    _train_step(model, opt, step)
    if protocol.outer is not None:
        protocol.outer.record_step()
    protocol.after_step(step)


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
            _step(protocol, model, opt, step)
            if protocol.outer is not None and step == H:  # the first made them agree
                assert protocol.outer.in_agreement
            verdict = protocol.should_stop(step, STEPS)
            if protocol.synced_at == step:
                synced.append(step)
            _train_step(reference, ref_opt, step)
            if step % H == 0:  # DiLoCo: Δ = φ − x, the outer step, x ← φ
                for p, q in zip(anchor.parameters(), reference.parameters(), strict=True):
                    p.grad = (p - q).detach()
                outer_opt.step()
                reference.load_state_dict(anchor.state_dict())
        # Every multiple of H, then the stop at 7: a plain average of the models (one
        # worker: its own), no outer step on the partial round, the anchor kept.
        assert synced == [3, 6, 7]
        assert verdict is not None and verdict.stop and verdict.num_groups == 1
        # The models and the non-finite flag (one element more).
        assert verdict.preduce_bytes == protocol.ctx.state.staged_bytes
        assert protocol.ctx.state.staged_bytes == protocol.ctx.state.size_bytes + 4
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        if nesterov:
            assert protocol.outer is not None and protocol.outer.steps_since_sync == 1
            for p, q in zip(_model_at(protocol.outer.anchor), anchor.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    finally:
        protocol.close()


def _model_at(flat: torch.Tensor) -> list[torch.Tensor]:
    """The parameters of `_model()` cut out of a flat parameter vector."""
    out, at = [], 0
    for p in _model().parameters():
        out.append(flat[at: at + p.numel()].view_as(p))
        at += p.numel()
    return out


def test_one_step_and_no_outer_optimizer_keeps_ddp() -> None:
    """H = 1 and outer none: the gradient all-reduce in backward (DDP), as before."""
    protocol = _protocol(_model())
    try:
        assert protocol.syncs_gradients and not protocol.local and protocol.outer is None
        assert hasattr(protocol, "gradient_sync")
    finally:
        protocol.close()
