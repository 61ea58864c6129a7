"""A group's synchronisation, whichever state the run averages: the members' models
(P-Reduce, worker/dataplane/preduce.py) or, with an outer optimizer, their outer steps
(worker/dataplane/outer_state.py). The group runtimes call these, so that they never ask
which one the run keeps.
"""

from __future__ import annotations

from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.dataplane.outer_state import OuterState, outer_preduce
from ripples.worker.dataplane.preduce import copy_model, preduce


def average_in_group(state: AveragedState, outer: OuterState | None, comm: Communicator,
                     timeout_seconds: float) -> None:
    """A group's synchronisation: with an outer optimizer the members' outer steps
    (`outer_preduce`), otherwise their models (P-Reduce)."""
    if outer is None:
        preduce(state, comm, timeout_seconds)
    else:
        outer_preduce(outer, comm, timeout_seconds)


def group_bytes(state: AveragedState, outer: OuterState | None) -> int:
    """What a member feeds into `average_in_group`'s collective."""
    return state.staged_bytes if outer is None else outer.sent_bytes()


def heal_in_group(state: AveragedState, outer: OuterState | None, comm: Communicator,
                  donor: int, timeout_seconds: float) -> None:
    """A heal group: the joiner copies the donor's model; with an outer optimizer, its
    anchor and momentum, and the model becomes the donor's anchor (`OuterState.heal`)."""
    if outer is None:
        copy_model(state, comm, donor, timeout_seconds)
    else:
        outer.heal(comm, donor, state.model_numel, timeout_seconds)
