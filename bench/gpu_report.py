"""What `python -m ripples.bench.gpu` measured, as its table and its goal checks.

The configurations' processes (bench/gpu_rank.py) write what each training loop measured;
`rows` turns each loop into a line: time per step, its ratio to the plain step of its
setting, bytes per step, host syncs per step by two witnesses (torch's sync debug mode and
the profiler's blocking CUDA calls), the host's time inside `optimizer.step()` and
Ripples' bookkeeping; `goal_lines` checks the GPU goals against them. Pure: no process,
no device.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from ripples.bench.gpu_rank import Measured, RankSettings

SYNC_GOAL, LOSS_READ_GOAL, BOOKKEEPING_GOAL, OVERLAP_GOAL = 0.0, 1 / 16, 0.03, 1.3
"""The GPU goals: host syncs per step from Ripples (by either witness), loss read-backs
per step, Ripples' bookkeeping as a share of a step, and ripples-smart's step with
overlap against the plain step of the ranks sharing the device."""


@dataclass(frozen=True)
class Configuration:
    name: str
    kind: str
    """What its processes run (gpu_rank's --kind)."""
    label: str
    run_options: tuple[str, ...] = ()
    """ripples run's options besides the shared ones (kind "ripples")."""
    ranks_per_worker: int = 1
    """Kind "ripples": processes per worker (G > 1: FSDP2 over each worker's G ranks)."""

    @property
    def overlap(self) -> bool:
        return "--overlap" in self.run_options

    def run_workers(self, ranks: int) -> int:
        """The run's workers where `ranks` processes share the device: one per process,
        or ranks / G workers of G (at least two workers: a run has two)."""
        return ranks if self.ranks_per_worker == 1 else max(2, ranks // self.ranks_per_worker)

    def processes(self, ranks: int) -> int:
        """How many processes of it share the device (1 for `single`)."""
        return 1 if self.kind == "single" else self.run_workers(ranks) * self.ranks_per_worker


@dataclass(kw_only=True)
class Outcome:
    """One configuration's processes: what they measured, or why nothing."""

    config: Configuration
    measured: list[Measured] = dataclasses.field(default_factory=list)
    bytes_per_step: float | None = None
    """ripples run's bytes_per_worker_step (Ripples configurations)."""
    status: str = ""
    """"" when measured, else "failed: ..." or "skipped: ..."."""
    seconds: float = 0.0


@dataclass(kw_only=True)
class Row:
    """One training loop's line of the table."""

    label: str
    kind: str
    """plain, ddp or ripples (single-process mode's ripples.Optimizer included)."""
    ranks: int
    overlap: bool = False
    ms_per_step: float | None = None
    ratio: float | None = None
    """Time per step over the plain step's (its own baseline row: 1 process, or the
    ranks sharing the device)."""
    bytes_per_step: float | None = None
    syncs_per_step: float | None = None
    """Host-device synchronisations per step, loss read-back apart (None: not counted,
    on the CPU)."""
    loss_reads_per_step: float | None = None
    blocking_per_step: float | None = None
    """The profiler's blocking CUDA calls per step, loss read-back apart (None: not
    counted, on the CPU or where the profiler failed)."""
    loss_read_blocking_per_step: float | None = None
    host_step_ms: float | None = None
    """The host thread's time inside optimizer.step() per step (a wait on a collective
    included; DDP's all-reduce runs in backward, outside it)."""
    bookkeeping: float | None = None
    """Ripples' own bookkeeping (StepTimes.other_seconds) as a share of the step."""
    status: str = ""
    sync_sites: dict[str, int] = dataclasses.field(default_factory=dict)
    blocking_sites: dict[str, int] = dataclasses.field(default_factory=dict)
    profiler_error: str = ""


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """The ranks' counts by site, added up."""
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)
    return dict(total)


def _row(label: str, kind: str, outcome: Outcome, measured: list[Measured], ranks: int,
         device: str) -> Row:
    """One loop's row from what its ranks measured (no ratio yet)."""
    row = Row(label=label, kind=kind, overlap=outcome.config.overlap, ranks=ranks,
              status=outcome.status)
    if row.status:
        return row
    if not measured or any(not m.window_seconds for m in measured):
        row.status = "failed: a rank timed no whole window (its run stopped it early)"
        return row
    step_seconds = statistics.median(statistics.median(m.window_seconds) for m in measured)
    row.ms_per_step = step_seconds * 1e3
    if kind == "ddp":
        row.bytes_per_step = float(measured[0].gradient_bytes)
    elif outcome.config.kind == "ripples":
        row.bytes_per_step = outcome.bytes_per_step
    else:  # a plain loop, or single-process mode: nothing is sent
        row.bytes_per_step = 0.0
    if device == "cuda":
        steps = sum(m.timed_steps for m in measured)
        row.syncs_per_step = sum(m.syncs for m in measured) / steps
        row.loss_reads_per_step = sum(m.loss_read_syncs for m in measured) / steps
        row.sync_sites = _summed(m.sync_sites for m in measured)
    timed = sum(m.timed_steps for m in measured)
    if timed:
        row.host_step_ms = 1e3 * sum(m.step_host_seconds for m in measured) / timed
    profiled = sum(m.profiled_steps for m in measured)
    errors = {m.profiler_error for m in measured if m.profiler_error}
    row.profiler_error = "; ".join(sorted(errors))
    if (device == "cuda" and profiled and not errors
            and all(m.blocking_calls is not None for m in measured)):
        row.blocking_per_step = sum(m.blocking_calls or 0 for m in measured) / profiled
        row.loss_read_blocking_per_step = sum(
            m.loss_read_blocking_calls or 0 for m in measured) / profiled
        row.blocking_sites = _summed(m.blocking_sites for m in measured)
    times = [m.step_times for m in measured if m.step_times is not None]
    if times:
        other = sum(t["other_seconds"] for t in times) / sum(t["steps"] for t in times)
        row.bookkeeping = other / step_seconds
    return row


def rows(outcomes: list[Outcome], workers: int, device: str) -> list[Row]:
    """The table's rows, in the order the configurations ran, each with its ratio to the
    plain step of its setting (one process alone, or the ranks sharing the device)."""
    table: list[Row] = []
    for outcome in outcomes:
        config = outcome.config
        if config.kind == "single":
            table += [_row(f"{config.label}: {name}", kind, outcome,
                           [m for m in outcome.measured if m.label == name], 1, device)
                      for name, kind in (("plain", "plain"), ("ripples.Optimizer", "ripples"))]
        else:
            table.append(_row(config.label, config.kind, outcome, outcome.measured,
                              config.processes(workers), device))
    plain_ms = {r.ranks: r.ms_per_step for r in table if r.kind == "plain" and r.ms_per_step}
    for r in table:
        if r.ms_per_step and r.ranks in plain_ms:
            r.ratio = r.ms_per_step / plain_ms[r.ranks]
    return table


def _cell(value: float | None, spec: str, width: int, unit: str = "") -> str:
    return f"{'n/a' if value is None else format(value, spec) + unit:>{width}}"


def format_table(table: list[Row]) -> list[str]:
    width = max(len("configuration"), *(len(r.label) for r in table))
    lines = [f"{'configuration':{width}}  {'ms/step':>9} {'x plain':>8} {'MB/step':>9} "
             f"{'syncs/step':>10} {'loss reads/step':>15} {'blocking/step':>13} "
             f"{'host ms in step()':>17} {'bookkeeping':>11}"]
    for r in table:
        if r.status:
            lines.append(f"{r.label:{width}}  {r.status}")
            continue
        megabytes = None if r.bytes_per_step is None else r.bytes_per_step / 1e6
        lines.append(f"{r.label:{width}}  {_cell(r.ms_per_step, '.2f', 9)} "
                     f"{_cell(r.ratio, '.2f', 8, 'x')} {_cell(megabytes, '.3f', 9)} "
                     f"{_cell(r.syncs_per_step, '.3f', 10)} "
                     f"{_cell(r.loss_reads_per_step, '.3f', 15)} "
                     f"{_cell(r.blocking_per_step, '.3f', 13)} "
                     f"{_cell(r.host_step_ms, '.2f', 17)} "
                     f"{_cell(r.bookkeeping, '.2%', 11)}")
    return lines


def _check(what: str, checked: list[tuple[str, str, bool]]) -> str:
    """One goal's line: each row's figure and whether it meets the goal."""
    return f"- {what}: " + ("; ".join(f"{label} {figure} ({'met' if met else 'NOT met'})"
                                      for label, figure, met in checked) or "none measured")


def goal_lines(table: list[Row], device: str) -> list[str]:
    """The GPU goals, checked against the rows that were measured."""
    measured = [r for r in table if not r.status]
    ripples_rows = [r for r in measured if r.kind == "ripples"]
    lines = ["goals:"]
    if device == "cuda":
        lines.append(_check(
            f"host syncs per step from Ripples, loss read-back apart (goal {SYNC_GOAL:g})",
            [(r.label, f"{r.syncs_per_step:.3f}", r.syncs_per_step <= SYNC_GOAL)
             for r in ripples_rows if r.syncs_per_step is not None]))
        lines.append(_check(
            f"blocking CUDA calls per step from Ripples in the profiler, loss read-back "
            f"apart (goal {SYNC_GOAL:g})",
            [(r.label, f"{r.blocking_per_step:.3f}", r.blocking_per_step <= SYNC_GOAL)
             for r in ripples_rows if r.blocking_per_step is not None]))
        lines += [f"  {r.label}: profiler failed: {r.profiler_error}"
                  for r in ripples_rows if r.profiler_error]
        lines.append(_check(
            "loss read-backs per step (goal <= 1/16)",
            [(r.label, f"{r.loss_reads_per_step:.3f}", r.loss_reads_per_step <= LOSS_READ_GOAL)
             for r in ripples_rows if r.loss_reads_per_step is not None]))
    else:
        lines.append("- host syncs and loss read-backs: not counted on the CPU (no device)")
    lines.append(_check(
        f"Ripples' bookkeeping (goal < {BOOKKEEPING_GOAL:.0%} of a step)",
        [(r.label, f"{r.bookkeeping:.2%}", r.bookkeeping < BOOKKEEPING_GOAL)
         for r in ripples_rows if r.bookkeeping is not None]))
    ddp = next((r.bytes_per_step for r in measured if r.kind == "ddp"), None)
    overlap = [r for r in table if r.overlap]
    lines.append(_check(
        f"with overlap, the step over the plain step of the ranks sharing the device "
        f"(goal <= {OVERLAP_GOAL:g}x), at its bytes per step"
        + (f" (DDP's: {ddp / 1e6:.3f} MB)" if ddp else ""),
        [(r.label, f"{r.ratio:.2f}x at {(r.bytes_per_step or 0) / 1e6:.3f} MB"
          + (f" ({(r.bytes_per_step or 0) / ddp:.2f}x DDP's)" if ddp else ""),
          r.ratio <= OVERLAP_GOAL) for r in overlap if r.ratio is not None]))
    lines += [f"  {r.label}: {r.status or 'no plain step to compare with (--configs plain)'}"
              for r in overlap if r.ratio is None]
    return lines


def sync_site_lines(table: list[Row], most: int = 4) -> list[str]:
    """Where the synchronisations of each row with some besides the loss read-back's
    came from, by either witness."""
    lines = []
    for r in table:
        for counted, title, sites in (
                (r.syncs_per_step, "synchronisations of {} (all ranks' timed steps):",
                 r.sync_sites),
                (r.blocking_per_step, "blocking CUDA calls of {} (all ranks' profiled steps):",
                 r.blocking_sites)):
            if counted:
                lines.append(title.format(r.label))
                lines += [f"  {count:5d}  {site}"
                          for site, count in Counter(sites).most_common(most)]
    return lines


FOOTNOTES = (
    "ms/step: the median over ranks of each rank's median window; x plain: over the plain "
    "loop's step (1 process alone, or the ranks sharing the device); MB/step: what a "
    "worker feeds into collectives per step (DDP: its gradients; Ripples: ripples run's "
    "bytes_per_worker_step, warm-up included); syncs/step: host-device synchronisations "
    "seen by torch's sync debug mode, the loss read-back's apart; blocking/step: blocking "
    "CUDA runtime calls (stream, event and device synchronisations, synchronous copies) "
    "inside a profiled window's steps (torch.profiler), the loss read-back's apart; host "
    "ms in step(): the host thread's time inside optimizer.step() (a wait on a collective "
    "included; DDP all-reduces in backward); bookkeeping: Ripples' own time in opt.step() "
    "(StepTimes.other_seconds) as a share of the step.",
    "H=N bf16: --local-steps N --outer-optimizer nesterov --outer-compression bf16 (bf16 "
    "on the wire needs the outer optimizer; the models travel in float32, the outer "
    "momentum in bfloat16).",
    "FSDP2: workers of two ranks (--ranks-per-worker 2), the GPT sharded over each "
    "worker's ranks, its FSDP2 all-gathers and reduce-scatters in the step; x plain: over "
    "the plain step of as many processes (n/a where the plain row has another count); "
    "MB/step: a rank's shard.",
)


def report_lines(settings: RankSettings, workers: int, outcomes: list[Outcome],
                 table: list[Row]) -> list[str]:
    """What the command prints: what ran where, the table, its footnotes, where the
    synchronisations came from, and the goal checks."""
    s = settings
    first = next((m for o in outcomes for m in o.measured), None)
    device = first.device_name if first is not None else s.device
    parameters = f"{first.parameters / 1e6:.2f}M" if first is not None else "?"
    transport = "NCCL over sockets on loopback" if s.device == "cuda" else "gloo"
    header = (f"{device}: GPT of {parameters} parameters (d_model {s.d_model}, {s.layers} "
              f"layers, block {s.block_size}, batch {s.batch_size}), AdamW"
              f"{', bf16 autocast' if s.device == 'cuda' else ''}; {workers} ranks share the "
              f"device ({transport}); {s.warmup_steps} warm-up steps, then {s.windows} "
              f"timed windows of {s.window_steps} steps")
    if s.device == "cpu":
        header += " (on the CPU: that every part runs, not what it costs on a GPU)"
    return [header, *format_table(table), *FOOTNOTES, *sync_site_lines(table),
            *goal_lines(table, s.device)]
