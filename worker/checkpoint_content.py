"""What a ripples.Checkpointer's checkpoints hold of the training loop, one kind per
Checkpointer:

- `TrainingState` (the default): the model's state_dict; the optimizer's, with Ripples'
  step counters under "ripples" (restored through `opt.load_state_dict`, so the
  optimizer state rejoins the averaged state); the random number generators (torch's
  CPU one, the worker's CUDA device's, Python's `random`, numpy's).
- `ScriptState`: what the script's own `state_dict()` callable returns, handed back to its
  `load_state_dict` on restore (a script with a checkpoint format of its own, as
  torchft's Manager takes them), and Ripples' step counters, which go back to the
  optimizer after the script's callable ran, so that `opt.local_step` is the step
  restored whatever the script's state holds.

The Checkpointer adds the step and the run (rank, protocol), the protocol's own state and
the named objects (scheduler, sampler, ...). Tensors are saved on the CPU at their own
size (ripples/state_dicts.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ripples.state_dicts import compact_on_cpu, state_dict_views

if TYPE_CHECKING:
    from ripples.worker.optimizer import Optimizer


class CheckpointContent(Protocol):
    """One kind of content: its entries in a checkpoint's dict, their check, their load."""

    def entries(self) -> dict[str, Any]:
        """The entries this kind adds to a checkpoint being saved."""
        ...

    def check(self, path: Path, checkpoint: dict[str, Any]) -> None:
        """ValueError, naming `path`, unless `checkpoint` holds this kind's entries (of
        this model, where they can tell)."""
        ...

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Put the entries back (after `check`)."""
        ...


class TrainingState:
    """Ripples' own choice: the model, the optimizer and the random number generators
    (the generators are put back by the Checkpointer, which knows when: module doc of
    worker/checkpoint.py)."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    def entries(self) -> dict[str, Any]:
        opt = self.optimizer
        with state_dict_views():  # copied once, straight to the CPU
            return {"model": compact_on_cpu(opt.model.state_dict()),
                    "optimizer": compact_on_cpu(opt.state_dict()),
                    "rng": rng_state(opt.worker.device)}

    def check(self, path: Path, checkpoint: dict[str, Any]) -> None:
        if "model" not in checkpoint:
            raise ValueError(f"{path} holds a script's own state (saved by a Checkpointer "
                             "given state_dict and load_state_dict): restore it with the "
                             "same callables, or remove the checkpoints to start afresh")
        mine = self.optimizer.model.state_dict(keep_vars=True)  # shapes: no copies
        theirs: dict[str, torch.Tensor] = checkpoint["model"]
        missing = [k for k in mine if k not in theirs]
        extra = [k for k in theirs if k not in mine]
        if missing or extra:
            raise ValueError(f"{path} is a checkpoint of another model: "
                             f"{len(missing)} tensor(s) missing there (first: "
                             f"{missing[:1]}), {len(extra)} unknown here (first: {extra[:1]})")
        for name, tensor in mine.items():
            if tuple(theirs[name].shape) != tuple(tensor.shape):
                raise ValueError(f"{path} is a checkpoint of another model: {name!r} is "
                                 f"{list(theirs[name].shape)} there, {list(tensor.shape)} here")

    def load(self, checkpoint: dict[str, Any]) -> None:
        self.optimizer.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])


class ScriptState:
    """The script's own state, through its callables (see the module doc)."""

    def __init__(self, optimizer: Optimizer, state_dict: Callable[[], Any],
                 load_state_dict: Callable[[Any], object]) -> None:
        for name, given in (("state_dict", state_dict), ("load_state_dict", load_state_dict)):
            if not callable(given):
                raise TypeError(f"{name} must be callable, got {type(given).__name__}")
        self.optimizer = optimizer
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict

    def entries(self) -> dict[str, Any]:
        # The outer state too, whether or not the script's own state holds opt.state_dict().
        return {"script_state": compact_on_cpu(self._state_dict()),
                "ripples": ripples_counters(self.optimizer)}

    def check(self, path: Path, checkpoint: dict[str, Any]) -> None:
        if "script_state" not in checkpoint:
            raise ValueError(f"{path} holds Ripples' own training state, not a script's: "
                             "restore it with a Checkpointer given no state_dict and "
                             "load_state_dict, or remove the checkpoints to start afresh")

    def load(self, checkpoint: dict[str, Any]) -> None:
        self._load_state_dict(checkpoint["script_state"])
        restore_counters(self.optimizer, checkpoint["ripples"])


def ripples_counters(opt: Optimizer) -> dict[str, Any]:
    """Ripples' step counters, and with an outer optimizer its anchor and momentum."""
    counters: dict[str, Any] = {"local_step": opt.local_step, "skipped_steps": opt.skipped_steps}
    outer = opt._outer()
    if outer is not None:
        counters["outer"] = outer.state_dict()
    return counters


def restore_counters(opt: Optimizer, counters: dict[str, Any]) -> None:
    """Put back what `ripples_counters` gave (after the optimizer's own state)."""
    opt.local_step = int(counters["local_step"])
    opt.skipped_steps = int(counters["skipped_steps"])
    outer = opt._outer()
    if outer is not None and "outer" in counters:
        outer.restore(counters["outer"])


def rng_state(device: torch.device) -> dict[str, Any]:
    """The random number generators this process draws from (a CUDA device's too)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy
    except ImportError:
        return state
    state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
