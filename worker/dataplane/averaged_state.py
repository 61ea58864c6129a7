"""What a protocol averages, in one flat contiguous buffer, double-buffered for P-Reduce.

The averaged state of a worker is, in this order:

1. every parameter of the model (`model.named_parameters()`, shared parameters once);
2. every floating-point buffer (`model.named_buffers()`: BatchNorm's running mean and
   variance; integer buffers such as `num_batches_tracked` are not averaged);
3. once adopted (`adopt_optimizer_state`, when it exists for every trainable parameter),
   the optimizer's per-parameter state tensors shaped like their parameter (SGD's
   momentum buffer, Adam's moments; not counters such as Adam's step).

Each of them is a view into `flat` (`p.data`, a buffer's `.data` and the optimizer's state
entry are re-pointed), so averaging the state is one collective on one tensor with no
concatenation or split. Averaging runs in a second buffer of the same size and one element
more: `stage()` writes state/|G| into it and the member's non-finite flag after it
(worker/dataplane/nonfinite.py), the collective sums it in place, and `commit()` re-points
the tensors at it (the old buffer becomes the next staging buffer), unless a member's flag
was set: then every member keeps its own state (a select on the device, no read-back).
A failed collective may still write into its buffer after the error (rule 4 of
docs/data-plane.md), so on failure the staging buffer is abandoned and the tensors, never
touched by the collective, keep the local values.

`schema()` lists the tensors (name, shape, dtype) in buffer order: the coordinator refuses
a worker whose schema differs from the others', so workers never average mismatched
buffers. `nonfinite()` names the first tensor that holds a NaN or an infinity.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.dataplane.nonfinite import nonfinite_flag, void_if_flagged

StateSlot = tuple[dict[str, Any], str]
"""(the optimizer's state dict of one parameter, a key in it) naming one state tensor."""

COUNTER_KEYS = frozenset({"step", "eta", "mu"})
"""Per-parameter scalars of PyTorch's optimizers that count or schedule (step counts;
ASGD's eta and mu): never averaged, even for a scalar parameter, whose moments share
their shape."""

FINGERPRINT_CHUNK_BYTES = 64 << 20
"""The model's bytes are hashed (and copied off a GPU) this many at a time."""


class AveragedState:
    """Owns the flat storage of a model's averaged tensors.

    Invariant: every averaged tensor, in the order `names` lists them, is a view into
    `self.flat`, the head of `self._storage` (one element longer: the slot a staging
    buffer's flag takes); `self.flat` is never handed to a collective (only the staging
    buffer is).
    """

    def __init__(self, model: torch.nn.Module, *, include_buffers: bool = True) -> None:
        buffers = ([(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
                   if include_buffers else [])
        self._build(list(model.named_parameters()), buffers)

    @classmethod
    def of_tensors(cls, params: list[tuple[str, torch.Tensor]],
                   buffers: list[tuple[str, torch.Tensor]]) -> AveragedState:
        """The averaged state of named tensors that are not a module's own (a sharded
        worker's mirror of its shards: worker/dataplane/shard_mirror.py)."""
        state = cls.__new__(cls)
        state._build(params, buffers)
        return state

    def _build(self, named: list[tuple[str, torch.Tensor]],
               buffers: list[tuple[str, torch.Tensor]]) -> None:
        if not named:
            raise ValueError("the model has no parameters to synchronise")
        self.params = [p for _, p in named]
        self.buffers: list[torch.Tensor] = [b for _, b in buffers]
        self.names = [f"param:{n}" for n, _ in named] + [f"buffer:{n}" for n, _ in buffers]
        self._param_names = [n for n, _ in named]
        tensors = [*self.params, *self.buffers]
        devices = {t.device for t in tensors}
        dtypes = {t.dtype for t in tensors}
        if len(devices) != 1 or len(dtypes) != 1:
            kinds = sorted({f"{t.dtype} on {t.device}" for t in tensors})
            raise ValueError(
                "Ripples averages one flat buffer: every parameter and floating-point buffer "
                f"must share one dtype and device, found {', '.join(kinds)}; convert the "
                "model with model.to(device, dtype) (autocast keeps low-precision compute)")
        self.slots: list[StateSlot] = []
        self._slot_labels: list[str] = []
        self._storage = self._allocate(sum(t.numel() for t in tensors))
        self.flat = self._storage[:-1]
        with torch.no_grad():
            self._point_views_at(self.flat, copy=True)
        self._staging: torch.Tensor | None = None
        """A storage of `self._storage`'s size: the flat state / |G| and the flag."""
        self._known_flag: torch.Tensor | None = None
        """The step's non-finite flag over `flat` as it is, computed by the step's gate,
        for the first synchronisation that stages it (`flag_known`, `take_flag`)."""

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def size_bytes(self) -> int:
        return self.numel * self.flat.element_size()

    @property
    def staged_bytes(self) -> int:
        """What one P-Reduce of this state feeds into its collective: the state and the
        non-finite flag (one element)."""
        return self._storage.numel() * self.flat.element_size()

    @property
    def model_numel(self) -> int:
        """Elements of the parameters and buffers: the head of `flat` (the optimizer's
        state tensors follow them), which a joiner copies from a donor (`copy_model`)."""
        return sum(t.numel() for t in [*self.params, *self.buffers])

    @property
    def num_model_tensors(self) -> int:
        """Parameters and buffers (the optimizer's state tensors follow them)."""
        return len(self.params) + len(self.buffers)

    def _allocate(self, numel: int) -> torch.Tensor:
        """A storage for `numel` values and the flag slot after them."""
        first = self.params[0]
        return torch.empty(numel + 1, dtype=first.dtype, device=first.device)

    def _tensors(self) -> list[torch.Tensor]:
        return [*(p.data for p in self.params), *(b.data for b in self.buffers),
                *(state[key] for state, key in self.slots)]

    def tensors(self) -> list[torch.Tensor]:
        """Every averaged tensor, in buffer order (views into `flat`)."""
        return self._tensors()

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
        model_views = views[: self.num_model_tensors]
        for t, view in zip([*self.params, *self.buffers], model_views, strict=True):
            t.data = view
        for (state, key), view in zip(self.slots, views[self.num_model_tensors :], strict=True):
            state[key] = view

    # ------------------------------------------------------------------ optimizer state
    def missing_optimizer_state(self, optimizer: torch.optim.Optimizer) -> str | None:
        """The first trainable parameter the optimizer holds but has no state for yet
        (state appears at a parameter's first applied step), or None when all have it."""
        names = {id(p): name for name, p in zip(self._param_names, self.params, strict=True)}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and not optimizer.state.get(p):
                    return names.get(id(p), "a parameter")
        return None

    def adopt_optimizer_state(self, optimizer: torch.optim.Optimizer) -> int:
        """Move the optimizer's per-parameter tensors into the flat buffer.

        Every floating tensor in `optimizer.state[p]` shaped like `p` (SGD's momentum
        buffer, Adam's exp_avg and exp_avg_sq; not scalars such as Adam's step) becomes a
        view into the buffer after the parameters and buffers, so a P-Reduce averages the
        group's update directions along with its models. PyTorch's optimizers look their
        state up by key at every step and update it in place, so they keep working on the
        views. Optimizers create state lazily: call after the first step, and again after
        `optimizer.load_state_dict` (which replaces the state tensors). Returns the number
        of tensors adopted.
        """
        slots = state_slots(optimizer, zip(self._param_names, self.params, strict=True),
                            self.params[0])
        return self.adopt_slots(slots)

    def adopt_slots(self, slots: list[tuple[str, StateSlot]]) -> int:
        """Move the named state tensors `slots` into the flat buffer, after the parameters
        and buffers (re-pointing each slot at its view); returns how many."""
        self.slots = [slot for _, slot in slots]
        self._slot_labels = [label for label, _ in slots]
        self._storage = self._allocate(sum(t.numel() for t in self._tensors()))
        self.flat = self._storage[:-1]
        with torch.no_grad():
            self._point_views_at(self.flat, copy=True)
        self._staging = self._known_flag = None
        return len(self.slots)

    # ------------------------------------------------------------------ collectives
    @contextlib.contextmanager
    def flag_known(self, flag: torch.Tensor | None) -> Iterator[None]:
        """While active, `flag` is this member's non-finite flag over `flat` as it is
        now (the step's gate computed it): the first synchronisation staged meanwhile
        takes it instead of summing the whole state once more (bench.preduce: that sum
        was most of what the flag cost a P-Reduce on the CPU). Whatever writes `flat`
        before that first stage forgets it (`forget_flag`); None: not known."""
        self._known_flag = flag
        try:
            yield
        finally:
            self._known_flag = None

    def take_flag(self) -> torch.Tensor:
        """This member's non-finite flag over `flat`: the known one once (a second
        synchronisation in the same step stages what the first left), else computed."""
        flag, self._known_flag = self._known_flag, None
        return flag if flag is not None else nonfinite_flag(self.flat)

    def forget_flag(self) -> None:
        """`flat` is about to change outside a stage/commit (a heal's copy)."""
        self._known_flag = None

    def stage(self, scale: float) -> torch.Tensor:
        """A buffer holding the flat state * scale and, last, this member's non-finite
        flag, ready for an in-place SUM collective (one element more than `flat`)."""
        if self._staging is None:
            self._staging = torch.empty_like(self._storage)
        with torch.no_grad():
            torch.mul(self.flat, scale, out=self._staging[:-1])
            self._staging[-1:].copy_(self.take_flag())
        return self._staging

    def commit(self) -> None:
        """Adopt the staged buffer (now holding the group average) as the state; where a
        member's flag was set (the group's sum of flags above 0), every member keeps its
        own values instead (decided on the device: no read-back)."""
        assert self._staging is not None, "commit() without stage()"
        staged = self._staging
        with torch.no_grad():
            void_if_flagged(staged[-1:], self.flat, staged[:-1])
        self._staging, self._storage = self._storage, staged
        self.flat = staged[:-1]
        self._point_views_at(self.flat, copy=False)

    def commit_late(self, snapshot: torch.Tensor) -> None:
        """Adopt the staged buffer's group average as the state at `snapshot` (what `flat`
        held when it was staged), keeping what changed since: flat += average − snapshot
        (a background P-Reduce, worker/dataplane/background.py). Where a member's flag
        was set, nothing changes. The staging buffer stays this state's; `snapshot` is
        left as it was."""
        assert self._staging is not None, "commit_late() without stage()"
        with torch.no_grad():
            change = self._staging[:-1].sub_(snapshot)
            void_if_flagged(self._staging[-1:], change.new_zeros(()), change)
            self.flat.add_(change)

    def abandon(self) -> None:
        """Forget the staging buffer after a failed collective; the state stays put."""
        self._staging = None

    # ------------------------------------------------------------------ checks
    def fingerprint(self) -> str:
        """A digest of the model's values (the parameters and buffers, not the optimizer
        state): equal for bit-identical models only, whatever the thread count or the
        order of a reduction (a sha256 of the bytes, FINGERPRINT_CHUNK_BYTES at a time,
        copied off a GPU chunk by chunk)."""
        values = self.flat[: self.model_numel].detach().view(torch.uint8)
        digest = hashlib.sha256()
        for start in range(0, values.numel(), FINGERPRINT_CHUNK_BYTES):
            chunk = values[start : start + FINGERPRINT_CHUNK_BYTES]
            digest.update(chunk.cpu().numpy().data if chunk.device.type != "cpu"
                          else chunk.numpy().data)
        return digest.hexdigest()

    def moved_away(self) -> str | None:
        """The name of a parameter that no longer lives in the flat buffer (the model was
        moved or converted after the state was built: `model.to(...)`, `model.half()`),
        else None. Checks the first and last parameter: such calls move them all."""
        start = self.flat.data_ptr()
        end = start + self.flat.numel() * self.flat.element_size()
        for index in (0, len(self.params) - 1):
            p = self.params[index]
            if p.device != self.flat.device or not start <= p.data_ptr() < end:
                return self._param_names[index]
        return None

    def nonfinite(self) -> str | None:
        """None when every averaged value is finite, else the name of the first tensor
        holding a NaN or an infinity. The fast path is one reduction (the sum of finite
        values is finite: an overflow of the sum would need values near 1e34); the
        tensor is looked for only when it fails. On a GPU this reads one scalar back."""
        if not bool(nonfinite_flag(self.flat).item()):
            return None
        names = [*self.names, *self.optimizer_state_labels()]
        for name, tensor in zip(names, self._tensors(), strict=True):
            if not bool(torch.isfinite(tensor).all()):
                return name
        return "an averaged tensor"  # the sum overflowed: no single value is non-finite

    def optimizer_state_labels(self) -> list[str]:
        """Names of the adopted optimizer state tensors: state:<parameter>.<key>."""
        return list(self._slot_labels)

    def schema(self) -> pb.TensorSchema:
        """The averaged tensors in buffer order, with a digest the coordinator compares."""
        return schema_of([
            pb.TensorSpec(name=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix(
                "torch.")) for name, t in zip([*self.names, *self.optimizer_state_labels()],
                                              self._tensors(), strict=True)])


def state_slots(optimizer: torch.optim.Optimizer,
                named: Iterable[tuple[str, torch.Tensor]],
                like: torch.Tensor) -> list[tuple[str, StateSlot]]:
    """The optimizer's per-parameter state tensors worth averaging, labelled
    state:<parameter>.<key>: every tensor in `optimizer.state[p]` shaped like `p`, of
    `like`'s dtype and device, that is no counter (COUNTER_KEYS)."""
    slots: list[tuple[str, StateSlot]] = []
    for name, p in named:
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if (key not in COUNTER_KEYS and isinstance(value, torch.Tensor)
                    and value.shape == p.shape
                    and value.dtype == like.dtype and value.device == like.device):
                slots.append((f"state:{name}.{key}", (state, key)))
    return slots


def schema_of(specs: list[pb.TensorSpec]) -> pb.TensorSchema:
    """These tensors as a schema, with the digest the coordinator compares."""
    digest = hashlib.sha256()
    for s in specs:
        digest.update(f"{s.name}|{list(s.shape)}|{s.dtype}\n".encode())
    return pb.TensorSchema(tensors=specs, digest=digest.hexdigest())


def bind_parameters(module: torch.nn.Module, flat: torch.Tensor) -> None:
    """Point `module`'s parameters at views into `flat`, laid out as AveragedState lays
    out an identically built module (parameters in order, back to back, first): how an
    LPP-SGD updater process shares its worker's model. The parameters' values become
    flat's."""
    params = list(module.parameters())
    numel = sum(p.numel() for p in params)
    if flat.numel() < numel or flat.dtype != params[0].dtype or flat.device != params[0].device:
        raise ValueError(f"a flat buffer of {flat.numel()} {flat.dtype} on {flat.device} cannot "
                         f"hold this model's {numel} {params[0].dtype} on {params[0].device}")
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
