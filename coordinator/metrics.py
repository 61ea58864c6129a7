"""The coordinator's Prometheus metrics.

Counters and gauges are read from the core at scrape time by a collector (`CoreCollector`),
so the group logic carries no instrumentation and a scrape always sees one consistent
state: scrapes are served on the coordinator's event loop, the only place the core is
touched. The one distribution that needs per-event observations, group-request latency,
is a histogram fed by the gRPC shell, and errors of the background tasks (lease reaper,
state saver) are a counter the shell increments, since they happen outside the core.

Labels are low-cardinality only: worker id and host (bounded by the cluster), worker
state, protocol. Never a group id or an iteration.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ripples.coordinator.core import CoordinatorCore, WorkerState

# `_created` series double every counter and histogram and are of no use to the dashboards.
disable_created_metrics()

# Group requests answer in about a millisecond when the group can form at once, and wait
# up to the server-side poll limit (30 s) for partners otherwise.
REQUEST_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                            0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class CoreCollector(Collector):
    """Reads a CoordinatorCore at scrape time; call only on the coordinator's event loop."""

    def __init__(self, core: CoordinatorCore, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.core = core
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        core = self.core
        settings = core.settings
        info = GaugeMetricFamily("ripples_coordinator_run_info",
                                 "The run this coordinator serves (value 1).",
                                 labels=["protocol", "task"])
        info.add_metric([settings.protocol, settings.task], 1.0)
        yield info

        by_state = {state: 0 for state in WorkerState}
        for w in core.workers.values():
            by_state[w.state] += 1
        workers = GaugeMetricFamily("ripples_coordinator_workers",
                                    "Workers known to the coordinator, by state.",
                                    labels=["state"])
        for state, count in by_state.items():
            workers.add_metric([state.value], float(count))
        yield workers
        yield GaugeMetricFamily("ripples_coordinator_expected_workers",
                                "Workers the run waits for before training starts.",
                                value=float(settings.num_workers))

        per_worker = CounterMetricFamily(
            "ripples_coordinator_worker_group_requests",
            "Group requests per worker: the Smart GG's slowdown counter c_w.",
            labels=["worker", "host"])
        iterations = GaugeMetricFamily(
            "ripples_coordinator_worker_iteration",
            "Iterations a worker reported completing (as last seen by the coordinator).",
            labels=["worker", "host"])
        for w in core.workers.values():
            labels = [str(w.worker_id), w.host]
            per_worker.add_metric(labels, float(w.request_count))
            iterations.add_metric(labels, float(w.progress.iteration))
        yield per_worker
        yield iterations
        yield CounterMetricFamily(
            "ripples_coordinator_group_requests", "Group requests from all workers.",
            value=float(sum(w.request_count for w in core.workers.values())))

        table = core.table
        yield CounterMetricFamily("ripples_coordinator_groups_formed",
                                  "P-Reduce groups the Group Generator made.",
                                  value=float(table.num_formed))
        yield CounterMetricFamily(
            "ripples_coordinator_group_conflicts",
            "Groups that overlapped an unfinished group when made (serialised by the lock "
            "vector).", value=float(table.num_conflicts))
        yield GaugeMetricFamily("ripples_coordinator_pending_groups",
                                "Groups in the pending queue (waiting for an earlier overlapping "
                                "group).", value=float(table.num_pending))
        yield GaugeMetricFamily("ripples_coordinator_executing_groups",
                                "Groups holding their members' locks.",
                                value=float(table.num_executing))
        yield CounterMetricFamily("ripples_coordinator_pending_waits",
                                  "Requests whose group could not execute at once.",
                                  value=float(core.groups.num_pending_waits))
        yield CounterMetricFamily("ripples_coordinator_pending_wait_seconds",
                                  "Time requests spent waiting for their group to execute.",
                                  value=core.groups.pending_wait_seconds)
        yield CounterMetricFamily("ripples_coordinator_groups_cancelled",
                                  "Groups cancelled because a member's lease expired.",
                                  value=float(core.groups.num_cancelled))
        yield CounterMetricFamily("ripples_coordinator_groups_failed",
                                  "Groups a member reported failed.",
                                  value=float(core.groups.num_failed))
        yield CounterMetricFamily("ripples_coordinator_lease_expirations",
                                  "Workers removed because their lease expired.",
                                  value=float(core.num_lease_expirations))
        yield CounterMetricFamily("ripples_coordinator_restart_rounds",
                                  "Restart rounds of a lock-step run (a membership change "
                                  "restarted every worker from the last checkpoint).",
                                  value=float(core.restarts))
        mean = core.mean_loss()
        yield GaugeMetricFamily("ripples_coordinator_mean_training_loss",
                                "Mean of the live workers' smoothed training losses.",
                                value=mean if mean is not None and math.isfinite(mean)
                                else math.nan)
        yield GaugeMetricFamily("ripples_coordinator_run_elapsed_seconds",
                                "Seconds since training started (0 before).",
                                value=core.elapsed(self.clock()))
        yield GaugeMetricFamily("ripples_coordinator_run_stopped",
                                "1 once the run has stopped.", value=float(core.stopped))
        yield GaugeMetricFamily("ripples_coordinator_topology_spectral_gap",
                                "1 - lambda_2 of the expected pairwise-gossip matrix of the "
                                "run's topology (0 before the run starts).",
                                value=core.graph.spectral_gap)
        distance = core.consensus_distance()
        yield GaugeMetricFamily("ripples_coordinator_consensus_distance",
                                "Gossip protocols: estimated mean squared distance of the "
                                "workers' parameters to their average, from recent pairwise "
                                "exchanges (NaN before any).",
                                value=distance if distance is not None else math.nan)


class CoordinatorMetrics:
    """The coordinator's registry: the core collector, the request-latency histogram and
    the background tasks' error counter."""

    def __init__(self, core: CoordinatorCore, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(CoreCollector(core, clock))
        self.group_request_duration = Histogram(
            "ripples_coordinator_group_request_duration_seconds",
            "From a group request's arrival to its reply, including the wait for partners.",
            buckets=REQUEST_DURATION_BUCKETS, registry=self.registry)
        self.background_errors = Counter(
            "ripples_coordinator_background_errors",
            "Exceptions raised by an iteration of a background task (lease reaper, state "
            "saver); the task logs each with its traceback and runs again after a back-off.",
            labelnames=["task"], registry=self.registry)
