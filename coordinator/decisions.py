"""What the coordinator tells a worker waiting for the reply to its group request.

Plain data shared by the group service that decides, the gRPC service that answers, and
the simulated workers that act on the answers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ripples.coordinator.groups import GroupRecord


class Outcome(enum.Enum):
    GROUP = "group"
    """A group to average in (delivered when every member has asked for it)."""
    STOP = "stop"
    """The run stopped."""
    CANCELLED = "cancelled"
    """The group it waited on was cancelled (a member left, or the members' tensors
    differ); it trains on."""
    NO_GROUP = "no_group"
    """No group for it now (no eligible peer); it trains on and asks again later."""
    RETRY = "retry"
    """The server-side wait ran out: ask again."""


@dataclass(kw_only=True)
class GroupDecision:
    """What a worker waiting for the reply to its group request is told."""

    outcome: Outcome
    group: GroupRecord | None = None
    more: bool = False
    """More groups of its round follow: ask again at once."""
    evictions: list[int] = field(default_factory=list)
    """Communicator ids it must drop first."""
    detail: str = ""


Deliveries = dict[int, GroupDecision]
"""Worker id -> the decision for it that an event completed."""
