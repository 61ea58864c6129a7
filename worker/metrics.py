"""A worker daemon's Prometheus metrics, served over HTTP from the worker process.

The endpoint starts before the worker registers (the coordinator lists its address in
its service discovery); the metrics appear once the worker knows its id, and carry the
labels worker, host and protocol (low cardinality: never a group id or an iteration).
Observations are made by the compute loop once per iteration, off the collective's path.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ripples.http_server import HEAD_TIMEOUT_SECONDS, connection_cap
from ripples.http_tokens import wsgi_token_gate

if TYPE_CHECKING:
    from ripples.worker.protocol import SyncResult

# `_created` series double every counter and histogram and are of no use to the dashboards.
disable_created_metrics()

logger = logging.getLogger(__name__)

class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape (as prometheus_client's own server), none left at exit; with
    the bounds of every HTTP endpoint (ripples/http_server.py): connections beyond
    connection_cap() are closed as soon as they are accepted, and one whose request head
    is not whole HEAD_TIMEOUT_SECONDS after it connected is shut down (swept every
    poll of serve_forever)."""

    daemon_threads = True
    # socketserver's backlog of 5 drops the handshakes of a crowd, which then trickle
    # in over a minute of retries: the same backlog as the other endpoints.
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(connection_cap())
        self._lock = threading.Lock()
        self._head_deadlines: dict[socket.socket, float] = {}
        """Connections still sending their request head, and when they must be done."""

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self._slots.acquire(blocking=False)  # False: socketserver closes it

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._head_deadlines[request] = time.monotonic() + HEAD_TIMEOUT_SECONDS
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._finished(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._finished(request)

    def head_received(self, request: socket.socket) -> None:
        with self._lock:
            self._head_deadlines.pop(request, None)

    def _finished(self, request: Any) -> None:
        self.head_received(request)
        self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that stalled or went away (a timeout, a reset) is not worth a
        traceback on stderr; anything else is."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [s for s, deadline in self._head_deadlines.items() if deadline < now]
            for s in overdue:
                del self._head_deadlines[s]
        for s in overdue:  # its handler's read returns at once; its thread ends
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class _Quiet(WSGIRequestHandler):
    """No line on stderr per scrape; tells the server once the request head is read."""

    timeout = HEAD_TIMEOUT_SECONDS  # no single read or write blocks longer

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.head_received(self.connection)  # type: ignore[attr-defined]
        return parsed

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass


LABELS = ("worker", "host", "protocol")
# One iteration takes milliseconds on a GPU and up to seconds for a CPU straggler.
ITERATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A cached-communicator P-Reduce of a small model is ~1 ms; a new communicator or a big
# model over gloo takes tens to hundreds of milliseconds.
PREDUCE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
GROUP_SIZE_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128)


class CacheCounts(Protocol):
    """What the metrics read from the communicator cache (worker.communicators)."""

    num_hits: int
    num_misses: int

    def __len__(self) -> int: ...


class _CacheCollector(Collector):
    def __init__(self, cache: CacheCounts, labels: list[str]) -> None:
        self.cache = cache
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily("ripples_worker_communicator_cache_hits",
                                   "P-Reduces that reused a cached communicator.",
                                   labels=LABELS)
        hits.add_metric(self.labels, float(self.cache.num_hits))
        misses = CounterMetricFamily("ripples_worker_communicator_cache_misses",
                                     "P-Reduces that had to build a communicator.",
                                     labels=LABELS)
        misses.add_metric(self.labels, float(self.cache.num_misses))
        cached = GaugeMetricFamily("ripples_worker_cached_communicators",
                                   "Communicators held in the cache.", labels=LABELS)
        cached.add_metric(self.labels, float(len(self.cache)))
        yield from (hits, misses, cached)


@dataclass(frozen=True)
class MetricSpec:
    """A metric a protocol exports besides the shared ones (hop's lead, gossip's dropped
    exchanges, ...). Names follow the house conventions: `ripples_worker_<protocol>_...`,
    base units; prometheus-client adds `_total` to counters."""

    name: str
    kind: Literal["gauge", "counter"]
    documentation: str


class ProtocolMetrics:
    """Where a protocol declares its own metrics (a runtime's `metrics` class attribute),
    labelled like every worker metric, so shared code needs no protocol branch."""

    def __init__(self, registry: CollectorRegistry | None, labels: list[str]) -> None:
        self.registry = registry
        self.labels = labels or ["", "", ""]

    def declare(self, *specs: MetricSpec) -> dict[str, Any]:
        """The labelled metrics of `specs`, by name (registered when the worker exports
        metrics; otherwise they count where nobody reads)."""
        made: dict[str, Any] = {}
        for spec in specs:
            kind = Gauge if spec.kind == "gauge" else Counter
            made[spec.name] = kind(spec.name, spec.documentation, LABELS,
                                   registry=self.registry).labels(*self.labels)
        return made


class WorkerMetrics:
    """The worker's registry and HTTP endpoint. serve() first, then attach(), then observe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.port = 0
        self._server: object | None = None
        self._thread: threading.Thread | None = None
        self._attached = False
        self.labels: list[str] = []

    def for_protocol(self) -> ProtocolMetrics:
        """Where the run's protocol declares its own metrics (after attach())."""
        return ProtocolMetrics(self.registry, self.labels)

    def serve(self, host: str, port: int, tokens: tuple[str, ...] = ()) -> int:
        """Start the HTTP endpoint (port 0: a free one), which asks for one of `tokens`
        when given (the run's: ripples/http_tokens.py); returns the port."""
        app = wsgi_token_gate(make_wsgi_app(self.registry), tokens)
        try:
            server = make_server(host, port, app, _ThreadingServer, handler_class=_Quiet)
        except OSError as err:
            raise OSError(f"cannot serve metrics on {host}:{port}: {err}; "
                          "pick another --metrics-port (0: any free port)") from err
        thread = threading.Thread(target=server.serve_forever, name="ripples-metrics",
                                  daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        self.port = int(server.server_port)
        return self.port

    def attach(self, *, worker_id: int, host: str, protocol: str, cache: CacheCounts) -> None:
        """Create the labelled metrics once the worker knows its id."""
        values = [str(worker_id), host, protocol]
        self.labels = values
        reg = self.registry
        self.iterations = Counter("ripples_worker_iterations", "Training iterations completed.",
                                  LABELS, registry=reg).labels(*values)
        phase = Counter(
            "ripples_worker_time_seconds",
            "Time spent per phase of an iteration: compute (forward, backward, step, and an "
            "injected slowdown), group_wait (waiting for a group), preduce (in collectives).",
            [*LABELS, "phase"], registry=reg)
        self.compute_seconds = phase.labels(*values, "compute")
        self.wait_seconds = phase.labels(*values, "group_wait")
        self.preduce_seconds = phase.labels(*values, "preduce")
        self.iteration_duration = Histogram(
            "ripples_worker_iteration_duration_seconds",
            "Wall time of one iteration (compute + group wait + P-Reduce).",
            LABELS, buckets=ITERATION_BUCKETS, registry=reg).labels(*values)
        self.loss = Gauge("ripples_worker_training_loss",
                          "Training loss, mean over the last iterations' mini-batches.",
                          LABELS, registry=reg).labels(*values)
        self.group_size = Histogram("ripples_worker_group_size",
                                    "Members of each group this worker averaged in.",
                                    LABELS, buckets=GROUP_SIZE_BUCKETS,
                                    registry=reg).labels(*values)
        self.preduce_duration = Histogram(
            "ripples_worker_preduce_duration_seconds",
            "Duration of one P-Reduce (or all-reduce), communicator lookup included.",
            LABELS, buckets=PREDUCE_BUCKETS, registry=reg).labels(*values)
        self.preduce_bytes = Counter("ripples_worker_preduce_bytes",
                                     "Bytes this worker fed into P-Reduce collectives.",
                                     LABELS, registry=reg).labels(*values)
        self.preduce_failures = Counter("ripples_worker_preduce_failures",
                                        "P-Reduces that failed (timeout, dead peer).",
                                        LABELS, registry=reg).labels(*values)
        reg.register(_CacheCollector(cache, values))
        self._attached = True

    def observe_iteration(self, *, compute_seconds: float, result: SyncResult,
                          loss: float, iterations: int | None = None) -> None:
        """One iteration and its synchronisation; or, for LPP-SGD's averaging process,
        one averaging round after `iterations` updates made by the updaters (whose wall
        time per iteration is not the sum of the phases: no duration is observed)."""
        if not self._attached:
            return
        self.iterations.inc(1 if iterations is None else iterations)
        self.compute_seconds.inc(compute_seconds)
        self.wait_seconds.inc(result.wait_seconds)
        self.preduce_seconds.inc(result.preduce_seconds)
        if iterations is None:
            self.iteration_duration.observe(compute_seconds + result.wait_seconds
                                            + result.preduce_seconds)
        if math.isfinite(loss):
            self.loss.set(loss)
        for size in result.group_sizes:
            self.group_size.observe(size)
        for seconds in result.preduce_durations:
            self.preduce_duration.observe(seconds)
        self.preduce_bytes.inc(result.preduce_bytes)
        if result.num_failed_groups:
            self.preduce_failures.inc(result.num_failed_groups)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
            self._server = None
