"""lap-sgd and lpp-sgd: Hogwild updater processes per worker share its model, which is
averaged in the background (Chatterjee et al., "Scaling the Wild", arXiv:2203.06638)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ripples.protocols.group_generator.settings import GroupGeneratorSettings
from ripples.protocols.group_generator.spec import GROUPS_ROLE_RANDOM, GROUPS_ROLE_SMART
from ripples.protocols.lpp.settings import LppSettings
from ripples.protocols.spec import Coordination, Membership, ProtocolSpec, Role

if TYPE_CHECKING:
    from ripples.worker.protocol import Protocol


def _runtime() -> type[Protocol]:
    from ripples.protocols.lpp.runtime import LppProtocol

    return LppProtocol


_ALL = Role(coordination=Coordination.LOCKSTEP)
_IN_GROUPS = {"ripples-random": GROUPS_ROLE_RANDOM, "ripples-smart": GROUPS_ROLE_SMART}


def _role(lookup: Callable[[type[Any]], Any]) -> Role:
    """Averaging over all workers at once (the paper), or in the Group Generator's groups."""
    averaging = lookup(LppSettings).averaging
    return _ALL if averaging == "all" else _IN_GROUPS[averaging]


_FIXED = "a worker's updater processes share one model, which a joiner cannot heal"
_UPDATERS = "its workers are several updater processes sharing one whole model"
_OWN_AVERAGING = ("its updater processes average in the background every --sync-period "
                  "updates, outside ripples.Optimizer")

LAP_SGD = ProtocolSpec(
    name="lap-sgd", summary="LAP-SGD: Hogwild updaters, background averaging", role=_ALL,
    settings=(LppSettings, GroupGeneratorSettings), runtime=_runtime, library=False,
    role_from=_role, record_key="lpp", membership=Membership.RESTART, fixed_membership=_FIXED,
    no_local_steps=_OWN_AVERAGING, no_sharded_workers=_UPDATERS)
LPP_SGD = ProtocolSpec(
    name="lpp-sgd", summary="LPP-SGD: LAP-SGD with partial backpropagation", role=_ALL,
    settings=(LppSettings, GroupGeneratorSettings), runtime=_runtime, library=False,
    role_from=_role, record_key="lpp", membership=Membership.RESTART, fixed_membership=_FIXED,
    no_local_steps=_OWN_AVERAGING, no_sharded_workers=_UPDATERS)
