"""Local steps and the outer optimizer on real workers (gloo) and a real coordinator:
`allreduce --local-steps H --outer-optimizer nesterov` is DiLoCo (arXiv
2311.08105), so its workers end with the model a single process computes from DiLoCo's
definition over the same batches: K copies of the model, H AdamW steps each, then the
outer Nesterov SGD step (torch's, as torchft's DiLoCo) on the mean pseudo-gradient.
`ripples-static` does the same in the groups of its schedule, each member stepping from
its own anchor (worker/dataplane/outer_state.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers import (
    REPO,
    finish,
    ripples_cli,
    running_coordinator,
    start_three_then_a_fourth,
    wait_for,
)
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ripples.coordinator.registry import WorkerRecord
from ripples.static_schedule import static_group_of
from ripples.worker.client import CoordinatorClient
from ripples.worker.dataplane.modular_wire import sent_bytes as modular_sent_bytes

SCRIPT = REPO / "tests" / "integration" / "scripts" / "local_steps_train.py"
WORKERS, H, STEPS = 2, 4, 10  # the stop (10) is no multiple of H: one more sync there
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5  # the run options' defaults


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("local_steps_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _diloco(script: ModuleType, nesterov: bool, *, batchnorm: bool = False,
            steps: int = STEPS, resumed_at: int = 0) -> dict[str, torch.Tensor]:
    """The reference, from the definition: one process, every worker's copy and batch.
    At every multiple of H the outer step on the mean pseudo-gradient (the floating-point
    buffers averaged); at the stop inside a round (`steps`, and `resumed_at`: a run that
    stopped there and a second that resumed from its checkpoint) the models' plain mean,
    the anchor and momentum kept."""
    anchor = script.build_model(batchnorm)
    outer = torch.optim.SGD(anchor.parameters(), lr=OUTER_LR if nesterov else 1.0,
                            momentum=OUTER_MOMENTUM if nesterov else 0.0, nesterov=nesterov)
    copies = [copy.deepcopy(anchor) for _ in range(WORKERS)]
    inner = [torch.optim.AdamW(m.parameters(), lr=script.LR) for m in copies]
    for step in range(1, steps + 1):
        _inner_steps(script, copies, inner, step)
        if step % H == 0:
            with torch.no_grad():
                for p, *local in zip(anchor.parameters(), *(m.parameters() for m in copies),
                                     strict=True):
                    p.grad = torch.stack([p - q for q in local]).mean(0)  # mean Δ
            outer.step()
            _average_buffers(anchor, copies)
            for model in copies:  # every worker restarts from the new anchor
                model.load_state_dict(anchor.state_dict())
        elif step in (steps, resumed_at):
            mean = copy.deepcopy(copies[0])
            with torch.no_grad():
                for p, *local in zip(mean.parameters(), *(m.parameters() for m in copies),
                                     strict=True):
                    p.copy_(torch.stack(local).mean(0))
            _average_buffers(mean, copies)
            for model in copies:
                model.load_state_dict(mean.state_dict())
    return copies[0].state_dict()


def _inner_steps(script: ModuleType, models: list[nn.Module],
                 inner: list[torch.optim.Optimizer], step: int) -> None:
    """Every worker's local step `step` on its own batch (rank = index)."""
    for rank, (model, opt) in enumerate(zip(models, inner, strict=True)):
        x, y = script.batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _average_buffers(into: nn.Module, copies: list[nn.Module]) -> None:
    with torch.no_grad():
        for b, *local in zip(into.buffers(), *(m.buffers() for m in copies), strict=True):
            if b.is_floating_point():
                b.copy_(torch.stack(local).mean(0))


@pytest.mark.slow
@pytest.mark.parametrize("outer", ["nesterov", "none", "nesterov-bf16"])
def test_allreduce_with_local_steps_is_diloco(outer: str, tmp_path: Path) -> None:
    """Also: the workers load `opt.state_dict()` back in mid-round (step 6: two local
    steps from the anchor), as a resume does; the anchor and outer momentum come back
    with it (were they restarted from the model, the run would leave DiLoCo's path).
    With nesterov the model has a BatchNorm layer, whose statistics are averaged. With
    bf16 the pseudo-gradients travel in bfloat16: DiLoCo's path within bfloat16's
    rounding, and still one model bit for bit."""
    nesterov = outer.startswith("nesterov")
    extra = ["--batchnorm"] if nesterov else []
    compressed = ["--outer-compression", "bf16"] if outer.endswith("bf16") else []
    proc = ripples_cli("run", "--workers", str(WORKERS), "--workers-per-node", str(WORKERS),
                       "--protocol", "allreduce", "--iterations", str(STEPS),
                       "--local-steps", str(H), "--outer-optimizer", outer.split("-")[0],
                       *compressed, "--output", str(tmp_path), "--quiet", "--", "python",
                       str(SCRIPT), "--reload-at", "6", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _diloco(_script(), nesterov=nesterov, batchnorm=nesterov)
    models = [torch.load(tmp_path / "workers" / f"rank{r}.pt") for r in range(WORKERS)]
    within = (2e-2, 2e-3) if compressed else (1e-5, 1e-5)
    for name, value in expected.items():
        assert torch.equal(models[0][name], models[1][name]), name  # one model, bit for bit
        if not value.is_floating_point():  # BatchNorm's batch count: each worker's own
            continue
        torch.testing.assert_close(models[0][name], value, rtol=within[0], atol=within[1])


@pytest.mark.slow
def test_allreduce_diloco_resumes_its_anchor_and_momentum_from_checkpoint_files(
        tmp_path: Path) -> None:
    """A run that stops inside a round (step 6 of H = 4) and a second run that resumes
    from its ripples.Checkpointer files, in new processes: the anchor, the outer momentum
    and the round's count come back from the optimizer's state in the files, and the
    second run ends where the definition does."""
    checkpoints = tmp_path / "checkpoints"

    def run(iterations: int, out: Path) -> None:
        proc = ripples_cli("run", "--workers", str(WORKERS), "--workers-per-node",
                           str(WORKERS), "--protocol", "allreduce", "--iterations",
                           str(iterations), "--local-steps", str(H), "--outer-optimizer",
                           "nesterov", "--checkpoint-dir", str(checkpoints), "--output",
                           str(out), "--quiet", "--", "python", str(SCRIPT), "--checkpoint")
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(6, tmp_path / "first")
    saved = torch.load(checkpoints / "rank-0" / "step-6.pt", weights_only=False)
    assert saved["optimizer"]["ripples"]["outer"]["steps_since_sync"] == 2
    assert "outer" not in saved["protocol_state"]  # one copy of the anchor, not two
    run(STEPS, tmp_path / "second")
    expected = _diloco(_script(), nesterov=True, resumed_at=6)
    models = [torch.load(tmp_path / "second" / "workers" / f"rank{r}.pt")
              for r in range(WORKERS)]
    for name, value in expected.items():
        torch.testing.assert_close(models[0][name], models[1][name], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(models[0][name], value, rtol=1e-5, atol=1e-5)


def _static_reference(script: ModuleType, workers: int, per_node: int,
                      steps: int) -> list[torch.Tensor]:
    """ripples-static with local steps and the outer optimizer, from the design's rule:
    at every H-th step, each group of the static schedule's round step/H averages its
    members' provisional Nesterov steps (each from its own anchor φ_j and momentum m_j:
    Δ_j = φ_j − x_j, m̂_j = μ m_j + Δ_j, φ̂_j = φ_j − η (Δ_j + μ m̂_j)); every member
    leaves with the means as its φ and m, and x = φ. Each rank's final parameters."""
    models = [script.build_model() for _ in range(workers)]
    inner = [torch.optim.AdamW(m.parameters(), lr=script.LR) for m in models]
    anchors = [parameters_to_vector(m.parameters()).detach().clone() for m in models]
    momenta = [torch.zeros_like(a) for a in anchors]
    for step in range(1, steps + 1):
        _inner_steps(script, models, inner, step)
        if step % H:
            continue
        groups = {static_group_of(step // H - 1, rank, workers // per_node, per_node)
                  for rank in range(workers)} - {None}
        for group in groups:
            assert group is not None
            steps_hat = []
            for j in group:
                delta = anchors[j] - parameters_to_vector(models[j].parameters()).detach()
                m_hat = OUTER_MOMENTUM * momenta[j] + delta
                steps_hat.append((anchors[j] - OUTER_LR * (delta + OUTER_MOMENTUM * m_hat),
                                  m_hat))
            anchor = torch.stack([a for a, _ in steps_hat]).mean(0)
            momentum = torch.stack([m for _, m in steps_hat]).mean(0)
            for j in group:
                anchors[j], momenta[j] = anchor.clone(), momentum.clone()
                vector_to_parameters(anchor.clone(), models[j].parameters())
    return [parameters_to_vector(m.parameters()).detach() for m in models]


@pytest.mark.slow
def test_ripples_static_with_local_steps_averages_its_groups_outer_steps(
        tmp_path: Path) -> None:
    workers, per_node, steps = 4, 2, 2 * H + 2  # two synchronisations, then two steps
    proc = ripples_cli("run", "--workers", str(workers), "--workers-per-node", str(per_node),
                       "--protocol", "ripples-static", "--iterations", str(steps),
                       "--local-steps", str(H), "--outer-optimizer", "nesterov",
                       "--no-average-optimizer-state", "--output", str(tmp_path), "--quiet",
                       "--", "python", str(SCRIPT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _static_reference(_script(), workers, per_node, steps)
    script = _script()
    for rank in range(workers):
        model = script.build_model()
        model.load_state_dict(torch.load(tmp_path / "workers" / f"rank{rank}.pt"))
        torch.testing.assert_close(parameters_to_vector(model.parameters()).detach(),
                                   expected[rank], rtol=1e-5, atol=1e-5)


def _four_workers_with_outer_steps(protocol: str, out: Path, compression: str = "none"
                                   ) -> tuple[dict[str, Any], int]:
    """A 4-worker run of the test script (BatchNorm model) with H = 4 and the outer step,
    40 steps; its summary (the run ended at its budget) and the bytes of one outer-form
    synchronisation (anchor and buffers in fp32, momentum in fp32 or, with bf16, in
    bfloat16)."""
    proc = ripples_cli("run", "--workers", "4", "--workers-per-node", "2", "--protocol",
                       protocol, "--iterations", "40", "--local-steps", str(H),
                       "--outer-optimizer", "nesterov", "--outer-compression", compression,
                       "--seed", "1", "--output", str(out), "--", "python", str(SCRIPT),
                       "--batchnorm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert "iteration budget reached" in summary["stop_reason"], summary["stop_reason"]
    model = _script().build_model(batchnorm=True)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    if compression == "int8":  # the modular wire: a byte a parameter, the rest in float32
        return summary, modular_sent_bytes(params, buffers, 4)
    # The flat buffer, the momentum (float32 or bfloat16) and the non-finite flag (one
    # float32 element after the flat buffer).
    return summary, 4 * (params + buffers) + (2 if compression == "bf16" else 4) * params + 4


@pytest.mark.slow
@pytest.mark.parametrize(("protocol", "compression"),
                         [("ripples-smart", "none"), ("ripples-random", "bf16"),
                          ("ripples-smart", "int8")])
def test_group_generator_protocols_take_local_steps_and_the_outer_step(
        protocol: str, compression: str, tmp_path: Path) -> None:
    """Four workers, H = 4, the outer Nesterov step in the Group Generator's groups: the
    run ends at its budget, every worker asks for groups once per round of H steps, and
    its groups' bytes are the outer form's (2P plus the buffers; 1.5P plus the buffers
    with the momentum in bf16; about a byte a parameter plus the buffers with int8)."""
    summary, per_group = _four_workers_with_outer_steps(protocol, tmp_path, compression)
    for worker in summary["workers"]:
        # A worker asks for groups once per round of H steps, and is in at most one
        # group per request of any worker (random groups: its own and those others'
        # requests put it in, group_size per round on average).
        assert 0 < worker["request_count"] <= worker["iterations"] // H, worker
        sent = worker["preduce_bytes"]
        assert sent > 0 and sent % per_group == 0, (sent, per_group)
        assert sent // per_group <= 4 * worker["iterations"] // H
    assert 0 < summary["bytes_per_worker_step"] <= 4 * per_group / H


@pytest.mark.slow
def test_rounds_sized_to_the_link_grow_from_h_within_8h(tmp_path: Path) -> None:
    """--sync-share 0.01 with the int8 wire: a synchronisation (a coordinator round trip
    and three collectives) takes far more than a hundredth of the test script's tiny
    steps, so each worker lengthens its rounds past H, never past 8H (it asks for
    fewer groups than a round of H would, and at least one per 8H steps), and the run
    ends at its budget."""
    iterations, h = 160, 2
    proc = ripples_cli("run", "--workers", "3", "--protocol", "ripples-smart",
                       "--iterations", str(iterations), "--local-steps", str(h),
                       "--outer-optimizer", "nesterov", "--outer-compression", "int8",
                       "--sync-share", "0.01", "--seed", "1", "--output", str(tmp_path),
                       "--", "python", str(SCRIPT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads((tmp_path / "summary.json").read_text())
    assert "iteration budget reached" in summary["stop_reason"], summary["stop_reason"]
    for worker in summary["workers"]:
        rounds, steps = worker["request_count"], worker["iterations"]
        assert steps // (8 * h) - 1 <= rounds < steps // h, worker


@pytest.mark.slow
def test_a_joiner_of_a_local_step_run_heals_its_anchor_and_averages(tmp_path: Path) -> None:
    """ripples-smart with H = 4 and the outer optimizer takes a fourth worker mid-run: it
    heals from a live peer (the donor's anchor and momentum, the model at the donor's
    anchor), then averages in the policy's groups; then the run is stopped and every
    worker leaves cleanly. (The budget is out of reach: the test stops the run once the
    joiner averaged, so that no budget races the joiner's start-up.)"""
    with running_coordinator(protocol="ripples-smart", num_workers=3, max_workers=4,
                             task="digits", iterations=10_000_000, lease_seconds=4.0,
                             seed=1, local_steps=H, outer_optimizer="nesterov") as server:
        core = server.service.core  # type: ignore[union-attr]
        workers: list[subprocess.Popen[str]] = []
        try:
            start_three_then_a_fourth(server.address, core, workers, trained=40)

            def joiner() -> WorkerRecord | None:
                return next((w for w in core.workers.values() if w.host == "node3"), None)

            def averaged() -> bool:
                w = joiner()
                return w is not None and w.healed and any(
                    w.worker_id in g.members and g.heal_donor is None
                    for g in list(core.recent_groups))

            wait_for(lambda: averaged() or core.stopped, "the joiner to heal and average")
            assert not core.stopped, core.stop_reason
            CoordinatorClient(server.address).stop_run("the joiner averaged")
            outputs = finish(workers, 180)
        finally:
            for p in workers:
                if p.poll() is None:
                    p.kill()
        for p, out in zip(workers, outputs, strict=True):
            assert p.returncode == 0, out[-3000:]
        assert "healed from worker" in outputs[3], outputs[3][-3000:]


@pytest.mark.slow
def test_adpsgd_takes_local_steps_and_the_outer_step_in_its_exchanges(tmp_path: Path) -> None:
    """adpsgd, H = 4: exchanges are owed once per round (rate_com per round), each the
    outer form's (the anchor, momentum and buffers of each side; the momentum in bf16
    here); the run ends at its budget with finite models."""
    summary, per_group = _four_workers_with_outer_steps("adpsgd", tmp_path, "bf16")
    per_exchange = per_group - 4  # gossip's exchanges carry no non-finite flag
    sent = [w["preduce_bytes"] for w in summary["workers"]]
    assert all(s % per_exchange == 0 for s in sent) and sum(sent) > 0, (sent, per_exchange)
    for rank in range(4):
        state = torch.load(tmp_path / "workers" / f"rank{rank}.pt")
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


@pytest.mark.slow
def test_the_readmes_local_steps_command_trains_the_language_model(tmp_path: Path) -> None:
    """README: `ripples run --workers 4 --protocol ripples-smart --local-steps 8
    --outer-optimizer nesterov -- python examples/transformer_lm.py`, with a smaller
    model and fewer steps (AdamW, the scheduler on the global step, GradScaler and the
    Checkpointer's hooks all in the loop)."""
    readme = (REPO / "README.md").read_text()
    command = ("ripples run --workers 4 --protocol ripples-smart --local-steps 8 "
               "--outer-optimizer nesterov -- python examples/transformer_lm.py")
    assert command in readme
    small = ["--steps", "24", "--d-model", "32", "--layers", "1", "--heads", "2",
             "--block-size", "32", "--batch-size", "8", "--warmup", "5",
             "--log-every", "1000"]
    proc = ripples_cli(*command.split()[1:command.split().index("--")],
                       "--output", str(tmp_path), "--quiet", "--", "python",
                       str(REPO / "examples" / "transformer_lm.py"), *small, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "iteration budget reached" in summary["stop_reason"], summary["stop_reason"]
    assert summary["final_train_loss"] < math.log(256)  # below a uniform guess
    assert 0 < summary["bytes_per_worker_step"]
