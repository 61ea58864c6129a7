"""The base of every protocol's settings: a typed, validated dataclass with its own message
in the proto.

A protocol that has knobs declares them in one keyword-only dataclass (its own file under
`ripples/protocols/`), whose field docstrings become the CLI help (ripples.cli.arguments). The
settings travel to the workers as a message of their own in `RunConfig` (`proto_field`
names it), never as fields of a shared class.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self

from google.protobuf.message import Message


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a protocol family's settings may check against the rest of a run."""

    protocol: str
    policy: str
    """The label of the coordinator's group policy or pairing (Role.label)."""
    task: str
    """The built-in task; empty for a user's script."""
    iterations: int
    epochs: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopologyFacts:
    """What a protocol family's settings may check of the run's graph."""

    name: str
    num_workers: int
    bipartite: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProtocolSettings:
    """Settings of one protocol family. Subclasses are frozen keyword-only dataclasses."""

    proto_field: ClassVar[str] = ""
    """The field of `ripples.v1.RunConfig` that carries these settings."""
    cli_names: ClassVar[dict[str, str]] = {}
    """Field -> option name where the flag is not the field's name (`mode` -> `hop_mode`
    gives --hop-mode): every flag of `ripples run` is unique across protocols."""

    def validate(self) -> None:
        """Raise ValueError naming the option to fix."""

    def check_run(self, run: RunFacts) -> None:
        """Raise ValueError if these settings cannot serve this run (lpp: a budget)."""

    def check_topology(self, run: RunFacts, topology: TopologyFacts) -> None:
        """Raise ValueError if the run cannot use this graph (adpsgd's bipartite mode)."""

    def to_proto(self) -> Message:
        """These settings as their RunConfig message."""
        message = self._message_type()()
        for f in dataclasses.fields(self):
            setattr(message, f.name, getattr(self, f.name))
        return message

    @classmethod
    def from_proto(cls, message: Any) -> Self:
        """Read them back from their RunConfig message (unset fields keep the defaults of
        the message, so a coordinator must always send them; it does)."""
        return cls(**{f.name: getattr(message, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def of_config(cls, config: Any) -> Self:
        """From a run's `RunConfig` message."""
        return cls.from_proto(getattr(config, cls.proto_field))

    @classmethod
    def _message_type(cls) -> type[Message]:
        from ripples.v1 import coordinator_pb2 as pb

        descriptor = pb.RunConfig.DESCRIPTOR.fields_by_name[cls.proto_field].message_type
        message_type: type[Message] = getattr(pb, descriptor.name)
        return message_type
