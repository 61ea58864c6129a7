"""allreduce: PyTorch DDP over all workers, the baseline every benchmark compares with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ripples.protocols.spec import Coordination, Membership, ProtocolSpec, Role

if TYPE_CHECKING:
    from ripples.sim.worker_model import SimulatedWorkers
    from ripples.worker.protocol import Protocol


def _runtime() -> type[Protocol]:
    from ripples.protocols.allreduce.runtime import AllReduceProtocol

    return AllReduceProtocol


def _simulation() -> type[SimulatedWorkers]:
    from ripples.protocols.allreduce.sim import LockstepWorkers

    return LockstepWorkers


ALLREDUCE = ProtocolSpec(
    name="allreduce", summary="PyTorch DDP over all workers (the baseline)",
    role=Role(coordination=Coordination.LOCKSTEP), runtime=_runtime, simulation=_simulation,
    membership=Membership.RESTART,
    fixed_membership="every worker is in every all-reduce of DDP's backward pass",
    no_local_steps="",
    no_sharded_workers="its lock-step collectives over every worker are what FSDP2 with a "
                       "replicate dimension (HSDP) already does",
    groups_note="allreduce averages every worker's gradients in each backward pass, "
                "without the coordinator's groups")
