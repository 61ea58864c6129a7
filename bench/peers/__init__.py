"""Peer systems in `ripples bench --peers`: hivemind and torchft (its DDP and its DiLoCo)
on the bench's task.

They are optional (`pip install 'ripples[peers]'`): a peer whose package is missing is
skipped with a message naming the package. Each peer run is N worker processes of that
system (`ripples.bench.peers.worker`), launched and measured by
`ripples.bench.peers.launch` into the summary.json a `ripples run` writes, so the
harness reports both alike. docs/benchmarks.md says how each is set up and tuned.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from ripples.coordinator.config import OUTER_LR, OUTER_MOMENTUM


@dataclass(frozen=True, kw_only=True)
class PeerSpec:
    """A peer configuration of the matrix."""

    name: str
    package: str
    """The module it needs (`pip install 'ripples[peers]'` brings it)."""
    description: str
    defaults: dict[str, Any]
    """Its knobs as the tuning sweep found best (docs/benchmarks.md)."""
    sweep: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """The values `python -m ripples.bench.peers.sweep` tries, one knob at a time."""


DILOCO_DEFAULTS: dict[str, Any] = {"sync_every": 8, "outer_lr": OUTER_LR,
                                   "outer_momentum": OUTER_MOMENTUM}
"""torchft-diloco's H and outer optimizer, and the `allreduce-diloco` variant's
(bench/matrix.py): one source, so that the two rows run the same algorithm: Ripples'
own defaults for --outer-lr and --outer-momentum (coordinator/config.py says why its
momentum is 0.5, not DiLoCo's 0.9)."""

PEERS: dict[str, PeerSpec] = {p.name: p for p in (
    PeerSpec(
        name="hivemind-local", package="hivemind",
        description="hivemind.Optimizer, use_local_updates: a local step every step, "
                    "parameters averaged in the background once the peers together did "
                    "target_batch_size samples",
        defaults={"target_batch_size": 16384, "matchmaking_time": 1.0,
                  "averaging_timeout": 10.0},
        sweep={"target_batch_size": (1024, 4096, 16384), "matchmaking_time": (0.5, 1.0, 2.0)}),
    PeerSpec(
        name="hivemind-sync", package="hivemind",
        description="hivemind.Optimizer's default mode: gradients accumulated until the "
                    "peers did one batch each (target batch = workers x batch), averaged, "
                    "then one optimizer step",
        defaults={"matchmaking_time": 2.0, "averaging_timeout": 10.0},
        sweep={"matchmaking_time": (0.5, 1.0, 2.0)}),
    PeerSpec(
        name="torchft", package="torchft",
        description="torchft Manager with a lighthouse, its DistributedDataParallel: a "
                    "quorum and a gradient all-reduce every step (gloo)",
        defaults={"mode": "ddp", "join_timeout_ms": 10000, "quorum_tick_ms": 10,
                  "heartbeat_timeout_ms": 5000, "timeout_seconds": 10.0},
        sweep={"mode": ("ddp", "localsgd-4", "localsgd-16"),
               "join_timeout_ms": (100, 1000, 10000)}),
    PeerSpec(
        name="torchft-diloco", package="torchft",
        description="torchft.local_sgd.DiLoCo under a Manager with a lighthouse: "
                    "sync_every local steps of the task's optimizer, then a quorum, the "
                    "pseudo-gradients (anchor - parameters) averaged, and an outer Nesterov "
                    "SGD step on the anchor (Ripples' allreduce --local-steps H "
                    "--outer-optimizer nesterov)",
        defaults={**DILOCO_DEFAULTS, "join_timeout_ms": 10000, "quorum_tick_ms": 10,
                  "heartbeat_timeout_ms": 5000, "timeout_seconds": 10.0},
        sweep={"sync_every": (4, 8, 16), "outer_lr": (0.5, 0.7, 1.0),
               "outer_momentum": (0.5, 0.9)}),
)}


def missing_package(peer: str) -> str | None:
    """The package `peer` needs when it is not installed, else None."""
    package = PEERS[peer].package
    return None if importlib.util.find_spec(package) is not None else package
