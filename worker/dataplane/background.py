"""A group's P-Reduce in the background (`overlap`): started after one step, its result
applied at a later step boundary, so that the averaging is off the critical path.

Started after step t, the P-Reduce averages x_t, the state as step t left it, while the
worker goes on training: by the time the group's mean x̄_t arrives the worker holds
x_t + u, its own updates since. The mean replaces x_t and the updates stay:

    x ← x + (x̄_t − x_t)

(a snapshot of x_t is kept for it; the collective never touches the live state, so a
failed one changes nothing: docs/data-plane.md rule 4). With no step in between it is the
synchronous P-Reduce's result exactly; otherwise the members' models agree up to the
steps each took meanwhile, as in the gossip protocols, which apply a communication
thread's averages the same way. The members' non-finite flags ride the collective as in
the synchronous form (worker/dataplane/nonfinite.py): a set flag voids the mean for every
member, on the device.

The host never waits for the collective to see whether it is done: `poll` asks the
backend's work object (`is_completed`, a query of its CUDA event on a GPU), and the
result is applied, on the device and in stream order, once it is. `wait` lands it when
the protocol needs it before it can go on (before its next group, at the stop): on the
CPU it blocks up to the collective's deadline; on a GPU it enqueues the update after the
collective, so that the device, not the host, waits for whatever is left of it. A
collective not done by its deadline fails like a synchronous one that timed out.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.dataplane.nonfinite import zero_if_flagged


@dataclass(kw_only=True)
class _InFlight:
    comm: Communicator
    work: dist.Work
    staged: torch.Tensor
    """State/|G| and the flag when started; the group's sum once done."""
    deadline: float
    """time.monotonic() past which the collective has failed."""
    timeout_seconds: float


class BackgroundAverage:
    """At most one P-Reduce of a worker's averaged state in flight.

    Invariant: while one is in flight, `state`'s staging buffer belongs to its collective
    and nothing else stages (the protocol lands it before any other collective).
    """

    def __init__(self, state: AveragedState) -> None:
        self.state = state
        self._snapshot: torch.Tensor | None = None
        """x_t: the flat state when the P-Reduce in flight started."""
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def start(self, comm: Communicator, timeout_seconds: float) -> None:
        """Snapshot the state, stage it (state/|G| and the flag) and start the group's SUM;
        returns without waiting for it."""
        assert self._in_flight is None, "a P-Reduce is already in flight"
        flat = self.state.flat
        if self._snapshot is None or self._snapshot.numel() != flat.numel():
            self._snapshot = torch.empty_like(flat)
        with torch.no_grad():
            self._snapshot.copy_(flat)
        staged = self.state.stage(1.0 / comm.size)
        work = comm.start_allreduce_sum(staged)
        self._in_flight = _InFlight(comm=comm, work=work, staged=staged,
                                    deadline=time.monotonic() + timeout_seconds,
                                    timeout_seconds=timeout_seconds)

    def poll(self) -> bool:
        """Whether the P-Reduce in flight has landed: done and applied (True), or still
        running (False); never waits. Raises (RuntimeError, TimeoutError past its
        deadline) when it failed: the state keeps its local values."""
        flight = self._in_flight
        assert flight is not None, "poll() with no P-Reduce in flight"
        if not flight.work.is_completed():
            if time.monotonic() > flight.deadline:
                self._fail()
                raise TimeoutError(f"the background P-Reduce on {flight.comm.key} did not "
                                   f"finish in {flight.timeout_seconds:g} s")
            return False
        self._land(flight)
        return True

    def wait(self) -> None:
        """Land the P-Reduce in flight now. On the CPU: block until it is done, up to its
        deadline; raises as `poll` does. On a GPU the host does not wait: the update is
        enqueued after the collective on the device, which waits for it only if it is
        not done by then (a collective that never finishes is ended by NCCL's watchdog
        after the communicator's timeout, the collective timeout, as under DDP)."""
        flight = self._in_flight
        assert flight is not None, "wait() with no P-Reduce in flight"
        if flight.staged.device.type == "cuda":
            self._land(flight)
            return
        left = max(0.0, flight.deadline - time.monotonic())
        try:
            done = flight.work.wait(datetime.timedelta(seconds=left))
        except BaseException:
            self._fail()
            raise
        if done is False:
            self._fail()
            raise TimeoutError(f"the background P-Reduce on {flight.comm.key} did not "
                               f"finish in {flight.timeout_seconds:g} s")
        self._land(flight)

    def _land(self, flight: _InFlight) -> None:
        """Apply the group's mean as x ← x + (x̄ − x_t), unless a member's flag was set."""
        try:
            flight.work.wait()  # done: raises its error; on a GPU, orders this stream after
        except BaseException:
            self._fail()
            raise
        self._in_flight = None
        snapshot, flat = self._snapshot, self.state.flat
        assert snapshot is not None
        if flat.numel() != snapshot.numel():  # the state was rebuilt meanwhile
            raise RuntimeError("the averaged state changed size while its P-Reduce was in "
                               "flight; the group's mean was not applied")
        with torch.no_grad():
            delta = flight.staged[:-1].sub_(snapshot)  # the group's mean − x_t
            zero_if_flagged(flight.staged[-1:], delta)
            flat.add_(delta)
        # The staging buffer is the state's again (its next stage overwrites it).

    def _fail(self) -> None:
        """Forget the collective's buffer, which it may still write into (rule 4)."""
        self._in_flight = None
        self.state.abandon()

    def abandon(self) -> None:
        """Give up on the P-Reduce in flight without waiting (the worker is failing):
        the state keeps its local values."""
        if self._in_flight is not None:
            self._fail()
