"""The consensus model mid-run (`ripples checkpoint`, the Consensus RPC), shared by the
workers and the coordinator: the average of the live workers' models, which each
publishes at its next step boundary through the rendezvous store.

Why through the store and not a collective among the workers: a collective would need
every worker at one point of its loop at once, so the fastest would wait for the slowest
(and a group protocol's worker waiting there could hold up a P-Reduce group its peer is
already in). Publishing costs each worker one serialisation of its model, taken between
two steps by its own training thread, and never a wait; the models are then those of a
few steps apart, as `ripples run`'s final average of the saved models is. The
coordinator holds one copy per worker while it averages: meant for models of up to a few
hundred MB (docs/fault-tolerance.md, "The consensus model on a cluster").
"""

from __future__ import annotations

import io
from collections.abc import Collection
from dataclasses import dataclass

import torch

KEY_PREFIX = "ripples/consensus"
"""Worker w publishes its model for request k under KEY_PREFIX/k/w (under the round's
prefix, g<generation>/, after a lock-step restart round)."""
CHUNK_BYTES = 1 << 20
"""The average streams back in chunks of this size (gRPC's default limit is 4 MB)."""


def publish_key(consensus_id: int, worker_id: int) -> str:
    return f"{KEY_PREFIX}/{consensus_id}/{worker_id}"


def encode_model(iteration: int, state_dict: dict[str, torch.Tensor]) -> bytes:
    """A worker's contribution: its iteration and a CPU copy of its state_dict."""
    buffer = io.BytesIO()
    torch.save({"iteration": iteration,
                "model": {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}},
               buffer)
    return buffer.getvalue()


@dataclass(frozen=True)
class Average:
    data: bytes
    """The average, a torch.save'd state_dict (floating-point tensors averaged; others,
    such as BatchNorm's batch counters, taken from the first worker)."""
    iterations: list[int]
    consensus_distance: float
    """Mean over the workers of the squared distance of their floating-point tensors to
    the average."""


def average_models(blobs: list[bytes]) -> Average:
    """Average the workers' published models (ValueError: they are not of one model)."""
    if not blobs:
        raise ValueError("no model to average")
    loaded = [torch.load(io.BytesIO(b), map_location="cpu", weights_only=True) for b in blobs]
    models: list[dict[str, torch.Tensor]] = [m["model"] for m in loaded]
    first = models[0]
    for i, other in enumerate(models[1:], start=1):
        if other.keys() != first.keys() or any(
                other[k].shape != first[k].shape for k in first):
            raise ValueError(f"the models of the first and of worker #{i} differ (keys or "
                             "shapes): not one model")
    average, distance = average_state_dicts(models)
    buffer = io.BytesIO()
    torch.save(average, buffer)
    return Average(data=buffer.getvalue(), iterations=[int(m["iteration"]) for m in loaded],
                   consensus_distance=distance)


def average_state_dicts(models: list[dict[str, torch.Tensor]],
                        distance_over: Collection[str] | None = None
                        ) -> tuple[dict[str, torch.Tensor], float]:
    """The average of state dicts of one model (floating-point tensors averaged in float64,
    others taken from the first) and the consensus distance: the mean over the models of
    the squared distance of the tensors named in `distance_over` (default: every
    floating-point one) to the average."""
    first = models[0]
    average: dict[str, torch.Tensor] = {}
    squared = 0.0
    for name, tensor in first.items():
        if not tensor.is_floating_point():
            average[name] = tensor.clone()
            continue
        stacked = torch.stack([m[name].double() for m in models])
        mean = stacked.mean(dim=0)
        if distance_over is None or name in distance_over:
            squared += float(((stacked - mean) ** 2).sum())
        average[name] = mean.to(tensor.dtype)
    return average, squared / len(models)
