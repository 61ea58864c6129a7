"""Which collective this process waits in, and what to say when one fails.

In a lock-step run (allreduce, ripples-static) every worker waits in every collective
for the slowest peer. A peer that is alive but busy between steps (an evaluation or a
save on rank 0) is waited for: the collective timeout of those protocols is long (torch's
30 minutes). A dead peer is the coordinator's to find, by its lease; when it stops the run
for it, the worker's heartbeat thread ends a process held in a collective that can no
longer complete (`end_if_stuck`), as a restart round's backstop does, instead of waiting
out the timeout.

The protocols mark their collectives here (`COLLECTIVES.inside(...)`, or enter/leave
around DDP's asynchronous buckets); the worker reports how long it has waited in its
current one with its progress (`Progress.collective_wait_seconds`), so that a worker whose
collective failed can tell which peers were not in it (`explain_failure`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from ripples.rpc import CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:  # the service commands import this module without torch
    import torch

logger = logging.getLogger(__name__)

STUCK_GRACE_SECONDS = 2.0
"""After the coordinator stopped a lock-step run because a member was lost, a worker
still inside one collective this long ends its process (the collective needs the lost
member)."""
STUCK_EXIT_CODE = 1
"""The exit code of a process ended that way: its run failed."""
TIMEOUT_OPTION = (
    "raise the collective timeout: --collective-timeout-seconds of `ripples run` or "
    "`ripples coordinator serve` (collective_timeout_seconds in a config file's [run] "
    "or [coordinator.serve] table, RunSettings.collective_timeout_seconds; 0, the "
    "default, is 1800 s for lock-step protocols and 60 s for the others)")
"""Where the collective timeout is set, in every spelling."""
PEER_ERROR_CHARS = 300
"""A failed peer's error is quoted up to its first sentence, at most this long."""
GONE_STATES = (pb.WORKER_STATE_FAILED, pb.WORKER_STATE_EXPIRED, pb.WORKER_STATE_LEFT)


class StatusSource(Protocol):
    """What can tell the run's status (a CoordinatorClient)."""

    def run_status(self) -> pb.RunStatus: ...


class CollectiveWatch:
    """The collective this process's training thread waits in now, if any.

    Marked by the protocols (nested or overlapping marks count: DDP keeps several bucket
    all-reduces in flight, and the wait lasts while one is); read by the heartbeat
    thread. `failure` keeps the last failure explained here, so that the error that ends
    the process can be reported in these words rather than in torch's wrapping of them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._what = ""
        self._since = 0.0
        self._depth = 0
        self.failure = ""

    def enter(self, what: str) -> None:
        with self._lock:
            if self._depth == 0:
                self._what, self._since = what, time.monotonic()
            self._depth += 1

    def leave(self) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)

    @contextlib.contextmanager
    def inside(self, what: str) -> Iterator[None]:
        self.enter(what)
        try:
            yield
        finally:
            self.leave()

    def waiting(self) -> tuple[str, float]:
        """(the collective, seconds waited in it), or ("", 0.0) outside any."""
        with self._lock:
            if self._depth == 0:
                return "", 0.0
            return self._what, time.monotonic() - self._since

    def error_text(self, kind: type[BaseException], value: BaseException) -> str:
        """How an uncaught error is reported (a FAILED worker's reason): as a collective
        failure explained here, if it is one (torch wraps the explanation of a failure in
        DDP's backward in its own words), else `Type: message`."""
        text = str(value)
        if self.failure and self.failure in text:
            return f"{kind.__name__}: {self.failure}"
        return f"{kind.__name__}: {text}"


COLLECTIVES = CollectiveWatch()
"""This process's watch (one training thread per process)."""


def backend_message(err: BaseException) -> str:
    """The gist of gloo's (or NCCL's) error: its first sentence, without torch's
    wrapping and the source location."""
    text = str(err).replace("Got the following error when running the callback: ", "")
    text = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    text = re.sub(r"^(RuntimeError: )?\[[^\]]*:\d+\] ", "", text)
    return text.split(". ")[0]


def is_timeout(err: BaseException) -> bool:
    """The collective ran out of time (gloo: "Timed out waiting ...ms"), rather than
    failed (a peer's connection closed)."""
    return isinstance(err, TimeoutError) or "timed out" in str(err).lower()


def megabytes(tensor: torch.Tensor) -> str:
    """A tensor's size in words for a collective's description ("0.48 MB")."""
    return f"{tensor.numel() * tensor.element_size() / 1e6:.3g} MB"


def _gone(name: str, w: pb.WorkerStatus) -> str:
    """A worker that left the run, its state and the first sentence of its error."""
    state = pb.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
    why = w.error.split(". ")[0][:PEER_ERROR_CHARS] if w.error else ""
    return f"{name} {state}" + (f" ({why})" if why else "")


def describe_ranks(status: pb.RunStatus | None, ranks: list[int]) -> str:
    """What the workers of `ranks` were doing, as the coordinator last heard (for a
    wait on them that ran out): gone and why, inside which collective and for how long,
    or between steps; empty without a status."""
    if status is None:
        return ""
    parts = []
    # A rank's newest worker speaks for it (a replacement, not the one it replaced).
    newest = {w.rank: w for w in sorted(status.workers, key=lambda w: w.worker_id)}
    for w in sorted(newest.values(), key=lambda w: w.rank):
        if w.rank not in ranks:
            continue
        name = f"rank {w.rank} (worker {w.worker_id}, host {w.host})"
        if w.state in GONE_STATES:
            parts.append(_gone(name, w))
        elif w.progress.collective_wait_seconds > 0:
            what = w.progress.collective or "a collective"
            parts.append(f"{name} in {what} for {w.progress.collective_wait_seconds:.0f} s")
        else:
            parts.append(f"{name} not in a collective, at step {w.progress.iteration}")
    missing = sorted(set(ranks) - set(newest))
    if missing:
        parts.append(f"ranks {missing} not registered with the coordinator")
    return "; ".join(parts)


def rank_describer(client: StatusSource) -> Callable[[list[int]], str]:
    """`describe_ranks` of the coordinator's status at the moment of asking (what a
    timed-out wait on some ranks calls to say what held them)."""
    def describe(ranks: list[int]) -> str:
        try:
            return describe_ranks(client.run_status(), ranks)
        except CoordinatorCallError as err:
            return f"(the coordinator could not say: {err})"
    return describe


def describe_peers(status: pb.RunStatus | None, worker_id: int) -> str:
    """The peers that a collective of this worker's lock-step run waited for, as the
    coordinator knows them: the ones that are gone (with why), then the live ones that
    were not waiting in a collective themselves (busy between steps). Empty if none is
    known (no status, or every peer was waiting too)."""
    if status is None:
        return ""
    gone, busy = [], []
    for w in sorted(status.workers, key=lambda w: w.rank):
        if w.worker_id == worker_id:
            continue
        name = f"worker {w.worker_id} (rank {w.rank}, host {w.host})"
        if w.state in GONE_STATES:
            gone.append(_gone(name, w))
        elif w.progress.collective_wait_seconds == 0:
            busy.append(f"{name}, done with step {w.progress.iteration}")
    parts = []
    if gone:
        parts.append("; ".join(gone))
    if busy:
        parts.append(f"{'; '.join(busy)}: alive (heartbeating) but not in a collective, "
                     "busy between steps (an evaluation or a save on some ranks only?)")
    return "; ".join(parts)


def explain_failure(what: str, err: BaseException, *, timeout_seconds: float,
                    peers: str) -> str:
    """The message of a failed collective: which one, the peers it waited for (from
    `describe_peers`), and for a timeout the option that raises it."""
    gist = backend_message(err)
    if is_timeout(err):
        waited = f"; waiting for {peers}" if peers else ""
        return (f"{what} timed out after {timeout_seconds:.0f} s (the collective "
                f"timeout){waited}. If a peer is slow or busy on purpose, {TIMEOUT_OPTION}. "
                f"[{gist}]")
    cause = peers or "a peer's connection closed (its process ended: see its error)"
    return f"{what} failed: {cause}. [{gist}]"


def end_if_stuck(stop_reason: str, leave: Callable[[str], object]) -> None:
    """Called by the heartbeat thread once the coordinator stopped a lock-step run because
    a member was lost: if the training thread has waited in one collective for
    STUCK_GRACE_SECONDS, that collective cannot complete; `leave(error)` tells the
    coordinator why, and the process ends with STUCK_EXIT_CODE (a failure: the run
    failed) rather than wait out the collective timeout."""
    what, seconds = COLLECTIVES.waiting()
    if seconds < STUCK_GRACE_SECONDS:
        return
    error = (f"the run stopped ({stop_reason}) while this worker waited {seconds:.0f} s "
             f"in {what}, which cannot complete without the lost member: ending the "
             f"process (exit code {STUCK_EXIT_CODE})")
    logger.error("%s", error)
    try:
        leave(error)
    except Exception as err:  # noqa: BLE001 (the process ends whatever the coordinator says)
        logger.warning("could not tell the coordinator: %s", err)
    end_process(STUCK_EXIT_CODE)


def end_process(code: int) -> None:
    """End the process now, buffers flushed (the training thread cannot be reached)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
