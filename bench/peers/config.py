"""What a peer run's launcher tells its workers, and the files they share."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ripples.bench.peers.progress import step_log_path
from ripples.files import write_atomically


@dataclass(frozen=True, kw_only=True)
class PeerWorkerConfig:
    """One worker's orders (the launcher writes them as JSON; the rank is its argument)."""

    peer: str
    """A name of PEERS (hivemind-local, hivemind-sync, torchft, torchft-diloco)."""
    settings: dict[str, Any]
    """The peer's knobs (PEERS[peer].defaults with the run's overrides)."""
    workload: str
    """A built-in task, or transformer-lm."""
    script_args: tuple[str, ...] = ()
    """The LM script's model arguments (the bench's, matrix.SCRIPT_WORKLOADS)."""
    num_workers: int
    seed: int
    batch_size: int
    max_epochs: float
    max_steps: int
    directory: str
    """The run's folder: step logs, ready marks, the stop file, models, rendezvous."""
    rendezvous: dict[str, str] = field(default_factory=dict)
    """How the peer system's processes find each other (the lighthouse's address, the
    file with the first DHT peer's addresses)."""
    slowdowns: dict[int, str] = field(default_factory=dict)
    """rank -> FACTOR[@PROBABILITY], as `ripples run --slowdown`."""
    start_timeout_seconds: float = 120.0
    until_stopped: bool = False
    """Train until the launcher's stop file, past the step cap (the fault scenario: the
    launcher counts the budget, a replacement's own count starts late)."""
    addresses: tuple[str, ...] = ()
    """Each rank's host address on a shaped network (ripples/netshape.py: every worker in
    a namespace of its own); empty: every worker on 127.0.0.1."""
    rank: int = 0
    incarnation: int = 0
    """0 for the run's workers; k > 0 for the k-th replacement of a killed rank."""

    @property
    def slowdown(self) -> str:
        return self.slowdowns.get(self.rank, "")

    @property
    def address(self) -> str:
        """Where this worker listens and what it announces to its peers."""
        return self.addresses[self.rank] if self.addresses else "127.0.0.1"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["slowdowns"] = {str(k): v for k, v in self.slowdowns.items()}
        d["script_args"] = list(self.script_args)
        d["addresses"] = list(self.addresses)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], *, rank: int, incarnation: int = 0) -> PeerWorkerConfig:
        d = {**d, "rank": rank, "incarnation": incarnation,
             "slowdowns": {int(k): v for k, v in d.get("slowdowns", {}).items()},
             "script_args": tuple(d.get("script_args", ())),
             "addresses": tuple(d.get("addresses", ()))}
        return cls(**d)


@dataclass(frozen=True)
class PeerRunFiles:
    """The files of one peer run's folder."""

    directory: Path

    @property
    def stop(self) -> Path:
        """Exists once the launcher stops the run (target reached, timeout)."""
        return self.directory / "stop"

    @property
    def config(self) -> Path:
        return self.directory / "worker-config.json"

    def step_log(self, rank: int) -> Path:
        return step_log_path(self.directory, rank)

    def model(self, rank: int) -> Path:
        return self.directory / f"model.rank{rank}.pt"

    def mark_ready(self, rank: int, incarnation: int) -> None:
        write_atomically(self.directory / f"ready.rank{rank}.{incarnation}",
                         f"{time.time()!r}\n".encode())

    def ready_times(self) -> dict[tuple[int, int], float]:
        """(rank, incarnation) -> when that worker was ready (time.time())."""
        out = {}
        for path in self.directory.glob("ready.rank*.*"):
            rank_text, _, incarnation = path.name.removeprefix("ready.rank").partition(".")
            try:
                out[(int(rank_text), int(incarnation))] = float(path.read_text())
            except ValueError:
                continue
        return out

    def ready_ranks(self) -> set[int]:
        return {rank for rank, incarnation in self.ready_times() if incarnation == 0}

    def rendezvous_file(self, name: str) -> Path:
        return self.directory / f"rendezvous.{name}"
