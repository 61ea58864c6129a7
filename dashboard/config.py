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
    allowed_hosts: str = ""
    """Host names viewers may reach the dashboard by besides its IP addresses, localhost
    and this machine's name, comma-separated (a proxy's or a DNS name; * allows any):
    other names are refused against DNS rebinding."""
    sign_in_attempts: int = 5
    """Sign-in attempts one client address may make per --sign-in-window-seconds; past
    them it is refused (429) until the window allows another."""
    sign_in_window_seconds: float = 60.0
    """The window of --sign-in-attempts."""
    session_hours: float = 12.0
    """How long a browser stays signed in (the session cookie's lifetime)."""

    def __post_init__(self) -> None:
        parse_target(self.coordinator)  # ValueError says what a valid address looks like
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is out of range 0-65535")
        if not 0.05 <= self.poll_interval_seconds <= 60:
            raise ValueError("poll interval must be between 0.05 and 60 seconds")
        if self.rpc_timeout_seconds <= 0:
            raise ValueError("rpc timeout must be positive")
        if not 1 <= self.sign_in_attempts <= 1000:
            raise ValueError(f"--sign-in-attempts {self.sign_in_attempts} is out of range "
                             "1-1000")
        if not 0.001 <= self.sign_in_window_seconds <= 86400:
            raise ValueError(f"--sign-in-window-seconds {self.sign_in_window_seconds} is out "
                             "of range 0.001-86400 (a day)")
        if not 0.001 <= self.session_hours <= 24 * 365:
            raise ValueError(f"--session-hours {self.session_hours} is out of range "
                             "0.001-8760 (a year)")
        for name in self.host_names:
            if name != "*" and not name.replace("-", "").replace(".", "").isalnum():
                raise ValueError(f"--allowed-hosts: {name!r} is not a host name (give "
                                 "names separated by commas, e.g. dash.example.org,proxy)")

    @property
    def host_names(self) -> tuple[str, ...]:
        """--allowed-hosts as a tuple of names."""
        return tuple(n.strip() for n in self.allowed_hosts.split(",") if n.strip())
