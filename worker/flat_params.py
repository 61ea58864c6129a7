"""The model's parameters in one flat contiguous buffer, double-buffered for P-Reduce.

Every parameter is a view into a flat buffer, so averaging a model is one collective on
one tensor with no concatenation or split. Averaging runs in a second buffer of the same
size: `stage()` writes parameters/|G| into it, the collective sums it in place, and
`commit()` re-points the parameters at it (the old buffer becomes the next staging
buffer). A failed collective may still write into its buffer after the error
(notes/preduce-findings.md rule 4), so on failure the staging buffer is abandoned and
the parameters, never touched by the collective, keep the local model.

The buffer can also hold the optimizer's per-parameter state (momentum buffers, Adam's
moments), laid out after the parameters, so that one collective averages both: see
`adopt_optimizer_state`.
"""

from __future__ import annotations

from typing import Any

import torch

StateSlot = tuple[dict[str, Any], str]
"""(the optimizer's state dict of one parameter, a key in it) naming one state tensor."""


class FlatParameters:
    """Owns the flat storage of a module's parameters (and, once adopted, optimizer state).

    Invariant: every parameter of the module, in the order of `module.parameters()`, then
    every adopted optimizer state tensor, in adoption order, is a view into `self.flat`;
    `self.flat` is never handed to a collective.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = [p for p in module.parameters()]
        if not self.params:
            raise ValueError("the model has no parameters to synchronise")
        devices = {p.device for p in self.params}
        dtypes = {p.dtype for p in self.params}
        if len(devices) != 1 or len(dtypes) != 1:
            raise ValueError(
                f"all parameters must share one device and dtype, got {devices} / {dtypes}"
            )
        self.slots: list[StateSlot] = []
        self.flat = self._allocate(sum(p.numel() for p in self.params))
        with torch.no_grad():
            self._point_views_at(self.flat, copy=True)
        self._staging: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def size_bytes(self) -> int:
        return self.numel * self.flat.element_size()

    def _allocate(self, numel: int) -> torch.Tensor:
        first = self.params[0]
        return torch.empty(numel, dtype=first.dtype, device=first.device)

    def _tensors(self) -> list[torch.Tensor]:
        return [*(p.data for p in self.params), *(state[key] for state, key in self.slots)]

    def _point_views_at(self, buffer: torch.Tensor, *, copy: bool) -> None:
        views = []
        offset = 0
        for tensor in self._tensors():
            n = tensor.numel()
            view = buffer[offset : offset + n].view_as(tensor)
            if copy:
                view.copy_(tensor)
            views.append(view)
            offset += n
        for p, view in zip(self.params, views, strict=False):
            p.data = view
        for (state, key), view in zip(self.slots, views[len(self.params) :], strict=True):
            state[key] = view

    def adopt_optimizer_state(self, optimizer: torch.optim.Optimizer) -> int:
        """Move the optimizer's per-parameter tensors into the flat buffer.

        Every floating tensor in `optimizer.state[p]` shaped like `p` (SGD's momentum
        buffer, Adam's exp_avg and exp_avg_sq; not scalars such as Adam's step) becomes a
        view into the buffer after the parameters, so a P-Reduce averages the group's
        update directions along with its models. PyTorch's optimizers look their state up
        by key at every step and update it in place, so they keep working on the views.
        Call once, after the first optimizer step (optimizers create state lazily).
        Returns the number of tensors adopted.
        """
        if self.slots:
            raise RuntimeError("optimizer state was already adopted")
        first = self.params[0]
        slots: list[StateSlot] = []
        for p in self.params:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if (isinstance(value, torch.Tensor) and value.shape == p.shape
                        and value.dtype == first.dtype and value.device == first.device):
                    slots.append((state, key))
        if not slots:
            return 0
        self.slots = slots
        self.flat = self._allocate(sum(t.numel() for t in self._tensors()))
        with torch.no_grad():
            self._point_views_at(self.flat, copy=True)
        self._staging = None
        return len(slots)

    def stage(self, scale: float) -> torch.Tensor:
        """A buffer holding the flat state * scale, ready for an in-place SUM collective."""
        if self._staging is None:
            self._staging = torch.empty_like(self.flat)
        with torch.no_grad():
            torch.mul(self.flat, scale, out=self._staging)
        return self._staging

    def commit(self) -> None:
        """Adopt the staged buffer (now holding the group average) as the state."""
        assert self._staging is not None, "commit() without stage()"
        staged, self._staging = self._staging, self.flat
        self.flat = staged
        self._point_views_at(self.flat, copy=False)

    def abandon(self) -> None:
        """Forget the staging buffer after a failed collective; the state stays put."""
        self._staging = None


def bind_parameters(module: torch.nn.Module, flat: torch.Tensor) -> None:
    """Point `module`'s parameters at views into `flat`, laid out as FlatParameters lays
    out an identically built module (parameters in order, back to back): how an LPP-SGD
    updater process shares its worker's model. The parameters' values become flat's."""
    params = list(module.parameters())
    numel = sum(p.numel() for p in params)
    if flat.numel() < numel or flat.dtype != params[0].dtype or flat.device != params[0].device:
        raise ValueError(f"a flat buffer of {flat.numel()} {flat.dtype} on {flat.device} cannot "
                         f"hold this model's {numel} {params[0].dtype} on {params[0].device}")
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
