"""A peer run's progress from its workers' step logs, measured as the coordinator measures
a Ripples run (coordinator/progress.py), so that both land in one table (pure code).

Every peer worker appends one JSON line per step to its own log: the wall-clock time
(`time.time()`, one machine), its iteration, its training loss smoothed over the last
LOSS_WINDOW steps (the window Ripples' workers report), and its cumulative samples,
compute and synchronisation seconds. Replaying every worker's lines in time order gives
what the coordinator computes from the reports it receives: the mean of the workers'
latest smoothed losses once every worker reported one, the time at which that mean first
reaches the target, the mean iterations then, and a loss curve with the coordinator's
spacing.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ripples.coordinator.progress import LOSS_CURVE_MIN_STEP_SECONDS

STEP_LOG_GLOB = "steps.rank*.jsonl"


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One step of one peer worker, as its log line says."""

    rank: int
    time: float
    """time.time() at the end of the step."""
    iteration: int
    loss: float
    """Smoothed over the last LOSS_WINDOW steps (worker/stats.py)."""
    samples: int
    compute_seconds: float
    sync_seconds: float
    """Cumulative seconds inside the peer system's calls (its averaging, all-reduce,
    quorum and the waits in them)."""
    sent_bytes: int | None = None
    """Bytes this step fed into the peer system's collectives (backends.PeerBackend's
    sent_bytes; None: not counted, or a log from before they were)."""

    def line(self) -> str:
        d = {"t": self.time, "i": self.iteration, "loss": self.loss, "n": self.samples,
             "c": round(self.compute_seconds, 6), "s": round(self.sync_seconds, 6)}
        if self.sent_bytes is not None:
            d["b"] = self.sent_bytes
        return json.dumps(d)

    @classmethod
    def parse(cls, rank: int, line: str) -> StepRecord:
        d = json.loads(line)
        return cls(rank=rank, time=d["t"], iteration=d["i"], loss=d["loss"], samples=d["n"],
                   compute_seconds=d["c"], sync_seconds=d["s"], sent_bytes=d.get("b"))


def sent_bytes(records: list[StepRecord]) -> int | None:
    """The bytes the records' steps fed into collectives (None when one step's are not
    counted)."""
    if any(r.sent_bytes is None for r in records):
        return None
    return sum(r.sent_bytes or 0 for r in records)


def bytes_per_step(records: list[StepRecord]) -> float | None:
    """Bytes a worker fed into its peer system's collectives per optimizer step: every
    step's bytes over the steps, all workers' and incarnations' together, as a Ripples
    run's summary computes its own (cli/local_cluster.py); None before any step, or when
    a step's bytes are not counted.

    What a step counts is its backend's (backends.py): torchft's DDP hands its Manager
    4P bytes of gradient buckets every step (P fp32 parameters), torchft-diloco 4P of
    pseudo-gradients every H steps, so 4P/H, LocalSGD 4P of parameters every K; hivemind
    counts, at each step that ends one of its epochs, 4(P + B) of averaged state
    (parameters and B BatchNorm values; hivemind-local, and hivemind-sync when the swarm
    had another peer) plus, in sync mode, 4P of gradients: 4(P + B) x rounds / steps and
    4(2P + B) x global steps / local steps."""
    if not records:
        return None
    total = sent_bytes(records)
    return total / len(records) if total is not None else None


def step_log_path(directory: Path, rank: int) -> Path:
    return directory / f"steps.rank{rank}.jsonl"


def read_step_logs(directory: Path, num_workers: int) -> list[StepRecord]:
    """Every worker's complete lines, in time order (a line cut short by a kill is
    skipped)."""
    return StepLogTail(directory, num_workers).new_records()


@dataclass(kw_only=True)
class PeerProgress:
    """What the coordinator's ProgressTracker reports for a Ripples run."""

    time_to_target: float | None = None
    iterations_to_target: float | None = None
    loss_curve: list[tuple[float, float, float]] = field(default_factory=list)
    """(seconds since the start, mean loss, mean iterations)."""
    elapsed: float = 0.0
    """Seconds from the start to the last step of any worker."""
    last: dict[int, StepRecord] = field(default_factory=dict)
    """Each rank's last step."""

    @property
    def total_samples(self) -> int:
        return sum(r.samples for r in self.last.values())


class Replay:
    """The progress so far, one record at a time (in time order)."""

    def __init__(self, *, num_workers: int, start: float, target_loss: float) -> None:
        self.num_workers, self.start, self.target_loss = num_workers, start, target_loss
        self.progress = PeerProgress()

    def add(self, rec: StepRecord) -> None:
        out, latest = self.progress, self.progress.last
        latest[rec.rank] = rec
        elapsed = max(0.0, rec.time - self.start)
        out.elapsed = max(out.elapsed, elapsed)
        if len(latest) < self.num_workers or any(math.isnan(r.loss) for r in latest.values()):
            return
        mean = sum(r.loss for r in latest.values()) / self.num_workers
        iterations = sum(r.iteration for r in latest.values()) / self.num_workers
        reached = (self.target_loss > 0 and out.time_to_target is None
                   and mean <= self.target_loss)
        if reached:
            out.time_to_target, out.iterations_to_target = elapsed, iterations
        if (reached or not out.loss_curve
                or elapsed - out.loss_curve[-1][0] >= LOSS_CURVE_MIN_STEP_SECONDS):
            out.loss_curve.append((elapsed, mean, iterations))


def replay(records: list[StepRecord], *, num_workers: int, start: float,
           target_loss: float) -> PeerProgress:
    """The run's progress from `start` (the time every worker was ready), replaying the
    records in time order: after each one, the mean of every rank's latest loss (once all
    `num_workers` reported one) is checked against `target_loss` (<= 0: none) and a curve
    point is added at most every LOSS_CURVE_MIN_STEP_SECONDS (and where the target is
    reached)."""
    state = Replay(num_workers=num_workers, start=start, target_loss=target_loss)
    for rec in sorted(records, key=lambda r: r.time):
        state.add(rec)
    return state.progress


class StepLogTail:
    """The lines the workers appended since the last call (a line still being written
    waits for the next)."""

    def __init__(self, directory: Path, num_workers: int) -> None:
        self.directory, self.num_workers = directory, num_workers
        self._offsets = [0] * num_workers

    def new_records(self) -> list[StepRecord]:
        records = []
        for rank in range(self.num_workers):
            path = step_log_path(self.directory, rank)
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(self._offsets[rank])
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]
            self._offsets[rank] += len(complete)
            for line in complete.decode().splitlines():
                try:
                    records.append(StepRecord.parse(rank, line))
                except (ValueError, KeyError):
                    continue
        return sorted(records, key=lambda r: r.time)


@dataclass(kw_only=True)
class FaultTimes:
    """What a killed worker cost its run, from the step logs."""

    stall_seconds: float
    """The survivors' stall: the longest time one of them went without completing a step,
    over the steps completed after the kill (their normal step time included)."""
    stalled_rank: int
    step_seconds_before: float
    """The survivors' median step time before the kill (what no stall looks like)."""
    longest_before_seconds: float
    """The survivors' longest step before the kill (the system's own pauses)."""
    replacement_first_step_seconds: float | None
    """From the kill to the replacement's first completed step (None: it made none)."""


def fault_times(records: list[StepRecord], *, victim: int, killed_at: float) -> FaultTimes:
    """The survivors' stall and the replacement's first step, from every worker's step
    records (the victim's rank holds the victim's, then its replacement's, by time)."""
    times: dict[int, list[float]] = {}
    for rec in sorted(records, key=lambda r: r.time):
        times.setdefault(rec.rank, []).append(rec.time)
    stall, stalled, before = 0.0, -1, []
    for rank, ts in times.items():
        if rank == victim:
            continue
        for a, b in zip(ts, ts[1:], strict=False):
            if b <= killed_at:
                before.append(b - a)
            elif b - a > stall:
                stall, stalled = b - a, rank
    after = [t for t in times.get(victim, []) if t > killed_at]
    return FaultTimes(stall_seconds=stall, stalled_rank=stalled,
                      step_seconds_before=statistics.median(before) if before else math.nan,
                      longest_before_seconds=max(before, default=math.nan),
                      replacement_first_step_seconds=after[0] - killed_at if after else None)
