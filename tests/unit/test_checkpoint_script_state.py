"""ripples.Checkpointer with a script's own checkpoint format (its state_dict callables).

Single-process, on a real worker: the script's own state is saved and given back (with or
without the optimizer's), the step goes on from the checkpoint's, the two callables come
in pairs, and a checkpoint of the other kind (Ripples' own or a script's) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_harness import crash, run_steps, saved_files, small_model
from torch import nn

import ripples

pytestmark = pytest.mark.usefixtures("single_process_worker")  # tests/unit/conftest.py


def _own_format(model: nn.Module, opt: ripples.Optimizer, loaded: list[dict[str, int]], *,
                with_optimizer: bool = True) -> dict[str, Callable[..., Any]]:
    """A script's own checkpoint format, as the Checkpointer's callables."""
    def state_dict() -> dict[str, Any]:
        state = {"net": model.state_dict(), "extra": {"epoch": 3}}
        return {**state, "sgd": opt.state_dict()} if with_optimizer else state

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["net"])
        if with_optimizer:
            opt.load_state_dict(state["sgd"])
        loaded.append(state["extra"])

    return {"state_dict": state_dict, "load_state_dict": load_state_dict}


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_scripts_own_state_is_saved_and_given_back(with_optimizer: bool,
                                                      tmp_path: Path) -> None:
    model, opt = small_model()
    loaded: list[dict[str, int]] = []
    ckpt = ripples.Checkpointer(opt, directory=tmp_path, every=2,
                                **_own_format(model, opt, loaded, with_optimizer=with_optimizer))
    run_steps(opt, ckpt, 5)
    assert saved_files(tmp_path) == ["step-2.pt", "step-4.pt"]
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save()
    saved = torch.load(tmp_path / "rank-0" / "step-5.pt", weights_only=False)
    assert saved["script_state"]["extra"] == {"epoch": 3}
    assert saved["ripples"] == {"local_step": 5, "skipped_steps": 0}
    assert not {"model", "optimizer", "rng"} & set(saved)  # only what the script gave
    crash()
    model, opt = small_model(seed=1)
    ckpt = ripples.Checkpointer(opt, directory=tmp_path,
                                **_own_format(model, opt, loaded, with_optimizer=with_optimizer))
    assert ckpt.restore() == 5
    # The step goes on from the checkpoint's whether or not the script's state holds it.
    assert opt.local_step == 5 and loaded == [{"epoch": 3}]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    if with_optimizer:
        assert all("momentum_buffer" in s for s in opt.state.values())


def test_the_callables_come_in_pairs() -> None:
    model, opt = small_model()
    with pytest.raises(ValueError, match="give both state_dict and load_state_dict"):
        ripples.Checkpointer(opt, directory="unused", state_dict=model.state_dict)
    with pytest.raises(TypeError, match="load_state_dict must be callable"):
        ripples.Checkpointer(opt, state_dict=model.state_dict,
                             load_state_dict={"not": "callable"})  # type: ignore[arg-type]


def test_a_checkpoint_of_the_other_kind_is_refused(tmp_path: Path) -> None:
    model, opt = small_model()
    ripples.Checkpointer(opt, directory=tmp_path / "ripples").save()
    ripples.Checkpointer(opt, directory=tmp_path / "own", **_own_format(model, opt, [])).save()
    crash()
    model, opt = small_model()
    with pytest.raises(ValueError, match="holds Ripples' own training state, not a script's"):
        ripples.Checkpointer(opt, directory=tmp_path / "ripples",
                             **_own_format(model, opt, [])).restore()
    with pytest.raises(ValueError, match="holds a script's own state"):
        ripples.Checkpointer(opt, directory=tmp_path / "own").restore()
