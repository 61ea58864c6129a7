"""The dashboard service's options (light: the CLI builds its parser from them without
importing the web stack)."""

from __future__ import annotations

from dataclasses import dataclass

from ripples.rpc import parse_target


@dataclass(kw_only=True)
class DashboardConfig:
    """The dashboard service."""

    coordinator: str
    """Coordinator address, HOST:PORT."""
    host: str = "127.0.0.1"
    """Interface to listen on (0.0.0.0 to reach it from other machines)."""
    port: int = 8080
    """HTTP port of the page and the API (0: any free port)."""
    poll_interval_seconds: float = 0.5
    """How often the dashboard asks the coordinator for the run status."""
    rpc_timeout_seconds: float = 2.0
    """Deadline of one status request; past it the coordinator shows as disconnected."""

    def __post_init__(self) -> None:
        parse_target(self.coordinator)  # ValueError says what a valid address looks like
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is out of range 0-65535")
        if not 0.05 <= self.poll_interval_seconds <= 60:
            raise ValueError("poll interval must be between 0.05 and 60 seconds")
        if self.rpc_timeout_seconds <= 0:
            raise ValueError("rpc timeout must be positive")
