"""The coordinator service's runs as a terminal shows them: the tables of `ripples runs`,
the view of `ripples status` (what the dashboard's page shows, as text, or as JSON), and
the one-line progress that `ripples submit --wait` follows. Every name a client sent
(run names, hosts, commands) is made printable first.
"""

from __future__ import annotations

import datetime
import math
from collections import Counter
from collections.abc import Iterable

from ripples.run_records import printable, state_name, summary
from ripples.v1 import coordinator_pb2 as pb

_WORKER_STATES = {v: k.removeprefix("WORKER_STATE_").lower()
                 for k, v in pb.WorkerState.items()}
"""A worker state's name as the views print it (`computing`, `left`, ...)."""
_GONE = (pb.WORKER_STATE_LEFT, pb.WORKER_STATE_EXPIRED, pb.WORKER_STATE_FAILED)
STATUS_MAX_WORKER_ROWS = 32
"""`ripples status` lists every worker up to this many; past it, a count per state and
this many rows (a terminal page at 1,000 workers)."""


def format_time(unix: float) -> str:
    """A moment as local date and time ("-" for none)."""
    if not unix:
        return "-"
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")


def format_duration(seconds: float) -> str:
    """A duration as 1h02m or 3m04s ("-" for none)."""
    if seconds <= 0 or not math.isfinite(seconds):
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def text_table(rows: list[list[str]]) -> str:
    """Rows (the first: the header) in left-aligned columns."""
    rows = [[printable(cell) for cell in row] for row in rows]  # names come from clients
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def task_of(info: pb.RunInfo) -> str:
    """What a run trains: its built-in task, else its command."""
    return info.task or " ".join(info.command) or "-"


def workers_of(info: pb.RunInfo) -> str:
    """A run's workers: "4", or "4x2" for four workers of two ranks each."""
    ranks = info.ranks_per_worker
    return f"{info.num_workers}x{ranks}" if ranks > 1 else str(info.num_workers)


def runs_table(runs: Iterable[pb.RunInfo]) -> str:
    """`ripples runs`: one row per run."""
    rows = [["RUN", "NAME", "STATE", "PROTOCOL", "WORKERS", "SUBMITTED", "TRAINED",
             "LOSS", "STOP REASON"]]
    for r in runs:
        state = state_name(r.state) + (f" #{r.queue_position}" if r.queue_position else "")
        rows.append([r.run_id, r.name, state, r.protocol, workers_of(r),
                     format_time(r.submitted_at), format_duration(r.elapsed_seconds),
                     f"{r.mean_loss:.4f}" if r.mean_loss else "-", r.stop_reason or "-"])
    return text_table(rows)


def agents_table(agents: Iterable[pb.AgentInfo]) -> str:
    """`ripples runs`: one row per host agent."""
    rows = [["AGENT", "HOST", "SLOTS", "DEVICES", "RUN", "PROCESSES", "SEEN"]]
    for a in agents:
        rows.append([str(a.agent_id), a.host + (" (draining)" if a.draining else ""),
                     str(a.slots), ",".join(a.devices), a.run_id or "-",
                     str(a.processes), f"{a.seen_seconds_ago:.0f}s ago"])
    return text_table(rows)


def progress_line(status: pb.RunStatus) -> str:
    """How far a run is: its workers registered, or their iterations, loss and time."""
    live = [w for w in status.workers if status.stopped or w.state in (
        pb.WORKER_STATE_REGISTERED, pb.WORKER_STATE_COMPUTING, pb.WORKER_STATE_WAITING,
        pb.WORKER_STATE_REDUCING)]
    if not status.started:
        return f"{len(live)} of {status.config.num_workers} workers registered"
    iterations = [w.iteration for w in live] or [0]
    loss = f", loss {status.mean_loss:.4f}" if status.mean_loss else ""
    return (f"{len(live)} workers, iterations {min(iterations)}-{max(iterations)}{loss}, "
            f"{format_duration(status.elapsed_seconds)}")


def status_json(status: pb.RunStatus) -> dict[str, object]:
    """`ripples status --json`: the run's summary, its workers and its loss curve."""
    return {**summary(status.run), "started": status.started, "stopped": status.stopped,
            "workers": [{"worker_id": w.worker_id, "rank": w.rank, "host": w.host,
                         "local_rank": w.local_rank, "state": _WORKER_STATES[w.state],
                         "iteration": w.iteration, "loss": w.loss, "error": w.error}
                        for w in status.workers],
            # `workers` lists the first 2,000 of them: RunStatus.num_worker_rows
            "num_workers": max(status.num_worker_rows, len(status.workers)),
            "loss_curve": [[p.seconds, p.loss] for p in status.loss_curve]}


def render_status(status: pb.RunStatus) -> str:
    """The terminal view of a run: what the dashboard's page shows, as text."""
    info, cfg = status.run, status.config
    lines = [f"run {info.run_id} ({info.name}): {state_name(info.state)}"]
    what = info.task or " ".join(info.command)
    ranks = (f" of {info.ranks_per_worker} ranks each" if info.ranks_per_worker > 1 else "")
    lines.append(f"  {cfg.protocol}, {cfg.num_workers} workers{ranks}, {what}")
    lines.append(f"  submitted {format_time(info.submitted_at)}, "
                 f"started {format_time(info.started_at)}"
                 + (f", ended {format_time(info.ended_at)}" if info.ended_at else ""))
    if info.state == pb.RUN_STATE_QUEUED:
        lines.append(f"  queued: place {info.queue_position}")
    else:
        lines.append(f"  progress: {progress_line(status)}")
    if status.stop_reason or info.stop_reason:
        lines.append(f"  stop reason: {info.stop_reason or status.stop_reason}")
    if status.time_to_target_seconds >= 0:
        lines.append(f"  target loss reached after {status.time_to_target_seconds:.1f} s")
    if info.model_path:
        lines.append(f"  model: {info.model_path}")
    if status.num_groups_formed:
        lines.append(f"  groups: {status.num_groups_formed} formed, {status.num_conflicts} "
                     f"conflicts, {status.num_groups_cancelled} cancelled, "
                     f"{status.num_groups_failed} failed")
    if status.num_restarts:
        lines.append(f"  restart rounds: {status.num_restarts}")
    if status.num_worker_rows > len(status.workers):
        lines.append(f"  workers sent: the first {len(status.workers)} of "
                     f"{status.num_worker_rows} (a status lists at most "
                     f"{len(status.workers)}); the rows below are of those")
    if status.workers:
        rows = [["RANK", "WORKER", "ID", "STATE", "ITERATION", "LOSS", "ERROR"]]
        shown = sorted(status.workers, key=lambda w: (w.rank, w.worker_id))
        if len(shown) > STATUS_MAX_WORKER_ROWS:  # the departed and furthest behind first
            states = Counter(_WORKER_STATES[w.state] for w in shown)
            lines.append("  workers: " + ", ".join(f"{n} {state}"
                                                   for state, n in sorted(states.items())))
            lines.append(f"  listed: {STATUS_MAX_WORKER_ROWS} of {len(shown)}, those that left "
                         "or failed and those furthest behind first (--json lists every one sent)")
            shown = sorted(shown, key=lambda w: (w.state not in _GONE, w.iteration,
                                                 w.worker_id))[:STATUS_MAX_WORKER_ROWS]
        for w in shown:
            rows.append([str(w.rank), f"{w.host}/{w.local_rank}", str(w.worker_id),
                         _WORKER_STATES[w.state], str(w.iteration),
                         f"{w.loss:.4f}" if w.loss else "-", w.error or ""])
        lines += ["", *("  " + r for r in text_table(rows).splitlines())]
    if status.loss_curve:
        curve = status.loss_curve
        picks = [curve[round(i * (len(curve) - 1) / 4)] for i in range(5)]
        lines.append("")
        lines.append("  loss: " + "  ".join(f"{p.seconds:.0f}s {p.loss:.4f}" for p in picks))
    return "\n".join(map(printable, lines))  # one line each, whatever a name holds
