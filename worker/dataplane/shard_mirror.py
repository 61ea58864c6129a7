"""The local shards of an FSDP2-sharded model, mirrored into the averaged state.

A worker of G ranks (worker/replica.py) averages shard by shard: rank r's averaged state
is its local shard of every parameter (FSDP2's `Shard(0)` piece of each DTensor), its own
floating-point buffers (FSDP2 does not shard buffers) and, once adopted, its shard of the
optimizer's per-parameter state (AdamW's moments are DTensors sharded as their
parameters). FSDP2 owns the shards'
storage: it pads them and may replace them (`reset_sharded_param` at its lazy init, after
a load), so the averaged state cannot re-point them at its flat buffer as it does an
unsharded model's tensors (worker/dataplane/averaged_state.py). It holds plain tensors
of the shards' shapes instead, which `pull()` fills from the shards and `push()` writes
back: one copy of 1/G of the model each way, around a synchronisation, and `push()` only
when the synchronisation changed the state.

Every parameter must be a DTensor sharded over the worker's mesh: a parameter left
unsharded would be a whole copy on each rank, whose gradients nothing averages across
the ranks (they would drift apart silently), so it is refused by name.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ripples.worker.dataplane.averaged_state import AveragedState, StateSlot, state_slots


class ShardMirror:
    """Rank r's shards of a sharded model, and the averaged state that mirrors them."""

    def __init__(self, model: torch.nn.Module, mesh: DeviceMesh, shard: int) -> None:
        self.model = model
        self.shard = shard
        named = list(model.named_parameters())
        for name, p in named:
            if not isinstance(p, DTensor):
                raise ValueError(
                    f"parameter {name} is not sharded: on a worker of {mesh.size()} ranks "
                    "every parameter must be sharded by FSDP2 over worker.mesh (call "
                    "fully_shard(module, mesh=worker.mesh) on the model, after its blocks), "
                    "else each rank trains a copy of it that nothing keeps equal")
            if p.device_mesh != mesh:
                raise ValueError(f"parameter {name} is sharded over {p.device_mesh}, not over "
                                 f"this worker's ranks: fully_shard(..., mesh=worker.mesh)")
        self._param_names = [n for n, _ in named]
        self._buffer_names = [n for n, b in model.named_buffers() if b.is_floating_point()]
        params = [(name, t.detach().clone()) for name, t in zip(
            self._param_names, self._locals(), strict=True)]
        buffers = [(name, b.detach().clone()) for name, b in zip(
            self._buffer_names, self._buffers(), strict=True)]
        self.state = AveragedState.of_tensors(params, buffers)
        """Plain tensors of this rank's shards and buffers (what its protocol averages)."""
        self._slots: list[StateSlot] = []
        """Adopted: the optimizer's state entries (DTensors) whose shards are mirrored."""
        self._seen: tuple[int, int] = (0, -1)

    def missing_optimizer_state(self, optimizer: torch.optim.Optimizer) -> str | None:
        """The first trainable parameter the optimizer has no state for yet, or None."""
        for name, p in self.model.named_parameters():
            if p.requires_grad and not optimizer.state.get(p):
                return name
        return None

    def adopt_optimizer_state(self, optimizer: torch.optim.Optimizer) -> int:
        """The optimizer's per-parameter state (its shards: AdamW's moments are sharded as
        their parameters) joins the mirror, after the parameters and buffers; again after
        a load, which replaces it. Returns how many tensors."""
        found = state_slots(optimizer, self.model.named_parameters(), self.state.params[0])
        self._slots = [slot for _, slot in found]
        shadows: list[tuple[str, StateSlot]] = []
        for label, (entries, key) in found:
            value = entries[key]
            local = value.to_local() if isinstance(value, DTensor) else value
            shadows.append((label, ({key: local.detach().clone()}, key)))
        count = self.state.adopt_slots(shadows)
        self._seen = self._version()
        return count

    def _locals(self) -> list[torch.Tensor]:
        """This rank's piece of each parameter, looked up anew each time (FSDP2 may
        replace it)."""
        return [p.to_local() for p in self.model.parameters()  # type: ignore[operator]
                if isinstance(p, DTensor)]

    def _buffers(self) -> list[torch.Tensor]:
        return [b for b in self.model.buffers() if b.is_floating_point()]

    def _sources(self) -> list[torch.Tensor]:
        """What the averaged state mirrors, in its order: the shards, the buffers, the
        adopted optimizer state's shards."""
        state = [entries[key] for entries, key in self._slots]
        return [*self._locals(), *self._buffers(),
                *(v.to_local() if isinstance(v, DTensor) else v for v in state)]

    def pull(self) -> None:
        """The averaged state takes the shards' values (before a synchronisation)."""
        with torch.no_grad():
            torch._foreach_copy_(self.state.tensors(), self._sources())
        self._seen = self._version()

    def push(self) -> bool:
        """The shards take the averaged state's values, if a synchronisation changed it
        since `pull()`; returns whether it did."""
        if self._version() == self._seen:
            return False
        with torch.no_grad():
            torch._foreach_copy_(self._sources(), self.state.tensors())
        self._seen = self._version()
        return True

    def _version(self) -> tuple[int, int]:
        """Where the averaged state lives and how often it was written in place: a commit
        moves it to the other buffer, a heal or an outer step writes it in place."""
        flat = self.state.flat
        return flat.data_ptr(), flat._version
