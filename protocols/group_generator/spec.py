"""ripples-random and ripples-smart: P-Reduce in the groups the coordinator's Group
Generator forms when a worker asks (the Ripples paper, §4-§5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ripples.coordinator.policies import RandomPolicy, SmartPolicy
from ripples.protocols.group_generator.settings import GroupGeneratorSettings
from ripples.protocols.spec import Coordination, ProtocolSpec, Role

if TYPE_CHECKING:
    from ripples.sim.worker_model import SimulatedWorkers
    from ripples.worker.protocol import Protocol


def _runtime() -> type[Protocol]:
    from ripples.protocols.group_generator.runtime import GroupGeneratorProtocol

    return GroupGeneratorProtocol


def _simulation() -> type[SimulatedWorkers]:
    from ripples.protocols.group_generator.sim import GroupWorkers

    return GroupWorkers


def _random_groups(lookup: Callable[[type[Any]], Any]) -> RandomPolicy:
    return RandomPolicy(group_size=lookup(GroupGeneratorSettings).group_size)


def _smart_groups(lookup: Callable[[type[Any]], Any]) -> SmartPolicy:
    settings: GroupGeneratorSettings = lookup(GroupGeneratorSettings)
    return SmartPolicy(group_size=settings.group_size, c_thres=settings.c_thres,
                       inter_intra=settings.inter_intra)


GROUPS_ROLE_RANDOM = Role(coordination=Coordination.GROUPS, label="random",
                          group_policy=_random_groups)
GROUPS_ROLE_SMART = Role(coordination=Coordination.GROUPS, label="smart",
                         group_policy=_smart_groups)
"""The roles, also for protocols that average in these groups (lap-sgd, lpp-sgd)."""

_GROUPS = "P-Reduce in groups of the Group Generator"

RIPPLES_RANDOM = ProtocolSpec(
    name="ripples-random", summary=f"{_GROUPS}: random groups", role=GROUPS_ROLE_RANDOM,
    settings=(GroupGeneratorSettings,), runtime=_runtime, simulation=_simulation,
    shardable=True, no_local_steps="", no_sharded_workers="")
RIPPLES_SMART = ProtocolSpec(
    name="ripples-smart", summary=f"{_GROUPS}: smart groups (slowdown filter)",
    role=GROUPS_ROLE_SMART, settings=(GroupGeneratorSettings,), runtime=_runtime,
    simulation=_simulation, shardable=True, no_local_steps="", no_sharded_workers="")
