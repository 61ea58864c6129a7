"""Synchronisation protocols, one module each. A new protocol adds its module and a line
to STRATEGIES; the compute loop and the other protocols stay untouched."""

from __future__ import annotations

import importlib

from ripples.worker.strategies.base import SyncContext, SyncResult, SyncStrategy, TrainingJob

# Protocol name -> "module:class" (imported lazily: DDP pulls in more of torch).
STRATEGIES: dict[str, str] = {
    "allreduce": "ripples.worker.strategies.allreduce:AllReduceStrategy",
    "ripples-random": "ripples.worker.strategies.ripples_gg:GroupGeneratorStrategy",
    "ripples-smart": "ripples.worker.strategies.ripples_gg:GroupGeneratorStrategy",
    "ripples-static": "ripples.worker.strategies.ripples_static:StaticScheduleStrategy",
    "adpsgd": "ripples.worker.strategies.gossip:GossipStrategy",
    "a2cid2": "ripples.worker.strategies.gossip:GossipStrategy",
    "hop": "ripples.worker.strategies.hop:HopStrategy",
    "lap-sgd": "ripples.worker.strategies.lpp:LppStrategy",
    "lpp-sgd": "ripples.worker.strategies.lpp:LppStrategy",
}


def create_strategy(protocol: str, ctx: SyncContext) -> SyncStrategy:
    """Instantiate the strategy of a protocol; ValueError for an unknown name."""
    spec = STRATEGIES.get(protocol)
    if spec is None:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(STRATEGIES)}")
    module_name, class_name = spec.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    strategy: SyncStrategy = cls(ctx)
    return strategy


__all__ = ["STRATEGIES", "SyncContext", "SyncResult", "SyncStrategy", "TrainingJob",
           "create_strategy"]
