"""The error the pure core raises for a request it refuses."""

from __future__ import annotations


class CoordinatorError(Exception):
    """A request the coordinator refuses; `code` names the gRPC status to return."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # INVALID_ARGUMENT | NOT_FOUND | FAILED_PRECONDITION
