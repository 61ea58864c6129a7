"""state_dicts that `torch.save` writes at their own size.

`torch.save` writes every tensor's whole storage. In a distributed run the model's
parameters and floating-point buffers, and (once it joined) the optimizer's per-parameter
state, are views into one flat buffer (worker/dataplane/averaged_state.py), so a
`torch.save(model.state_dict())` would write the optimizer state too, and a
`torch.save(opt.state_dict())` the model. `compact_state_dicts` attaches public
state_dict post-hooks to the model and the optimizer that replace such views by copies of
exactly their elements, so a script saves what DDP's would, without cloning anything
itself; `load_state_dict` is untouched (it copies values into the views, wherever they
come from).

The copies cost one copy of the named tensors per call, on their device. Ripples' own
callers that copy to the CPU anyway (checkpoints, the consensus model) take the views
inside `state_dict_views()` and copy once, with `compact_on_cpu`.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

_views_wanted = contextvars.ContextVar("ripples_state_dict_views", default=False)


@contextlib.contextmanager
def state_dict_views() -> Iterator[None]:
    """Inside, the hooks leave views as they are: for callers that copy them anyway."""
    token = _views_wanted.set(True)
    try:
        yield
    finally:
        _views_wanted.reset(token)


def is_view_of_more(tensor: torch.Tensor) -> bool:
    """True when `torch.save` would write more than `tensor` names: it is a view into a
    larger storage."""
    return tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached, copied when it is a view into a larger storage."""
    tensor = tensor.detach()
    return tensor.clone() if is_view_of_more(tensor) else tensor


def compact_on_cpu(value: Any) -> Any:
    """`value` (nested dicts, lists and tuples) with every tensor on the CPU, each holding
    only its own elements: a device tensor is copied to the host, a CPU view of a larger
    storage copied, any other CPU tensor kept as it is (torch.save writes synchronously,
    so no copy is needed to take a consistent snapshot). A state_dict's `_metadata`
    (the modules' versions, read by load_state_dict) is kept."""
    if isinstance(value, torch.Tensor):
        return compact(value) if value.device.type == "cpu" else value.detach().to("cpu")
    if isinstance(value, dict):
        copied = {k: compact_on_cpu(v) for k, v in value.items()}
        metadata = getattr(value, "_metadata", None)
        if metadata is None:
            return copied
        ordered: Any = OrderedDict(copied)
        ordered._metadata = metadata
        return ordered
    if isinstance(value, list):
        return [compact_on_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(compact_on_cpu(v) for v in value)
    return value


def compact_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """From now on `model.state_dict()` (and any submodule's) and `optimizer.state_dict()`
    return copies of the tensors that are views into a larger storage (see the module
    doc); others stay as they are, and so does `state_dict(keep_vars=True)`, which returns
    the parameters themselves."""
    hook = _ModuleCopies()
    for module in model.modules():
        if next(_own_tensors(module), None) is not None:
            module.register_state_dict_post_hook(hook)
    optimizer.register_state_dict_post_hook(_optimizer_copies)


def _own_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False, remove_duplicate=False)
    yield from module.named_buffers(recurse=False, remove_duplicate=False)


class _ModuleCopies:
    """The state_dict post-hook of every module of the model that holds tensors of its
    own. Each module's hook replaces its own entries, so a submodule's state_dict() is
    compact too. A tensor that two modules share (tied weights) is copied once per call,
    as torch.save writes it once: the copies of the call in progress are remembered while
    its dict (the `destination` every module of one call fills) lives."""

    def __init__(self) -> None:
        self._destination: weakref.ref[Any] | None = None
        self._copies: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary())

    def __call__(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: dict[str, Any]) -> None:
        if _views_wanted.get():
            return
        copies = self._copies_of(state_dict)
        for name, tensor in _own_tensors(module):
            key = prefix + name
            saved = state_dict.get(key)
            # `saved is tensor`: state_dict(keep_vars=True) asked for the tensors themselves.
            if saved is None or saved is tensor or not is_view_of_more(saved):
                continue
            copy = copies.get(id(tensor)) if copies is not None else None
            if copy is None:
                copy = saved.detach().clone()
                if copies is not None:
                    copies[id(tensor)] = copy
            state_dict[key] = copy

    def _copies_of(self, destination: dict[str, Any]
                   ) -> weakref.WeakValueDictionary[int, torch.Tensor] | None:
        """The copies made so far for `destination` (None: a dict that cannot be
        weakly referenced, given by the caller: no tied tensors are recognised)."""
        if self._destination is not None and self._destination() is destination:
            return self._copies
        try:
            self._destination = weakref.ref(destination)
        except TypeError:
            self._destination = None
            return None
        self._copies = weakref.WeakValueDictionary()
        return self._copies


def _optimizer_copies(optimizer: torch.optim.Optimizer,
                      state_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The optimizer's state_dict post-hook. Its "state" holds the optimizer's own
    per-parameter dicts, so the copies go into new ones."""
    if _views_wanted.get():
        return None
    state = state_dict["state"]
    if not any(isinstance(v, torch.Tensor) and is_view_of_more(v)
               for entry in state.values() for v in entry.values()):
        return None
    return {**state_dict, "state": {
        index: {k: (v.detach().clone() if isinstance(v, torch.Tensor) and is_view_of_more(v)
                    else v) for k, v in entry.items()}
        for index, entry in state.items()}}
