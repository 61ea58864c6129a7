"""DDP's spellings of gradient accumulation, on the user's own model (`allreduce`).

A DDP script skips the gradient all-reduce of the micro-batches before the last one in
one of two ways, both on the `DistributedDataParallel` wrapper:

- `with model.no_sync():` around the micro-batch's forward and backward;
- `model.require_backward_grad_sync = False` before its forward (nanoGPT writes
  `model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)`).

Under Ripples the model is the user's own module (DDP's composable `replicate` hooks it;
there is no wrapper), so both spellings are given to that module, with DDP's meaning: the
switch as it stands when the forward pass runs decides whether the backward of that
forward all-reduces (DDP prepares its reducer in the forward). `ripples.Optimizer.no_sync()`
is a third spelling of the first, and after the run stopped no backward synchronises,
whatever the script sets (the peers are leaving).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from ripples.worker.protocol import DDP_NO_SYNC

logger = logging.getLogger(__name__)

REQUIRE_SYNC = "require_backward_grad_sync"
"""DDP's attribute: False skips the gradient all-reduce of the next forward's backward."""


class GradientSyncSwitch:
    """Whether the next forward's backward all-reduces the gradients.

    It does unless one of these holds when the forward starts: a `no_sync()` context is
    open (the model's or the optimizer's), the model's `require_backward_grad_sync` is
    False, or the run has stopped. A forward pre-hook, registered ahead of replicate's,
    hands the answer to `apply` (replicate's `set_requires_gradient_sync`) before DDP
    reads it.

    Invariant: the user's module keeps whatever it defines itself. A module with its own
    `no_sync` is left alone (a warning says what works instead); a module whose
    `require_backward_grad_sync` is not a bool is not read (a warning too). A module with
    neither gets both, as a DDP wrapper has them: the attribute True, and `no_sync()`.
    """

    def __init__(self, model: torch.nn.Module, apply: Callable[[bool], None]) -> None:
        self.model = model
        self._apply = apply
        self._no_sync_depth = 0
        self.stopped = False
        self._reads_attribute = True
        if not hasattr(model, REQUIRE_SYNC):
            setattr(model, REQUIRE_SYNC, True)
        elif not isinstance(getattr(model, REQUIRE_SYNC), bool):
            self._reads_attribute = False
            logger.warning("the model's own %s is not a bool, so allreduce does not read "
                           "it; use `with opt.no_sync():` for gradient accumulation",
                           REQUIRE_SYNC)
        if not hasattr(model, DDP_NO_SYNC):
            setattr(model, DDP_NO_SYNC, self.no_sync)
        else:
            logger.warning("the model defines its own %s, which allreduce leaves alone: for "
                           "gradient accumulation use `with opt.no_sync():` or set "
                           "model.%s = False before the forward pass", DDP_NO_SYNC, REQUIRE_SYNC)
        model.register_forward_pre_hook(self._before_forward, prepend=True)

    def wanted(self) -> bool:
        """Whether a backward of a forward that starts now all-reduces the gradients."""
        if self.stopped or self._no_sync_depth:
            return False
        if not self._reads_attribute:
            return True
        value = getattr(self.model, REQUIRE_SYNC, True)
        return value if isinstance(value, bool) else True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside do not all-reduce (nestable)."""
        self._no_sync_depth += 1
        self._apply(False)
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            self._apply(self.wanted())

    def stop(self) -> None:
        """The run stopped: no backward synchronises from now on."""
        self.stopped = True
        self._apply(False)

    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        self._apply(self.wanted())
