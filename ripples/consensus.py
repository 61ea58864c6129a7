"""The consensus model mid-run (`ripples checkpoint`, the Runs.Consensus RPC): the average
of the live workers' models, which each publishes at its next step boundary through the
rendezvous store.

Why through the store and not a collective among the workers: a collective would need
every worker at one point of its loop at once, so the fastest would wait for the slowest
(and a group protocol's worker waiting there could hold up a P-Reduce group its peer is
already in). Publishing costs each worker one serialisation of its model, taken between
two steps by its own training thread, and never a wait; the models are then those of a
few steps apart, as `ripples run`'s final average of the saved models is.

The coordinator only moves bytes: it streams each published model, as the worker
encoded it, to the client that asked, which averages them (`RunningAverage`, one model
at a time: the client holds the running mean, the running squared deviations and one
model, whatever the number of workers). The coordinator never decodes a tensor.

torch is imported by the functions that need it, so that the coordinator, which only
names the store keys, imports none of it here.
"""

from __future__ import annotations

import io
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KEY_PREFIX = "ripples/consensus"
"""Worker w publishes its model for request k under KEY_PREFIX/k/w (under the round's
prefix, g<generation>/, after a lock-step restart round)."""
CHUNK_BYTES = 1 << 20
"""Models stream in chunks of this size (gRPC's default message limit is 4 MB)."""


def publish_key(consensus_id: int, worker_id: int) -> str:
    return f"{KEY_PREFIX}/{consensus_id}/{worker_id}"


def encode_model(iteration: int, state_dict: dict[str, torch.Tensor]) -> bytes:
    """A worker's contribution: its iteration and its state_dict on the CPU, each tensor
    at its own size (a view into a larger buffer is copied)."""
    import torch

    from ripples.state_dicts import compact_on_cpu

    buffer = io.BytesIO()
    torch.save({"iteration": iteration, "model": compact_on_cpu(dict(state_dict))}, buffer)
    return buffer.getvalue()


@dataclass
class RunningAverage:
    """The average of published models, added one at a time (Welford's update in
    float64): floating-point tensors are averaged, the others (BatchNorm's batch counters)
    taken from the first model; `consensus_distance` is the mean over the models of the
    squared distance of their floating-point tensors (those named in `distance_over`,
    if given) to the average."""

    distance_over: Collection[str] | None = None
    iterations: list[int] = field(default_factory=list)
    """Each model's iteration when its worker published it, in the order added."""
    _mean: dict[str, Any] = field(default_factory=dict)
    _squares: dict[str, Any] = field(default_factory=dict)
    _dtypes: dict[str, Any] = field(default_factory=dict)

    def add(self, blob: bytes) -> None:
        """Add one published model (encode_model's bytes); ValueError if it is not of the
        same model as the first (keys or shapes differ)."""
        import torch

        loaded = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        self.add_state_dict(loaded["model"], int(loaded["iteration"]))

    def add_state_dict(self, model: dict[str, torch.Tensor], iteration: int = 0) -> None:
        """Add one model's state_dict (see `add`)."""
        import torch

        if self.iterations and (model.keys() != self._mean.keys() or any(
                model[k].shape != self._mean[k].shape for k in model)):
            raise ValueError(f"the models of the first and of worker #{len(self.iterations)} "
                             "differ (keys or shapes): not one model")
        n = len(self.iterations) + 1
        for name, tensor in model.items():
            if n == 1:
                self._dtypes[name] = tensor.dtype
                floating = tensor.is_floating_point()
                self._mean[name] = tensor.double() if floating else tensor.clone()
                if floating and (self.distance_over is None or name in self.distance_over):
                    self._squares[name] = torch.zeros_like(self._mean[name])
                continue
            if not self._dtypes[name].is_floating_point:
                continue
            x = tensor.double()
            delta = x - self._mean[name]
            self._mean[name] += delta / n
            if name in self._squares:
                self._squares[name] += delta * (x - self._mean[name])
        self.iterations.append(iteration)

    @property
    def consensus_distance(self) -> float:
        n = len(self.iterations)
        return sum(float(s.sum()) for s in self._squares.values()) / n if n else 0.0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average, each tensor in its models' dtype; ValueError before any model."""
        if not self.iterations:
            raise ValueError("no model to average")
        return {name: mean.to(self._dtypes[name]) for name, mean in self._mean.items()}


def average_state_dicts(models: list[dict[str, torch.Tensor]],
                        distance_over: Collection[str] | None = None
                        ) -> tuple[dict[str, torch.Tensor], float]:
    """The average of state dicts of one model and their consensus distance, as
    RunningAverage makes them (`ripples run`'s average of the workers' saved models)."""
    average = RunningAverage(distance_over=distance_over)
    for model in models:
        average.add_state_dict(model)
    return average.state_dict(), average.consensus_distance
