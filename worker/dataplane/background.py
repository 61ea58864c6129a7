"""A group's P-Reduce in the background (`overlap`): started after one step, its result
applied at a later step boundary, so that the averaging is off the critical path.

Started after step t, the P-Reduce averages x_t, the state as step t left it, while the
worker goes on training: by the time the group's mean x̄_t arrives the worker holds
x_t + u, its own updates since. The mean replaces x_t and the updates stay:

    x ← x + (x̄_t − x_t)

(a snapshot of x_t is kept for it; the collective never touches the live state, so a
failed one changes nothing: docs/data-plane.md rule 4). With no step in between it is the
synchronous P-Reduce's result up to rounding (x_t + (x̄ − x_t) is x̄ within an ulp);
otherwise the members' models agree up to the steps each took meanwhile, as in the
gossip protocols, which apply a communication thread's averages the same way. With an
outer optimizer the group averages the members' outer steps staged from x_t
(worker/dataplane/outer_state.py): the new anchor replaces x_t, the model is that anchor
plus the steps taken since, and those steps are the pseudo-gradient's at the next
synchronisation (`OuterState.commit_late`). The members' non-finite flags ride the
collective as in the synchronous form (worker/dataplane/nonfinite.py): a set flag voids
the result for every member, on the device. The int8 wire
(worker/dataplane/modular_wire.py) synchronises in three collectives, each built from
the one before it (the widths, the payloads, the voided blocks): in the background each
starts when the one before it is seen done, at a step boundary, and the last applies the
result the same way, the steps taken since on top of the group's anchor.

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
from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.dataplane.modular_wire import modular_phases
from ripples.worker.dataplane.outer_state import OuterState
from ripples.worker.dataplane.preduce import Staged


@dataclass(kw_only=True)
class _InFlight:
    comm: Communicator
    works: list[dist.Work]
    """The collectives running now: one per staged buffer (with outer compression, two),
    or the current phase's one (the int8 wire)."""
    phases: Generator[tuple[str, dist.Work], None, None] | None
    """The int8 wire's synchronisation, resumed after each of its collectives
    (modular_wire.modular_phases); None: the SUMs of a staged buffer."""
    device: torch.device
    deadline: float
    """time.monotonic() past which the collective has failed."""
    timeout_seconds: float


class BackgroundAverage:
    """At most one P-Reduce of a worker's averaged state (or outer step) in flight.

    Invariant: while one is in flight, the staging buffers belong to its collective and
    nothing else stages (the protocol lands it before any other collective).
    """

    def __init__(self, state: AveragedState, outer: OuterState | None = None) -> None:
        self.state = state
        self.staged: Staged = outer if outer is not None else state
        self.outer = outer
        self._snapshot: torch.Tensor | None = None
        """x_t: the flat state when the P-Reduce in flight started."""
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def start(self, comm: Communicator, timeout_seconds: float) -> None:
        """Snapshot the state, stage it (state/|G| and the flag, or the outer step's
        buffers) and start the group's SUMs, or the int8 wire's first collective;
        returns without waiting for them."""
        assert self._in_flight is None, "a P-Reduce is already in flight"
        flat = self.state.flat
        if self._snapshot is None or self._snapshot.numel() != flat.numel():
            self._snapshot = torch.empty_like(flat)
        with torch.no_grad():
            self._snapshot.copy_(flat)
        phases = None
        try:
            if self.outer is not None and self.outer.modular is not None:
                phases = modular_phases(self.outer, comm, self._snapshot)
                works = [next(phases)[1]]
            else:
                scale = 1.0 / comm.size
                buffers = ([self.state.stage(scale)] if self.outer is None
                           else self.outer.stage(scale))
                works = [comm.start_allreduce_sum(buffer) for buffer in buffers]
        except BaseException:  # one of them may be running: its buffers are its own now
            if phases is not None:
                phases.close()
            self.staged.abandon()
            raise
        self._in_flight = _InFlight(comm=comm, works=works, phases=phases, device=flat.device,
                                    deadline=time.monotonic() + timeout_seconds,
                                    timeout_seconds=timeout_seconds)

    def poll(self) -> bool:
        """Whether the P-Reduce in flight has landed: done and applied (True), or still
        running (False); never waits (the int8 wire goes on to its next collective where
        one is done). Raises (RuntimeError, TimeoutError past its deadline) when it
        failed: the state keeps its local values."""
        flight = self._in_flight
        assert flight is not None, "poll() with no P-Reduce in flight"
        while all(work.is_completed() for work in flight.works):
            if self._advance(flight):
                return True
        if time.monotonic() > flight.deadline:
            self._fail()
            raise TimeoutError(f"the background P-Reduce on {flight.comm.key} did not "
                               f"finish in {flight.timeout_seconds:g} s")
        return False

    def wait(self) -> None:
        """Land the P-Reduce in flight now. On the CPU: block until it is done, up to its
        deadline; raises as `poll` does. On a GPU the host does not wait: the update (and
        each further collective of the int8 wire) is enqueued after the collective on
        the device, which waits for it only if it is not done by then (a collective that
        never finishes is ended by NCCL's watchdog after the communicator's timeout, the
        collective timeout, as under DDP)."""
        flight = self._in_flight
        assert flight is not None, "wait() with no P-Reduce in flight"
        while True:
            if flight.device.type != "cuda":
                self._block(flight)
            if self._advance(flight):
                return

    def _block(self, flight: _InFlight) -> None:
        """Wait for the collectives running now, up to the flight's deadline."""
        done = True
        try:
            for work in flight.works:
                if not done:
                    break
                left = flight.deadline - time.monotonic()
                if left <= 0:  # (a wait of 0 would be one without a timeout)
                    done = work.is_completed()
                    continue
                done = work.wait(datetime.timedelta(seconds=max(left, 0.001))) is not False
        except BaseException:
            self._fail()
            raise
        if not done:
            self._fail()
            raise TimeoutError(f"the background P-Reduce on {flight.comm.key} did not "
                               f"finish in {flight.timeout_seconds:g} s")

    def _advance(self, flight: _InFlight) -> bool:
        """The collectives running now are done (on a GPU: the current stream is ordered
        after them): go on to the int8 wire's next collective (False), or apply the
        group's result to the state as it is now (True): x ← x + (x̄ − x_t), or the outer
        form (`commit_late`, or the int8 wire's last phase); nothing where a member's
        flag was set."""
        try:
            for work in flight.works:  # done: raises its error; on a GPU, orders the
                work.wait()  # current stream after the collective's
            if flight.phases is not None:
                for _, work in flight.phases:  # resumes it: its next collective, or none
                    flight.works = [work]
                    return False
        except BaseException:
            self._fail()
            raise
        self._in_flight = None
        if flight.phases is None:
            snapshot = self._snapshot
            assert snapshot is not None
            if self.state.flat.numel() != snapshot.numel():  # the state was rebuilt
                self.staged.abandon()
                raise RuntimeError("the averaged state changed size while its P-Reduce "
                                   "was in flight; the group's result was not applied")
            self.staged.commit_late(snapshot)
        self.state.forget_flag()  # the step's flag describes the state before the landing
        return True

    def _fail(self) -> None:
        """Forget the collective's buffer, which it may still write into (rule 4)."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None and flight.phases is not None:
            flight.phases.close()
        self.staged.abandon()

    def abandon(self) -> None:
        """Give up on the P-Reduce in flight without waiting (the worker is failing):
        the state keeps its local values."""
        if self._in_flight is not None:
            self._fail()
