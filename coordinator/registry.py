"""Who is in the run: worker records, nodes, ranks and leases (pure code).

Workers register one by one; once the run's `num_workers` have registered, the
membership is formed (`form`): nodes are numbered by host name, ranks by (node, local
rank), and nobody else may register. A worker leaves, fails or lets its lease expire;
its record stays (with its state and error) for the run's views.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import overload

from ripples.coordinator.errors import CoordinatorError
from ripples.run_records import natural_key


class WorkerState(enum.Enum):
    REGISTERED = "registered"
    COMPUTING = "computing"
    WAITING = "waiting"
    REDUCING = "reducing"
    LEFT = "left"
    EXPIRED = "expired"
    FAILED = "failed"


GONE = (WorkerState.LEFT, WorkerState.EXPIRED, WorkerState.FAILED)

STARTUP_LEASE_FACTOR = 3
"""A worker that registered but is not ready to train yet expires after this many leases
of silence (heartbeat delays of 1.35 s were measured during a loaded start-up)."""


@dataclass(kw_only=True)
class Progress:
    iteration: int = 0
    loss: float = float("nan")
    samples: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    preduce_seconds: float = 0.0
    planned_iterations: int = 0
    checkpoint_step: int = 0  # the newest step it holds a checkpoint of (0: none)
    collective_wait_seconds: float = 0.0  # in its current collective (0: in none)
    preduce_bytes: int = 0  # fed into its synchronisations' collectives, cumulative
    collective: str = ""  # its current collective, in words ("": in none)


class _LiveState:
    """`WorkerRecord.state`: setting it keeps its registry's index of live workers
    current, so that the hot paths (a group request, a heartbeat) never scan every
    worker that ever registered to find the live ones (O(1) instead of O(n) per event
    at 10,000 workers)."""

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> WorkerState: ...
    @overload
    def __get__(self, obj: WorkerRecord, objtype: type | None = None) -> WorkerState: ...

    def __get__(self, obj: WorkerRecord | None, objtype: type | None = None) -> WorkerState:
        if obj is None:  # the dataclass's default
            return WorkerState.REGISTERED
        state: WorkerState = obj.__dict__["_state"]
        return state

    def __set__(self, obj: WorkerRecord, value: WorkerState) -> None:
        old = obj.__dict__.get("_state")
        obj.__dict__["_state"] = value
        registry = obj.__dict__.get("_registry")
        if registry is not None and (old in GONE) != (value in GONE):
            registry._moved(obj)


@dataclass(kw_only=True)
class WorkerRecord:
    worker_id: int
    host: str
    local_rank: int
    device: str
    pid: int
    node: int
    lease_expires_at: float
    rank: int = -1
    state: _LiveState = _LiveState()
    request_count: int = 0
    progress: Progress = field(default_factory=Progress)
    error: str = ""
    leave_reason: str = ""  # why a worker that left cleanly ended
    done: bool = False
    """It left because its training loop ended (or at its own budget): done, not lost."""
    round_target: int | None = None  # the group that ends the worker's current round
    wait_started_at: float | None = None
    checkpoint_grant: int = 0
    optimizer_state_ready: bool = False  # lock-step: its optimizer state may join (StateAdoption)
    model_fingerprint: str = ""
    """A digest of its initial model's values (AwaitStart): the start compares them."""
    schema_digest: str = ""
    """The digest of the tensors it averages now (at the start, then with the optimizer
    state): groups form only among workers whose digests are equal."""
    ready: bool = False  # built its model and waits in AwaitStart
    stream_broken: bool = False
    """Its Synchronize stream broke and no heartbeat came since (core.suspect)."""
    listening: bool = False  # gossip: waits only to serve partners (GroupRequest.listen)
    own_seconds: float | None = None
    """Smart GG's speed signal: moving average of the seconds per iteration the worker
    spends on its own (compute + collectives, not waiting for a group); None until two
    progress reports after its first iteration."""
    own_base: tuple[int, float] = (0, 0.0)  # (iteration, own seconds) it is measured from
    replacement: bool = False
    """It joined the running run (elastic protocols): in place of a member that left, or
    as an extra rank up to max_workers (scale-up)."""
    healed: bool = True
    """A replacement is False until it copied a live peer's model (its heal group): until
    then no policy puts it into a group, and its requests get the heal group only."""
    replaced_by: int | None = None
    """A departed member whose rank a replacement took: its iterations went on with the
    replacement, so run totals count them once, there."""
    donations: int = 0  # heal groups it served as the donor (donors are spread by this)
    restarted: bool = False
    """A restart round ended its part (lock-step runs): its process restarts, registers
    anew and restores the run's last checkpoint."""

    def describe(self) -> str:
        return f"worker {self.worker_id} (host {self.host}, local rank {self.local_rank})"

    @property
    def name(self) -> str:
        """How messages name it: by its rank, as a training script knows it, once the
        membership gave it one ("rank 2 (worker 7)"), else by its id."""
        return (f"rank {self.rank} (worker {self.worker_id})" if self.rank >= 0
                else f"worker {self.worker_id}")


class Registry:
    """Every worker that ever registered with the run, by id (ids are never reused)."""

    def __init__(self, num_workers: int, lease_seconds: float, max_workers: int = 0, *,
                 first_worker_id: int = 0) -> None:
        self.num_workers = num_workers
        self.max_workers = max(max_workers, num_workers)
        """Elastic runs grow up to this many ranks (scale-up: `_grow`)."""
        self.lease_seconds = lease_seconds
        self.workers: dict[int, WorkerRecord] = {}
        """Every record, by id (add and remove them with `add` and `discard`)."""
        self._live: dict[int, WorkerRecord] = {}
        """The live ones, in id order (kept by WorkerRecord.state's setter)."""
        self._slots: dict[tuple[str, int], WorkerRecord] = {}
        """(host, local rank) -> the newest record that registered there."""
        self.version = 0
        """Bumped whenever the set of live workers changes (caches key on it)."""
        self.formed = False
        """Every expected worker registered; ranks are assigned and final."""
        self.size = num_workers
        """Members of the formed membership: num_workers, or fewer after a restart round
        that formed with the workers that came back (lock-step runs)."""
        self.generation = 0
        """Restart rounds that formed the membership anew (lock-step runs)."""
        self._nodes: dict[str, int] = {}
        self._next_worker_id = first_worker_id
        """Ids are unique across the runs of one coordinator service (its history counts
        them): a worker of an ended run can never be taken for one of the next run."""
        self.num_lease_expirations = 0

    @property
    def next_worker_id(self) -> int:
        """The id the next registration gets."""
        return self._next_worker_id

    def register(self, host: str, local_rank: int, device: str, pid: int,
                 now: float, *, elastic: bool = False,
                 fixed_reason: str = "its protocol takes no replacements") -> WorkerRecord:
        """A new worker. Before the membership is formed, one of the expected workers;
        after it, a replacement for a member that left if the run is `elastic` (else
        refused, saying `fixed_reason`)."""
        if not host:
            raise CoordinatorError("INVALID_ARGUMENT", "host must not be empty")
        vacant = None
        if self.formed:
            if not elastic:
                raise CoordinatorError(
                    "FAILED_PRECONDITION",
                    f"the run already has its {self.num_workers} workers and its membership "
                    f"is fixed ({fixed_reason}); start a new coordinator for a new run")
            vacant = self.vacant_member()
            # Late: less than half its lease left (no heartbeat for half a lease).
            overdue = [w.worker_id for w in self.live() if w.ready
                       and w.lease_expires_at - now < self.lease_seconds / 2]
            if vacant is None and self.size < self.max_workers and overdue:
                # Scale-up waits: a member that is late with its heartbeat may be dead,
                # and a supervisor's replacement for it must take its rank, not a new one.
                raise CoordinatorError(
                    "RESOURCE_EXHAUSTED",
                    f"worker {overdue[0]} is late with its heartbeat; a joiner waits until "
                    "it renews its lease (the run grows) or its rank frees (it replaces it)")
            if vacant is None and self.size >= self.max_workers:
                raise CoordinatorError(
                    "RESOURCE_EXHAUSTED",
                    f"the run already has its {self.size} workers (max_workers "
                    f"{self.max_workers}); a replacement joins once a member has left or "
                    "its lease expired")
        elif len(self._live) >= self.num_workers:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"the run already has its {self.num_workers} workers; "
                "start a new coordinator for a new run",
            )
        w = self._slots.get((host, local_rank))
        if w is not None and w.state not in GONE:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"host {host} local rank {local_rank} is already registered as worker "
                f"{w.worker_id}; give each worker on a host its own --local-rank",
            )
        node = self._nodes.setdefault(host, len(self._nodes))
        worker_id = self._next_worker_id
        self._next_worker_id += 1
        record = WorkerRecord(worker_id=worker_id, host=host, local_rank=local_rank,
                              device=device, pid=pid, node=node,
                              lease_expires_at=now + self.lease_seconds)
        self.add(record)
        if vacant is not None:
            self._take_over(record, vacant)
        elif self.formed:
            self._grow(record)
        return record

    def continue_ranks(self, members: list[WorkerRecord]) -> None:
        """After a resumed run (or a lock-step run's restart round) formed its membership
        anew: each member takes over the
        part of the departed member that held its rank before (`_continue`), with its
        slowdown counter; none heals: every member restores the run's checkpoints."""
        departed: dict[int, WorkerRecord] = {}  # rank -> its first departed holder
        for x in self._unreplaced_departed():
            departed.setdefault(x.rank, x)
        for w in members:
            previous = departed.get(w.rank)
            if previous is not None:
                self._continue(w, previous)
                w.request_count = previous.request_count
                # It goes on from the checkpoint it restores, not from where its
                # predecessor was: the steps since are made again.
                held = previous.progress.checkpoint_step
                if held:
                    w.progress.iteration = min(w.progress.iteration, held)

    def vacant_member(self) -> WorkerRecord | None:
        """The departed member of lowest rank whose rank nobody holds now and nobody
        took over, or None."""
        held = {w.rank for w in self._live.values()}
        gone = [w for w in self._unreplaced_departed() if w.rank not in held]
        return min(gone, key=lambda w: w.rank, default=None)

    def _unreplaced_departed(self) -> Iterator[WorkerRecord]:
        """Departed members (they held a rank) that no worker took over, in id order."""
        return (w for w in self.workers.values()
                if w.state in GONE and w.rank >= 0 and w.replaced_by is None)

    def _continue(self, record: WorkerRecord, previous: WorkerRecord) -> None:
        """`record` continues `previous`'s part: its rank (so its data shard) and its
        iteration count and budget, which run totals then count once, with `record`."""
        record.rank = previous.rank
        record.progress = Progress(iteration=previous.progress.iteration,
                                   samples=previous.progress.samples,
                                   planned_iterations=previous.progress.planned_iterations,
                                   checkpoint_step=previous.progress.checkpoint_step)
        previous.replaced_by = record.worker_id
        self.version += 1  # its iteration count changed outside its own reports

    def _take_over(self, record: WorkerRecord, vacant: WorkerRecord) -> None:
        """A replacement continues `vacant`'s part (`_continue`) with a slowdown counter
        at the live workers' median (a counter of 0 would read as a straggler to the
        smart policy); it heals before it averages."""
        live = [w.request_count for w in self.live() if w is not record]
        self._continue(record, vacant)
        record.replacement, record.healed = True, False
        record.request_count = sorted(live)[len(live) // 2] if live else vacant.request_count

    def _grow(self, record: WorkerRecord) -> None:
        """Scale-up: `record` takes the next rank, beyond the run's num_workers; it starts
        at the live workers' median iteration count and slowdown counter (it joins a run
        under way) and heals before it averages, as a replacement does."""
        live = [w for w in self.live() if w is not record]
        record.rank = self.size
        self.size += 1
        if live:
            record.progress = Progress(
                iteration=sorted(w.progress.iteration for w in live)[len(live) // 2])
            record.request_count = sorted(w.request_count for w in live)[len(live) // 2]
        record.replacement, record.healed = True, False

    def holders_by_rank(self) -> list[WorkerRecord]:
        """For each rank, the worker that holds it now: the live one, else the departed
        member nobody replaced (a graph is built over every rank of the run)."""
        holders: dict[int, WorkerRecord] = {}
        for w in sorted(self.workers.values(), key=lambda x: x.worker_id):
            if w.rank < 0 or w.replaced_by is not None:
                continue
            current = holders.get(w.rank)
            if current is None or (current.state in GONE and w.state not in GONE):
                holders[w.rank] = w
        return [holders[rank] for rank in sorted(holders)]

    def counted(self) -> list[WorkerRecord]:
        """Every worker whose iterations count in the run's totals: all that ever
        registered, less departed members whose replacement carries their count on."""
        return [w for w in self.workers.values() if w.replaced_by is None]

    @property
    def complete(self) -> bool:
        return len(self._live) == self.num_workers

    def add(self, record: WorkerRecord) -> None:
        """Keep `record` (a registration, or a record restored from a snapshot)."""
        self.workers[record.worker_id] = record
        record.__dict__["_registry"] = self
        self._slots[(record.host, record.local_rank)] = record
        if record.state not in GONE:
            self._moved(record)

    def undo(self, record: WorkerRecord) -> None:
        """Undo the registration of `record`, which changed nothing else (its record could
        not be stored, so no process was told its id): its id and, if new, its host's
        node are handed out again."""
        self.discard(record.worker_id)
        slot = (record.host, record.local_rank)
        earlier = [w for w in self.workers.values() if (w.host, w.local_rank) == slot]
        if earlier:  # the slot's earlier (departed) holder, as before the registration
            self._slots[slot] = max(earlier, key=lambda w: w.worker_id)
        if self._next_worker_id == record.worker_id + 1:
            self._next_worker_id = record.worker_id
        if (self._nodes.get(record.host) == len(self._nodes) - 1
                and all(w.host != record.host for w in self.workers.values())):
            del self._nodes[record.host]

    def discard(self, worker_id: int) -> None:
        """Forget a record (a registration undone)."""
        record = self.workers.pop(worker_id)
        record.__dict__.pop("_registry", None)
        if self._slots.get((record.host, record.local_rank)) is record:
            del self._slots[(record.host, record.local_rank)]
        if self._live.pop(worker_id, None) is not None:
            self.version += 1

    def _moved(self, record: WorkerRecord) -> None:
        """`record` became live or departed (WorkerRecord.state's setter)."""
        self.version += 1
        if record.state in GONE:
            self._live.pop(record.worker_id, None)
            return
        newest = next(reversed(self._live), -1) if self._live else -1
        self._live[record.worker_id] = record
        if record.worker_id < newest:  # back from the departed (rare): keep id order
            self._live = dict(sorted(self._live.items()))

    @property
    def num_live(self) -> int:
        return len(self._live)

    def is_live(self, worker_id: int) -> bool:
        return worker_id in self._live

    def live_by_id(self) -> dict[int, WorkerRecord]:
        """The live workers by id, in id order (the registry's own index: read only)."""
        return self._live

    def nodes_if_formed(self, host: str) -> list[int]:
        """Each rank's node if the membership formed now with one more worker on `host`
        (as `form` numbers them): what a hierarchical graph is built from ahead."""
        hosts = [w.host for w in self.live()] + [host]
        index = {h: i for i, h in enumerate(sorted(set(hosts), key=natural_key))}
        return sorted(index[h] for h in hosts)

    def form(self) -> list[WorkerRecord]:
        """Fix the membership: nodes numbered by host name in natural order (node2
        before node10), so that ranks do not depend on who registered first; ranks by
        (node, local rank). Returns the members in rank order."""
        hosts = sorted({w.host for w in self.live()}, key=natural_key)
        self._nodes = {h: i for i, h in enumerate(hosts)}
        for w in self.live():
            w.node = self._nodes[w.host]
        ordered = sorted(self.live(), key=lambda w: (w.node, w.local_rank))
        for rank, w in enumerate(ordered):
            w.rank = rank
        self.formed = True
        self.size = len(ordered)
        return ordered

    def renew(self, w: WorkerRecord, now: float) -> None:
        w.lease_expires_at = now + self.lease_seconds
        w.stream_broken = False

    def heard_at(self, w: WorkerRecord) -> float:
        """When its lease was last renewed (registration or heartbeat); meaningless once
        a broken stream cut the lease."""
        return w.lease_expires_at - self.lease_seconds

    def expired(self, now: float) -> list[WorkerRecord]:
        """Live workers whose lease ran out (the caller removes them). A worker that is
        not ready yet has STARTUP_LEASE_FACTOR leases: its start-up (imports, data,
        building the model) can starve its heartbeat thread on a loaded host, and a
        chaos trial saw starting workers expire under a short lease."""
        grace = (STARTUP_LEASE_FACTOR - 1) * self.lease_seconds
        return [w for w in self.live()
                if w.lease_expires_at + (0.0 if w.ready else grace) < now]

    def live(self) -> list[WorkerRecord]:
        """The live workers in id order (a copy of the index)."""
        return list(self._live.values())

    def num_nodes(self) -> int:
        return len({w.node for w in self.live()})

    def worker(self, worker_id: int) -> WorkerRecord:
        """A live worker; NOT_FOUND for an unknown or departed one."""
        w = self._live.get(worker_id)
        if w is not None:
            return w
        w = self.workers.get(worker_id)
        if w is None:
            raise CoordinatorError("NOT_FOUND", f"unknown worker id {worker_id}; register first")
        if w.state in GONE:
            raise CoordinatorError(
                "NOT_FOUND", f"worker {worker_id} is no longer part of the run ({w.state.value}"
                + (f": {w.error})" if w.error else ")")
            )
        return w
