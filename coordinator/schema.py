"""Workers must average the same tensors: the first schema a run sees is its reference, and
a worker whose schema differs is refused, naming the first difference (pure code).

A schema lists the averaged tensors in the order of the flat buffer: name, shape, dtype.
Workers send a digest with it; equal digests are taken as equal schemas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TensorSpec = tuple[str, tuple[int, ...], str]
"""(name, shape, dtype) of one averaged tensor."""


@dataclass(frozen=True, kw_only=True)
class Schema:
    tensors: tuple[TensorSpec, ...]
    digest: str


def _describe(spec: TensorSpec) -> str:
    name, shape, dtype = spec
    return f"'{name}' {dtype} [{', '.join(map(str, shape))}]"


def first_difference(reference: Sequence[TensorSpec], candidate: Sequence[TensorSpec]
                     ) -> str | None:
    """Where `candidate` first differs from `reference`, in words; None if they match."""
    for index, (ref, cand) in enumerate(zip(reference, candidate, strict=False)):
        if ref != cand:
            return f"tensor {index} is {_describe(cand)} here but {_describe(ref)} there"
    if len(candidate) > len(reference):
        return (f"it has {len(candidate) - len(reference)} tensor(s) more, from tensor "
                f"{len(reference)}: {_describe(candidate[len(reference)])}")
    if len(candidate) < len(reference):
        return (f"it lacks {len(reference) - len(candidate)} tensor(s), from tensor "
                f"{len(candidate)}: {_describe(reference[len(candidate)])}")
    return None


class SchemaCheck:
    """The reference schema of one stage (the model at the start; the model with the
    optimizer state once that exists) and who set it."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.reference: Schema | None = None
        self.reference_owner = ""

    def check(self, schema: Schema, owner: str) -> str | None:
        """None if `schema` matches the reference (the first one seen becomes it); else
        why not, naming both workers."""
        if self.reference is None:
            self.reference, self.reference_owner = schema, owner
            return None
        if schema.digest == self.reference.digest:
            return None
        difference = first_difference(self.reference.tensors, schema.tensors)
        if difference is None:  # same tensors, other digest: a worker of another version
            difference = "the same tensors hash differently (another Ripples version?)"
        return (f"{owner} averages other tensors ({self.stage}) than {self.reference_owner}: "
                f"{difference}; every worker must build the same model and optimizer")
