"""Restart rounds (pure code): how a run whose protocol restarts on a membership change
(torchelastic's re-rendezvous) takes a failure, a graceful leave or a joiner.

A round ends every live member's part (its heartbeat says restart; its process exits
and its launcher starts it again), registration opens anew, and the membership forms
once num_workers registered, or after the join window with at least min_workers; each
new member continues the part of the departed member of its rank and restores the last
checkpoint every rank holds. The core pauses the run's clock meanwhile and forms the
membership when `verdict` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ripples.coordinator.config import RunSettings
from ripples.coordinator.registry import WorkerRecord, WorkerState

RESTART_STRAGGLER_WINDOWS = 3
"""A restart round forms without the restarting workers that are not back after this many
join windows (with at least min_workers)."""
RESTART_GIVE_UP_WINDOWS = 6
"""A restart round whose workers did not come back within this many join windows stops
the run (every wait has an end; 90 s with the default window, within the workers' own
start timeout of 120 s)."""


@dataclass(kw_only=True)
class RestartRounds:
    """The restart rounds of one run, and the rules of when one opens, forms and fails."""

    settings: RunSettings
    count: int = 0
    """Restart rounds opened so far."""
    failures: int = 0
    """Of them, the rounds a failure opened (max_restarts bounds these; a joiner's round
    does not count, as with torchelastic)."""
    expected_back: set[tuple[str, int]] = field(default_factory=set)
    """The open round's workers that are alive and restart: (host, local rank) of the
    members it ended and of the one whose failed leave opened it. The round waits for
    them before it forms with fewer than num_workers."""
    began_at: float | None = None
    """When the open round began (None: none is open)."""
    reason: str = ""
    """Why the last round was opened."""

    def refusal(self, live: list[WorkerRecord], *, failure: bool = True) -> str:
        """Why the run cannot restart its workers on a membership change ("" when it
        can): its protocol does not, the restarts are spent, or a member holds no
        checkpoint yet (it would start over from its initial model)."""
        settings = self.settings
        if not settings.restarts:
            return f"{settings.protocol} does not restart its workers"
        if failure and self.failures >= settings.max_restarts:
            return f"max_restarts ({settings.max_restarts}) spent on failures"
        blind = [w.name for w in live if w.progress.checkpoint_step == 0]
        if blind:
            return (f"{blind[0]} holds no checkpoint to restart from (give "
                    "--checkpoint-dir; a script saves with ripples.Checkpointer)")
        return ""

    def open(self, reason: str, now: float, live: list[WorkerRecord], *, failure: bool,
             alive: tuple[tuple[str, int], ...] = ()) -> None:
        """Open a round: every live member's part ends (`restarted`). `failure`: a
        failure opened it; `alive`: (host, local rank) of a departed worker that restarts
        too (it failed and said so: it is alive)."""
        self.count += 1
        self.failures += failure
        self.began_at, self.reason = now, reason
        self.expected_back = {(w.host, w.local_rank) for w in live} | set(alive)
        for w in live:
            w.state, w.restarted = WorkerState.LEFT, True
            w.leave_reason = f"restart round {self.count}: {reason}"

    def verdict(self, now: float, members: list[WorkerRecord], *, shrinks: bool) -> str:
        """What the open round does now: "form" its membership (its join window passed
        with at least min_workers, once every worker it ended is back or after
        RESTART_STRAGGLER_WINDOWS windows), "" wait, or a reason to stop the run (too few
        came back within RESTART_GIVE_UP_WINDOWS windows). `shrinks`: it may form with
        fewer than num_workers (the static schedule waits for every worker: its hosts
        must stay full)."""
        assert self.began_at is not None
        settings = self.settings
        waited = now - self.began_at
        window = settings.join_window_seconds
        missing = self.expected_back - {(w.host, w.local_rank) for w in members}
        waited_enough = waited >= window and (
            not missing or waited >= RESTART_STRAGGLER_WINDOWS * window)
        if waited_enough and len(members) >= settings.min_workers and shrinks:
            return "form"
        if waited >= RESTART_GIVE_UP_WINDOWS * window:
            need = settings.min_workers if shrinks else settings.num_workers
            return (f"restart round {self.count} ({self.reason}): {len(members)} of the "
                    f"{need} workers needed registered within {waited:.0f} s")
        return ""

    def rejoins(self, w: WorkerRecord, live: list[WorkerRecord], *, formed: bool) -> str:
        """Why this departed worker restarts its process and registers anew, or "": a
        round ended its part, or it failed while a round is open (its own failure may
        have opened it), or its lease expired although it lives (a long pause)."""
        round_open = self.began_at is not None and not formed
        if w.restarted or (w.state is WorkerState.FAILED and round_open):
            return f"restart round {self.count}: {self.reason}"
        if w.state is WorkerState.EXPIRED and self.settings.restarts and (
                round_open or not self.refusal(live, failure=False)):
            # Alive after all (a long pause cost it its lease): it restarts and registers
            # anew, joining the open round or opening one for the run to grow back.
            return (f"its lease expired ({w.error}); it registers anew"
                    + (f" in restart round {self.count}" if round_open else ""))
        return ""
