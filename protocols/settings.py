"""The base of every protocol's settings: a typed, validated dataclass with its own message
in the proto.

A protocol that has knobs declares them in one keyword-only dataclass (its own file under
`ripples/protocols/`), whose field docstrings become the CLI help (ripples.cli.arguments). The
settings travel to the workers as a message of their own in `RunConfig` (`proto_field`
names it), never as fields of a shared class.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, Self

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

Limits = Mapping[str, tuple[float, float]]
"""Field -> inclusive (low, high): the value's range, or a text's length range."""

INT_HIGH = 2**31 - 1
"""An int field's default ceiling when no proto field carries it (coordinator-only)."""
FLOAT_HIGH = 1e9
"""A float field's default ceiling (every float option is a non-negative amount)."""
SECONDS_HIGH = 7 * 24 * 3600.0
"""A `*_seconds` field's ceiling: a week, past which a timeout or a lease is a typo."""
TEXT_CHARS = 1024
"""A text field's default longest length (a mode, a task's module:function, HOST:PORT)."""
_PROTO_INTS = {FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
               FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
               FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
               FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1)}
"""What each integer type of the proto can hold: a value past it cannot be sent."""


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
    sharded: bool = False
    """The run is a shard of a sharded job (it has a root)."""


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
    limits: ClassVar[dict[str, tuple[float, float]]] = {}
    """Field -> (low, high) where the defaults of `value_limits` are too wide."""

    def check_values(self) -> None:
        """Raise ValueError naming the first option of the wrong type or out of bounds
        (run before validate(), for every class, as every run sends them all)."""
        check_values(self, self._message_type().DESCRIPTOR, self.limits, self.cli_names)

    def validate(self) -> None:
        """Raise ValueError naming the option to fix."""

    def check_run(self, run: RunFacts) -> None:
        """Raise ValueError if these settings cannot serve this run (lpp: a budget)."""

    def no_sharded_workers(self) -> str:
        """Why these settings do not run on workers of several ranks, in the refusal's
        words; empty: they do (docs/library.md, "Models larger than one device")."""
        return ""

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


def value_limits(cls: type, message: Descriptor | None, explicit: Limits,
                 skip: Collection[str] = ()) -> dict[str, tuple[type, float, float]]:
    """Each init field of the dataclass `cls` with its type and inclusive bounds: those of
    `explicit`, else the range of the proto field of `message` that carries it (an int),
    else the defaults above. A new field is thus bounded without a word; one of a type
    this schema does not know raises TypeError naming it (tests/unit/test_run_options.py
    runs this on every class)."""
    hints = typing.get_type_hints(cls)
    found: dict[str, tuple[type, float, float]] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip:
            continue
        kind = hints[f.name]
        if kind not in (int, float, bool, str):
            raise TypeError(f"{cls.__name__}.{f.name}: a field of type {kind} has no bounds "
                            "(ripples/protocols/settings.py check_values knows int, float, "
                            "bool and str)")
        proto = message.fields_by_name.get(f.name) if message is not None else None
        if f.name in explicit:
            low, high = explicit[f.name]
        elif kind is int:
            low, high = _PROTO_INTS.get(proto.type, (0, INT_HIGH)) if proto else (0, INT_HIGH)
        elif kind is float:
            low, high = 0.0, SECONDS_HIGH if f.name.endswith("_seconds") else FLOAT_HIGH
        else:
            low, high = 0, TEXT_CHARS
        found[f.name] = (kind, low, high)
    return found


def check_values(settings: object, message: Descriptor | None, explicit: Limits,
                 names: Mapping[str, str] | None = None, skip: Collection[str] = ()) -> None:
    """Raise ValueError naming the first field of `settings` (by its option name in
    `names`) whose value is not strictly of its type (an int is no bool, str or float; a
    float is a finite int or float) or lies outside `value_limits`."""
    names = names or {}
    for field_name, (kind, low, high) in value_limits(type(settings), message, explicit,
                                                      skip).items():
        value = getattr(settings, field_name)
        name = names.get(field_name, field_name)
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        if kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {shown}")
            continue
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {shown}")
            if len(value) > high:
                raise ValueError(f"{name} must be at most {high:.0f} characters, got "
                                 f"{len(value)}")
            if any(c < " " or "\x7f" <= c <= "\x9f" for c in value):
                raise ValueError(f"{name} must not hold control characters, got {shown}")
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                kind is int and not isinstance(value, int)):
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{name} must be {what}, got {shown}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {shown}")
        if not low <= value <= high:
            bound = (lambda x: str(int(x))) if kind is int else (lambda x: f"{x:g}")
            side = f"at least {bound(low)}" if value < low else f"at most {bound(high)}"
            raise ValueError(f"{name} must be {side}, got {shown}")
