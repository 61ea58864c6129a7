"""ring-pairs' spec: its coordinator role (a group policy of its own), its runtime, its
simulated workers (the Group Generator's: they ask, wait, average and release as these
do), its dashboard hint."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ripples.protocols.spec import Coordination, ProtocolSpec, Role

if TYPE_CHECKING:
    from ripples.coordinator.policies import ClusterView
    from ripples.sim.worker_model import SimulatedWorkers
    from ripples.worker.protocol import Protocol


class NextInRing:
    """The initiator and the next live worker in id order (the first after the last)."""

    name = "next-in-ring"
    drain_to_own_group = True
    uses_straggler_bound = False

    def generate(self, initiator: int, view: ClusterView,
                 rng: random.Random) -> list[tuple[int, ...]]:
        live: Sequence[int] = view.live
        if len(live) < 2 or initiator not in view.live_set:
            return []
        return [(initiator, live[(list(live).index(initiator) + 1) % len(live)])]


def _policy(lookup: Callable[[type[Any]], Any]) -> NextInRing:
    return NextInRing()


def _runtime() -> type[Protocol]:
    from tests.throwaway_protocol.runtime import RingPairsRuntime

    return RingPairsRuntime


def _simulation() -> type[SimulatedWorkers]:
    from ripples.protocols.group_generator.sim import GroupWorkers

    return GroupWorkers


RING_PAIRS = ProtocolSpec(
    name="ring-pairs", summary="P-Reduce with the next worker in id order (a test's protocol)",
    role=Role(coordination=Coordination.GROUPS, label="next-in-ring", group_policy=_policy),
    runtime=_runtime, simulation=_simulation,
    groups_note="ring-pairs is a test's protocol: its pairs show here once they form")


def register() -> None:
    """The one line a real protocol adds to protocols/registry.py's list."""
    from ripples.protocols.registry import PROTOCOLS

    PROTOCOLS[RING_PAIRS.name] = RING_PAIRS
