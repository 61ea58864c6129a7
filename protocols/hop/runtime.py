"""`hop`: queue-based decentralized training (engine.py holds the protocol's state).

Parameters and tokens travel worker to worker, never through the coordinator: every
directed edge i -> j of the topology has its own two-member communicator (gloo on CPU,
NCCL on CUDA), built in one global edge order so that no two workers wait on each other
while building. On the link i -> j worker i sends frames and worker j receives them, each
side in a thread of its own: an update frame (i's parameters at the start of an
iteration) or a credit frame (i entered an iteration: j may spend a token). Our
topologies are undirected, so i's credits for an in-neighbour j travel on the link i -> j.

An iteration's parameters go out when it starts (`begin()` for iteration 0, then at the
end of each step, for the next), so they travel while the step computes; after the local
optimizer step the worker waits for the Recv, reduces, adds the step's own change and
waits for the tokens of the next iteration (or jumps). Every wait polls the coordinator's
stop and the link threads' errors and gives up with a message after `max_wait_seconds`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from ripples.protocols.hop.engine import CreditMsg, HopWorker, UpdateMsg
from ripples.protocols.hop.settings import HopSettings
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.metrics import MetricSpec
from ripples.worker.protocol import (
    Protocol,
    ProtocolContext,
    SyncResult,
    max_peer_wait_seconds,
)

logger = logging.getLogger(__name__)

UPDATE, CREDIT, BYE = 1, 2, 3
POLL_SECONDS = 0.1
JOIN_SECONDS = 5.0
STOP_GRACE_SECONDS = 3.0
"""After a link fails, how long to wait for the coordinator's stop (a peer that crashed
or left makes the coordinator stop the run) before reporting the link's error."""


class _Link:
    """One direction of one edge: a communicator and the thread that uses it."""

    def __init__(self, comm: Communicator, peer: int, timeout: float) -> None:
        self.comm, self.peer, self.timeout = comm, peer, timeout
        self.thread: threading.Thread | None = None

    def send(self, tensor: torch.Tensor) -> None:
        self.comm.send(tensor, 1, self.timeout)  # the sender is member 0 of the link

    def recv(self, tensor: torch.Tensor) -> None:
        self.comm.recv(tensor, 0, self.timeout)


class HopProtocol(Protocol):
    name = "hop"
    metrics = (
        MetricSpec("ripples_worker_hop_lead_iterations", "gauge",
                   "hop: iterations this worker is ahead of its slowest out-neighbour, from "
                   "its tokens (negative: behind all of them); at most max_ig."),
        MetricSpec("ripples_worker_hop_queue_depth", "gauge",
                   "hop: updates held in the worker's update queue."),
        MetricSpec("ripples_worker_hop_stale_updates", "counter",
                   "hop: received updates dropped as too old to be used."),
        MetricSpec("ripples_worker_hop_iterations_skipped", "counter",
                   "hop: iterations a straggler skipped by jumping ahead."),
    )

    def __init__(self, ctx: ProtocolContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.settings = HopSettings.of_config(cfg)
        neighbours = tuple(sorted(ctx.membership.neighbours))
        self.me = ctx.worker_id
        self.timeout = cfg.collective_timeout_seconds
        self.max_wait_seconds = max_peer_wait_seconds(cfg)
        self.engine: HopWorker[torch.Tensor] = HopWorker(
            self.me, neighbours, neighbours, self.settings)
        self._cond = threading.Condition()
        self._outbox: dict[int, deque[tuple[int, int, int, torch.Tensor | None]]] = {
            j: deque() for j in neighbours}
        self._error: BaseException | None = None
        self._closing = False
        self._peer_closed: set[int] = set()  # peers that said BYE: send them BYE back, no more
        self._snapshot: torch.Tensor | None = None
        self._reported_stale = 0
        self._reported_skipped = 0
        self._metrics = ctx.metrics.declare(*self.metrics)
        # (time.monotonic(), iteration) at every advance: one clock for every process of
        # a host, stamped before the credits that let others move on are sent.
        self._timeline: list[tuple[float, int]] = []
        self._out: dict[int, _Link] = {}
        self._in: dict[int, _Link] = {}
        self._build_links(neighbours)

    # ------------------------------------------------------------ links
    def _build_links(self, neighbours: tuple[int, ...]) -> None:
        run_id = self.ctx.config.run_id
        # Every edge of this worker in one global order (sender, receiver): the builds of
        # a two-member group meet, and no cycle of waiting builds can form.
        edges = sorted([(self.me, j) for j in neighbours] + [(j, self.me) for j in neighbours])
        for src, dst in edges:
            key = f"hop/{run_id}/{src}-{dst}"
            comm = self.ctx.comms.get(key, 0 if src == self.me else 1, 2, create=True)
            if src == self.me:
                self._out[dst] = _Link(comm, dst, self.timeout)
            else:
                self._in[src] = _Link(comm, src, self.timeout)
        for j, link in self._out.items():
            link.thread = threading.Thread(target=self._send_loop, args=(link,), daemon=True,
                                           name=f"hop-send-{self.me}-{j}")
            link.thread.start()
        for j, link in self._in.items():
            link.thread = threading.Thread(target=self._recv_loop, args=(link,), daemon=True,
                                           name=f"hop-recv-{j}-{self.me}")
            link.thread.start()

    def _dispatch(self, msgs: Sequence[UpdateMsg[torch.Tensor] | CreditMsg]) -> None:
        """Queue the engine's messages on their links (caller holds _cond)."""
        for m in msgs:
            if m.to in self._peer_closed:
                continue
            if isinstance(m, UpdateMsg):
                self._outbox[m.to].append((UPDATE, m.iteration, 1, m.payload))
            else:
                self._outbox[m.to].append((CREDIT, m.iteration, m.count, None))
        self._cond.notify_all()

    def _send_loop(self, link: _Link) -> None:
        header = torch.zeros(3, dtype=torch.int64, device=self.ctx.device)
        try:
            while True:
                with self._cond:
                    box = self._outbox[link.peer]
                    while not box and not self._closing and link.peer not in self._peer_closed:
                        self._cond.wait()
                    if not box:
                        break
                    kind, iteration, count, payload = box.popleft()
                header.copy_(torch.tensor([kind, iteration, count]))
                link.send(header)
                if payload is not None:
                    link.send(payload)
            # Closing, or the peer closed: BYE ends the peer's receiving thread (a peer
            # that said BYE waits for ours before it lets go of the link).
            header.copy_(torch.tensor([BYE, 0, 0]))
            link.send(header)
        except Exception as err:  # noqa: BLE001 (reported to the compute thread)
            self._fail(err, f"sending to worker {link.peer}")

    def _recv_loop(self, link: _Link) -> None:
        header = torch.zeros(3, dtype=torch.int64, device=self.ctx.device)
        try:
            while True:
                link.recv(header)
                kind, iteration, count = (int(v) for v in header.tolist())
                if kind == BYE:
                    with self._cond:
                        self._peer_closed.add(link.peer)
                        self._outbox[link.peer].clear()
                        self._cond.notify_all()
                    return
                if kind == UPDATE:
                    payload = torch.empty_like(self.ctx.state.flat)
                    link.recv(payload)
                    with self._cond:
                        self.engine.on_update(UpdateMsg(self.me, link.peer, iteration, payload))
                        self._cond.notify_all()
                elif kind == CREDIT:
                    with self._cond:
                        self.engine.on_credit(CreditMsg(self.me, link.peer, iteration, count))
                        self._cond.notify_all()
                else:
                    raise RuntimeError(f"unknown hop frame kind {kind}")
        except Exception as err:  # noqa: BLE001
            self._fail(err, f"receiving from worker {link.peer}")

    def _fail(self, err: BaseException, what: str) -> None:
        with self._cond:
            if not self._closing and self._error is None:
                self._error = RuntimeError(f"hop link failed {what}: {err}")
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str) -> float:
        """Block until ready() (caller holds _cond); returns the seconds waited."""
        t0 = time.perf_counter()
        while not ready():
            if self._error is not None:
                self._raise_unless_stopped()
            if self.ctx.stop_requested.is_set():
                raise _Stopped
            waited = time.perf_counter() - t0
            if waited > self.max_wait_seconds:
                raise TimeoutError(f"hop worker {self.me} waited {waited:.0f} s for {what} "
                                   f"at iteration {self.engine.iteration}")
            self._cond.wait(POLL_SECONDS)
        return time.perf_counter() - t0

    def _raise_unless_stopped(self) -> None:
        """A link failed: a stop from the coordinator (the peer left or crashed) ends the
        run cleanly; without one the error is this worker's."""
        assert self._error is not None
        if self.ctx.stop_requested.wait(STOP_GRACE_SECONDS):
            raise _Stopped
        raise self._error

    # ------------------------------------------------------------ compute thread
    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        with self._cond:
            failed = self._error is not None
        if failed:
            try:
                self._raise_unless_stopped()
            except _Stopped:
                return self.ctx.coordinator_stop()
        if self.ctx.stop_requested.is_set():
            return self.ctx.coordinator_stop()
        return None

    def begin(self) -> None:
        """Enter iteration 0: send its parameters (the identical initial models)."""
        self._enter()

    def _enter(self) -> None:
        """Send the parameters the current iteration starts from to the out-neighbours;
        they are also the base its reduce adds the step's own change to."""
        snapshot = self.ctx.state.flat.detach().clone()
        with self._cond:
            self._dispatch(self.engine.enter(snapshot))
        self._snapshot = snapshot

    def after_step(self, completed: int) -> SyncResult:
        assert self._snapshot is not None, "begin() sends iteration 0's parameters"
        flat = self.ctx.state.flat
        result = SyncResult()
        try:
            with self._cond:
                result.wait_seconds += self._wait(self.engine.recv_ready, "in-neighbours' updates")
                got = self.engine.recv(self._snapshot)
            t0 = time.perf_counter()
            with torch.no_grad():  # x_{k+1} = Reduce(...) + the step's own change
                flat.sub_(self._snapshot).add_(got.reduce())
            result.preduce_seconds += time.perf_counter() - t0
            result.num_groups, result.group_sizes = 1, (len(got.payloads),)
            with self._cond:
                result.wait_seconds += self._wait(self.engine.can_advance, "tokens")
                credits = self.engine.advance(self.engine.jump_length())
                self._timeline.append((time.monotonic(), self.engine.iteration))
                self._dispatch(credits)
                if self.engine.jump_recv is not None:
                    result.wait_seconds += self._wait(self.engine.recv_ready,
                                                      "the updates before a jump")
                    renewed = self.engine.recv(flat.detach().clone())
                    with torch.no_grad():
                        flat.copy_(renewed.reduce())
                self._observe()
        except _Stopped:
            return self.ctx.coordinator_stop()
        # The next iteration starts now: its parameters go out at once, while this
        # worker computes its step (they are x_{k+1}, which the next step starts from).
        self._enter()
        return result

    def _observe(self) -> None:
        """The engine's state for the metrics (caller holds _cond)."""
        e, m = self.engine, self._metrics
        m["ripples_worker_hop_lead_iterations"].set(-e.lag())
        m["ripples_worker_hop_queue_depth"].set(e.queue_depth())
        m["ripples_worker_hop_stale_updates"].inc(e.num_stale_dropped - self._reported_stale)
        m["ripples_worker_hop_iterations_skipped"].inc(
            e.iterations_skipped - self._reported_skipped)
        self._reported_stale, self._reported_skipped = e.num_stale_dropped, e.iterations_skipped

    def record(self) -> dict[str, object]:
        with self._cond:
            e = self.engine
            return {
                "worker_id": self.me, "out_neighbours": list(e.out_neighbours),
                "iteration": e.iteration,
                "jumps": e.num_jumps, "iterations_skipped": e.iterations_skipped,
                "stale_updates": e.num_stale_dropped, "updates_not_sent": e.num_not_sent,
                "iteration_timeline": [list(entry) for entry in self._timeline],
            }

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + JOIN_SECONDS
        for link in [*self._out.values(), *self._in.values()]:
            if link.thread is not None:
                link.thread.join(max(0.0, deadline - time.monotonic()))


class _Stopped(Exception):
    """The coordinator stopped the run while this worker waited."""
