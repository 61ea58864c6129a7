"""Local steps and the outer optimizer on real workers (gloo) and a real coordinator
(issue 33): `allreduce --local-steps H --outer-optimizer nesterov` is DiLoCo (arXiv
2311.08105), so its workers end with the model a single process computes from DiLoCo's
definition over the same batches: K copies of the model, H AdamW steps each, then the
outer Nesterov SGD step (torch's, as torchft's DiLoCo) on the mean pseudo-gradient.
`ripples-static` does the same in the groups of its schedule, each member stepping from
its own anchor (worker/dataplane/outer_state.py)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import REPO, ripples_cli
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ripples.static_schedule import static_group_of

SCRIPT = REPO / "tests" / "integration" / "scripts" / "local_steps_train.py"
WORKERS, H, STEPS = 2, 4, 10  # the stop (10) is no multiple of H: one more sync there
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("local_steps_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _diloco(script: ModuleType, nesterov: bool) -> dict[str, torch.Tensor]:
    """The reference, from the definition: one process, every worker's copy and batch."""
    anchor = script.build_model()
    outer = torch.optim.SGD(anchor.parameters(), lr=OUTER_LR if nesterov else 1.0,
                            momentum=OUTER_MOMENTUM if nesterov else 0.0, nesterov=nesterov)
    copies = [copy.deepcopy(anchor) for _ in range(WORKERS)]
    inner = [torch.optim.AdamW(m.parameters(), lr=script.LR) for m in copies]
    for step in range(1, STEPS + 1):
        for rank, (model, opt) in enumerate(zip(copies, inner, strict=True)):
            x, y = script.batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if step % H and step != STEPS:
            continue
        with torch.no_grad():
            for p, *local in zip(anchor.parameters(), *(m.parameters() for m in copies),
                                 strict=True):
                p.grad = torch.stack([p - q for q in local]).mean(0)  # mean pseudo-gradient
        outer.step()
        for model in copies:  # every worker restarts from the new anchor
            model.load_state_dict(anchor.state_dict())
    return anchor.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("outer", ["nesterov", "none"])
def test_allreduce_with_local_steps_is_diloco(outer: str, tmp_path: Path) -> None:
    """Also: the workers load `opt.state_dict()` back in mid-round (step 6: two local
    steps from the anchor), as a resume does; the anchor and outer momentum come back
    with it (were they restarted from the model, the run would leave DiLoCo's path)."""
    proc = ripples_cli("run", "--workers", str(WORKERS), "--workers-per-node", str(WORKERS),
                       "--protocol", "allreduce", "--iterations", str(STEPS),
                       "--local-steps", str(H), "--outer-optimizer", outer,
                       "--output", str(tmp_path), "--quiet", "--", "python", str(SCRIPT),
                       "--reload-at", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _diloco(_script(), nesterov=outer == "nesterov")
    models = [torch.load(tmp_path / "workers" / f"rank{r}.pt") for r in range(WORKERS)]
    for name, value in expected.items():
        assert torch.equal(models[0][name], models[1][name]), name  # one model, bit for bit
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
        for rank, (model, opt) in enumerate(zip(models, inner, strict=True)):
            x, y = script.batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
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
