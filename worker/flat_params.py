"""The model's parameters in one flat contiguous buffer, double-buffered for P-Reduce.

Every parameter is a view into a flat buffer, so averaging a model is one collective on
one tensor with no concatenation or split. Averaging runs in a second buffer of the same
size: `stage()` writes parameters/|G| into it, the collective sums it in place, and
`commit()` re-points the parameters at it (the old buffer becomes the next staging
buffer). A failed collective may still write into its buffer after the error
(notes/preduce-findings.md rule 4), so on failure the staging buffer is abandoned and
the parameters, never touched by the collective, keep the local model.
"""

from __future__ import annotations

import torch


class FlatParameters:
    """Owns the flat storage of a module's parameters.

    Invariant: every parameter of the module is a view into `self.flat`, in the order of
    `module.parameters()`, and `self.flat` is never handed to a collective.
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
        self.numel = sum(p.numel() for p in self.params)
        first = self.params[0]
        self.flat = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            self._point_params_at(self.flat, copy=True)
        self._staging: torch.Tensor | None = None

    @property
    def size_bytes(self) -> int:
        return self.numel * self.flat.element_size()

    def _point_params_at(self, buffer: torch.Tensor, *, copy: bool) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            view = buffer[offset : offset + n].view_as(p)
            if copy:
                view.copy_(p.data)
            p.data = view
            offset += n

    def stage(self, scale: float) -> torch.Tensor:
        """A buffer holding parameters * scale, ready for an in-place SUM collective."""
        if self._staging is None:
            self._staging = torch.empty_like(self.flat)
        with torch.no_grad():
            torch.mul(self.flat, scale, out=self._staging)
        return self._staging

    def commit(self) -> None:
        """Adopt the staged buffer (now holding the group average) as the parameters."""
        assert self._staging is not None, "commit() without stage()"
        staged, self._staging = self._staging, self.flat
        self.flat = staged
        self._point_params_at(self.flat, copy=False)

    def abandon(self) -> None:
        """Forget the staging buffer after a failed collective; the parameters stay put."""
        self._staging = None

    def load_flat(self, values: torch.Tensor) -> None:
        """Overwrite the parameters from a flat tensor of the same size."""
        with torch.no_grad():
            self.flat.copy_(values)
