"""Where a worker process stands, as its launcher tells it through the environment.

`ripples.init()` reads one of these, first match wins for each value:

- Ripples' own launchers (`ripples run`, `ripples worker run --nproc-per-node`) and any
  deployment: `RIPPLES_COORDINATOR` (HOST:PORT; without it the process trains alone,
  single-process mode) and `RIPPLES_*` settings of the worker (below);
- torchrun (and Kubeflow's PyTorchJob running torchrun): `RANK`, `WORLD_SIZE`,
  `LOCAL_RANK`, `LOCAL_WORLD_SIZE`;
- SLURM (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`
  and the node name `SLURMD_NODENAME`;
- Kubeflow's PyTorchJob without torchrun: `PET_NODE_RANK`, `PET_NNODES`,
  `PET_NPROC_PER_NODE`.

The launcher's rank is a hint only: the coordinator numbers a run's workers itself, by
host name and local rank (so workers on one host are neighbours in rank). What matters
from the launcher is where this process is: its host and its local rank, which picks its
device (`cuda:<local rank>` when CUDA is available).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from ripples.rpc import parse_target

ENV_COORDINATOR = "RIPPLES_COORDINATOR"
ENV_RUN_ID = "RIPPLES_RUN_ID"

_RIPPLES_VARIABLES = {
    "host": "RIPPLES_HOST",
    "device": "RIPPLES_DEVICE",
    "num_threads": "RIPPLES_NUM_THREADS",
    "metrics_port": "RIPPLES_METRICS_PORT",
    "metrics_bind": "RIPPLES_METRICS_BIND",
    "metrics_host": "RIPPLES_METRICS_HOST",
    "save_model": "RIPPLES_SAVE_MODEL",
    "save_record": "RIPPLES_SAVE_RECORD",
    "slowdown": "RIPPLES_SLOWDOWN",
    "connect_timeout_seconds": "RIPPLES_CONNECT_TIMEOUT_SECONDS",
    "start_timeout_seconds": "RIPPLES_START_TIMEOUT_SECONDS",
    "run_id": ENV_RUN_ID,
    "ranks_per_worker": "RIPPLES_RANKS_PER_WORKER",
    "replica_rank": "RIPPLES_REPLICA_RANK",
    "replica_address": "RIPPLES_REPLICA_ADDRESS",
}
"""LaunchEnv field -> the environment variable that sets it."""

_CHECKPOINT_VARIABLES = {
    "checkpoint_dir": "RIPPLES_CHECKPOINT_DIR",
    "checkpoint_every": "RIPPLES_CHECKPOINT_EVERY",
    "keep_checkpoints": "RIPPLES_KEEP_CHECKPOINTS",
}
"""CheckpointOptions field -> the environment variable that sets it."""


@dataclass(frozen=True, kw_only=True)
class CheckpointInterval:
    """How often a worker checkpoints: every `steps` optimizer steps, or every `seconds`
    (at the first step boundary after they passed); neither: only on demand and when the
    run stops."""

    steps: int = 0
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str | int | None) -> CheckpointInterval:
        """"500" or 500 (steps), "90s" (seconds), 0 or None (none); ValueError saying
        what to write."""
        if text is None:
            return cls()
        value = str(text).strip().lower()
        try:
            if value.endswith("s"):
                seconds = float(value[:-1])
                if not 0 <= seconds < math.inf:
                    raise ValueError
                return cls(seconds=seconds)
            steps = int(value)
            if steps < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"checkpoint interval {text!r}: give a step count (500), seconds "
                             "(90s), or 0 for no periodic checkpoints") from None
        return cls(steps=steps)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Where and how often every worker saves its checkpoints (ripples.Checkpointer reads
    them from the launch environment). The flags of `ripples run` and `ripples worker
    run`; each travels to the workers as the variable named in its help."""

    checkpoint_dir: str = ""
    """Directory of the workers' checkpoints, DIR/rank-R/step-S.pt
    (RIPPLES_CHECKPOINT_DIR). A worker that finds checkpoints of its rank there resumes
    from the newest. Empty: no checkpoints."""
    checkpoint_every: str = "500"
    """Checkpoint every N optimizer steps, or every Ns seconds, e.g. 90s (seconds are
    refused by lock-step protocols, whose workers must all save the same steps); 0: only
    when the run stops (RIPPLES_CHECKPOINT_EVERY)."""
    keep_checkpoints: int = 3
    """How many of its newest checkpoints each worker keeps (RIPPLES_KEEP_CHECKPOINTS)."""

    @property
    def interval(self) -> CheckpointInterval:
        return CheckpointInterval.parse(self.checkpoint_every)

    def environment(self) -> dict[str, str]:
        """The variables that hand these options to a worker process (none without a
        directory: no checkpoints)."""
        if not self.checkpoint_dir:
            return {}
        return {variable: str(getattr(self, name))
                for name, variable in _CHECKPOINT_VARIABLES.items()}

    def flags(self) -> list[str]:
        """These options as `ripples worker run` flags (none without a directory)."""
        if not self.checkpoint_dir:
            return []
        return [item for name in _CHECKPOINT_VARIABLES
                for item in (f"--{name.replace('_', '-')}", str(getattr(self, name)))]

    def validate(self) -> None:
        """ValueError naming the flag and the variable of a malformed option."""
        try:
            self.interval  # noqa: B018 (parsing is the check)
        except ValueError as err:
            raise ValueError(f"{err} (from --checkpoint-every or "
                             f"{_CHECKPOINT_VARIABLES['checkpoint_every']})") from None
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {self.keep_checkpoints} "
                             f"(from --keep-checkpoints or "
                             f"{_CHECKPOINT_VARIABLES['keep_checkpoints']})")


def default_host(environ: Mapping[str, str] | None = None) -> str:
    """This node's name when none is given: SLURM's node name under srun, else the host
    name (what workers of one node share)."""
    env = os.environ if environ is None else environ
    return env.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """One worker process's place in a launch. Every field is documented once, here."""

    coordinator: str = ""
    """Coordinator address HOST:PORT (RIPPLES_COORDINATOR); empty: single-process mode."""
    launcher: str = "none"
    """What started the process: ripples, torchrun, slurm, kubeflow or none."""
    rank: int = 0
    """The launcher's global rank of this process (a hint; Ripples ranks its workers)."""
    world_size: int = 1
    """Processes the launcher started in all."""
    local_rank: int = 0
    """Index of this process on its host: picks the device and the host slot."""
    local_world_size: int = 1
    """Processes the launcher started on this host."""
    host: str = ""
    """Node name reported to the coordinator (RIPPLES_HOST; default SLURMD_NODENAME or the
    host name); workers with one host name form a node."""
    device: str = ""
    """torch device (RIPPLES_DEVICE; default cuda:<local rank> when CUDA is available,
    else cpu)."""
    num_threads: int = 0
    """torch intra-op threads (RIPPLES_NUM_THREADS; 0: leave torch's default)."""
    metrics_port: int = 0
    """Port of this worker's Prometheus endpoint (RIPPLES_METRICS_PORT; 0: any free port;
    -1: none)."""
    metrics_bind: str = "0.0.0.0"
    """Interface the metrics endpoint listens on (RIPPLES_METRICS_BIND)."""
    metrics_host: str = ""
    """Address Prometheus scrapes this worker at (RIPPLES_METRICS_HOST; default: the
    address the coordinator sees it connect from)."""
    save_model: str = ""
    """Write the final model's state_dict here at the end (RIPPLES_SAVE_MODEL; the
    launcher averages them into the consensus model)."""
    save_record: str = ""
    """Write this worker's record of the run here (RIPPLES_SAVE_RECORD, JSON)."""
    slowdown: str = ""
    """Straggler injection for experiments (RIPPLES_SLOWDOWN): FACTOR or
    FACTOR@PROBABILITY."""
    connect_timeout_seconds: float = 30.0
    """How long to wait for the coordinator to be reachable."""
    start_timeout_seconds: float = 120.0
    """How long to wait for the other workers to register, and to be ready."""
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    """Where and how often ripples.Checkpointer saves (RIPPLES_CHECKPOINT_DIR,
    RIPPLES_CHECKPOINT_EVERY, RIPPLES_KEEP_CHECKPOINTS)."""
    run_id: str = ""
    """The run this process was started for (RIPPLES_RUN_ID, set by a host agent): a
    coordinator serving another run refuses it. Empty: whichever run is active."""
    ranks_per_worker: int = 1
    """Processes that make up one worker (RIPPLES_RANKS_PER_WORKER): G > 1 shards the
    worker's model over its G ranks with FSDP2 (worker/replica.py). 1: one process holds
    the whole model."""
    replica_rank: int = -1
    """This process's index among its worker's ranks (RIPPLES_REPLICA_RANK; -1: the
    launcher's rank modulo ranks_per_worker). Rank 0 talks to the coordinator."""
    replica_address: str = ""
    """HOST:PORT where the worker's ranks meet to form their process group
    (RIPPLES_REPLICA_ADDRESS, set by Ripples' launchers: rank 0 serves it). Empty: the
    launcher's MASTER_ADDR and MASTER_PORT (torchrun), where the ranks of every worker
    of the launch form one process group each, ranks_per_worker consecutive ranks apart."""

    @property
    def sharded(self) -> bool:
        """This worker is several processes (ranks_per_worker > 1)."""
        return self.ranks_per_worker > 1

    @property
    def worker_rank(self) -> int:
        """This process's index among its worker's ranks (0: the one that talks to the
        coordinator)."""
        if self.replica_rank >= 0:
            return self.replica_rank
        return self.rank % self.ranks_per_worker

    @property
    def distributed(self) -> bool:
        return bool(self.coordinator)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """Read the launch environment; ValueError naming a malformed variable."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {"coordinator": env.get(ENV_COORDINATOR, "").strip()}
        values.update(_launcher_values(env))
        for name, variable in _RIPPLES_VARIABLES.items():
            if env.get(variable, "") != "":
                kind = type(getattr(cls, name))
                values[name] = _parse(env, variable, kind)
        values["checkpoint"] = CheckpointOptions(**{  # type: ignore[arg-type]
            name: _parse(env, variable, type(getattr(CheckpointOptions, name)))
            for name, variable in _CHECKPOINT_VARIABLES.items() if env.get(variable, "") != ""})
        if values["coordinator"] and values.get("launcher", "none") == "none":
            values["launcher"] = "ripples"
        if not values.get("host"):
            values["host"] = default_host(env)
        launch = cls(**values)  # type: ignore[arg-type]
        launch.validate()
        return launch

    def replace(self, **changes: object) -> LaunchEnv:
        """A copy with the given fields set (None leaves a field as it is)."""
        given = {k: v for k, v in changes.items() if v is not None}
        launch = dataclasses.replace(self, **given)  # type: ignore[arg-type]
        launch.validate()
        return launch

    def validate(self) -> None:
        if self.local_rank < 0 or self.rank < 0:
            raise ValueError("ranks must not be negative")
        if self.world_size < 1 or self.local_world_size < 1:
            raise ValueError("world sizes must be at least 1")
        if self.num_threads < 0:
            raise ValueError("num_threads must not be negative")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port {self.metrics_port} is out of range: give 0-65535, "
                             "or -1 for no metrics endpoint")
        self.checkpoint.validate()
        self._validate_ranks_per_worker()
        if self.coordinator:
            try:
                parse_target(self.coordinator)
            except ValueError as err:
                raise ValueError(f"{err} (from --coordinator or {ENV_COORDINATOR})") from None
        if not self.coordinator and self.world_size > max(1, self.ranks_per_worker):
            raise ValueError(
                f"this process is rank {self.rank} of {self.world_size} started by "
                f"{self.launcher}, but {ENV_COORDINATOR} is not set: start a coordinator "
                f"(`ripples coordinator serve --workers {self.world_size} ...`) and export "
                f"{ENV_COORDINATOR}=HOST:PORT, or run one process alone (single-process mode)")


    def _validate_ranks_per_worker(self) -> None:
        g = self.ranks_per_worker
        if g < 1:
            raise ValueError(f"ranks_per_worker must be at least 1, got {g} "
                             "(from --ranks-per-worker or RIPPLES_RANKS_PER_WORKER)")
        if g == 1:
            return
        if not -1 <= self.replica_rank < g:
            raise ValueError(f"RIPPLES_REPLICA_RANK={self.replica_rank} is not a rank of a "
                             f"worker of {g} ranks (0..{g - 1})")
        if not self.replica_address and self.world_size % g:
            raise ValueError(
                f"{self.launcher} started {self.world_size} processes, which do not make "
                f"workers of {g} ranks (RIPPLES_RANKS_PER_WORKER): start a multiple of {g}")
        if self.replica_address:
            try:
                parse_target(self.replica_address)
            except ValueError:
                raise ValueError(f"RIPPLES_REPLICA_ADDRESS={self.replica_address!r}: expected "
                                 "HOST:PORT, where the worker's ranks meet") from None


def _parse(env: Mapping[str, str], variable: str, kind: type) -> object:
    text = env[variable].strip()
    if kind is str:
        return text
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"environment variable {variable}={text!r} is not "
                         f"{'an integer' if kind is int else 'a number'}") from None


def _tasks_per_node(text: str) -> int:
    """SLURM's "4" or "4(x2)" or "2(x3),1": the first node's count."""
    match = re.match(r"\s*(\d+)", text)
    if match is None:
        raise ValueError(f"SLURM tasks per node {text!r} is not a count")
    return int(match.group(1))


def _launcher_values(env: Mapping[str, str]) -> dict[str, object]:
    """Rank, world size, local rank and local world size from the first launcher found
    (Ripples' own launchers set torchrun's names, and the outer launcher's are ignored)."""
    if env.get("RIPPLES_LAUNCHER") == "ripples":
        values: dict[str, object] = {"launcher": "ripples"}
        for name, variable in (("rank", "RANK"), ("world_size", "WORLD_SIZE"),
                               ("local_rank", "LOCAL_RANK"),
                               ("local_world_size", "LOCAL_WORLD_SIZE")):
            if variable in env:
                values[name] = _parse(env, variable, int)
        return values
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _parse(env, "WORLD_SIZE", int)
        return {"launcher": "torchrun", "rank": _parse(env, "RANK", int), "world_size": world,
                "local_rank": _parse(env, "LOCAL_RANK", int) if "LOCAL_RANK" in env else 0,
                "local_world_size": (_parse(env, "LOCAL_WORLD_SIZE", int)
                                     if "LOCAL_WORLD_SIZE" in env else world)}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
        return {"launcher": "slurm", "rank": _parse(env, "SLURM_PROCID", int),
                "world_size": _parse(env, "SLURM_NTASKS", int),
                "local_rank": _parse(env, "SLURM_LOCALID", int) if "SLURM_LOCALID" in env else 0,
                "local_world_size": _tasks_per_node(per_node)}
    if "PET_NODE_RANK" in env:
        nproc = _parse(env, "PET_NPROC_PER_NODE", int) if "PET_NPROC_PER_NODE" in env else 1
        nodes_text = env.get("PET_NNODES", "1").split(":")[-1]  # "2" or elastic "1:4"
        try:
            nodes = int(nodes_text)
        except ValueError:
            raise ValueError(f"environment variable PET_NNODES={env['PET_NNODES']!r} is not "
                             "a node count") from None
        local = _parse(env, "LOCAL_RANK", int) if "LOCAL_RANK" in env else 0
        node_rank = _parse(env, "PET_NODE_RANK", int)
        assert isinstance(nproc, int) and isinstance(local, int)
        assert isinstance(node_rank, int)
        return {"launcher": "kubeflow", "rank": node_rank * nproc + local,
                "world_size": nodes * nproc, "local_rank": local, "local_world_size": nproc}
    if "LOCAL_RANK" in env:
        return {"local_rank": _parse(env, "LOCAL_RANK", int)}
    return {}
