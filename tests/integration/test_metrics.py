"""Metrics and service discovery of a real run: coordinator + worker processes on loopback.

Checks the exported names against Prometheus conventions (prefix, base units, `_total`
on counters, explicit histogram buckets, low-cardinality labels) and that the
coordinator's discovery endpoint lists exactly the live workers' endpoints.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest
from helpers import running_coordinator, start_worker
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from ripples.worker.client import CoordinatorClient
from ripples.worker.metrics import GROUP_SIZE_BUCKETS, ITERATION_BUCKETS, PREDUCE_BUCKETS

pytestmark = pytest.mark.slow

# Every worker's metrics; a protocol adds its own (hop's, gossip's; ripples-smart's --overlap
# counters, 0 without it).
WORKER_METRICS = {
    "ripples_worker_iterations": "counter",
    "ripples_worker_time_seconds": "counter",
    "ripples_worker_iteration_duration_seconds": "histogram",
    "ripples_worker_training_loss": "gauge",
    "ripples_worker_group_size": "histogram",
    "ripples_worker_preduce_duration_seconds": "histogram",
    "ripples_worker_preduce_bytes": "counter",
    "ripples_worker_preduce_failures": "counter",
    "ripples_worker_communicator_cache_hits": "counter",
    "ripples_worker_communicator_cache_misses": "counter",
    "ripples_worker_cached_communicators": "gauge",
    "ripples_worker_overlap_landed_groups": "counter",
    "ripples_worker_overlap_waited_groups": "counter",
    "ripples_worker_overlap_lag_steps": "counter",
}
COORDINATOR_METRICS = {
    "ripples_coordinator_run_info": "gauge",
    "ripples_coordinator_workers": "gauge",
    "ripples_coordinator_expected_workers": "gauge",
    "ripples_coordinator_worker_group_requests": "counter",
    "ripples_coordinator_worker_iteration": "gauge",
    "ripples_coordinator_group_requests": "counter",
    "ripples_coordinator_groups_formed": "counter",
    "ripples_coordinator_group_conflicts": "counter",
    "ripples_coordinator_pending_groups": "gauge",
    "ripples_coordinator_executing_groups": "gauge",
    "ripples_coordinator_pending_waits": "counter",
    "ripples_coordinator_pending_wait_seconds": "counter",
    "ripples_coordinator_groups_cancelled": "counter",
    "ripples_coordinator_groups_failed": "counter",
    "ripples_coordinator_lease_expirations": "counter",
    "ripples_coordinator_restart_rounds": "counter",
    "ripples_coordinator_mean_training_loss": "gauge",
    "ripples_coordinator_run_elapsed_seconds": "gauge",
    "ripples_coordinator_run_stopped": "gauge",
    "ripples_coordinator_topology_spectral_gap": "gauge",
    "ripples_coordinator_consensus_distance": "gauge",
    "ripples_coordinator_group_request_duration_seconds": "histogram",
    "ripples_coordinator_background_errors": "counter",
}
ALLOWED_LABELS = {"worker", "host", "protocol", "phase", "state", "task", "le"}
NUM_WORKERS = 3


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read().decode()


def _families(address: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(_get(f"http://{address}/metrics"))}


def _value(families: dict[str, object], sample_name: str, **labels: str) -> float:
    family = max((n for n in families if sample_name.startswith(n)), key=len)
    for s in families[family].samples:  # type: ignore[attr-defined]
        s: Sample
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no sample {sample_name}{labels}")


@pytest.fixture(scope="module")
def live_run() -> Iterator[tuple[str, str]]:
    """A ripples-smart run on digits with 3 worker processes, kept going until the end."""
    with running_coordinator(protocol="ripples-smart", task="digits", num_workers=NUM_WORKERS,
                             group_size=2, iterations=1_000_000) as server:
        procs = [start_worker(server.address, "--host", f"node{i % 2}", "--local-rank",
                              str(i // 2), "--metrics-bind", "127.0.0.1")
                 for i in range(NUM_WORKERS)]
        client = CoordinatorClient(server.address)
        try:
            deadline = time.monotonic() + 90
            while True:
                status = client.run_status()
                if status.started and all(w.iteration >= 50 for w in status.workers):
                    break
                if any(p.poll() is not None for p in procs):
                    raise AssertionError("a worker exited:\n" + "".join(
                        p.stdout.read() for p in procs if p.poll() is not None and p.stdout))
                assert time.monotonic() < deadline, f"run did not get going: {status}"
                time.sleep(0.2)
            yield server.address, server.metrics_address
        finally:
            client.stop_run("test over")
            for p in procs:
                try:
                    p.wait(timeout=30)
                except Exception:
                    p.kill()
                    p.wait()
            client.close()


def test_discovery_lists_the_coordinator_and_every_live_worker(live_run: tuple[str, str]
                                                               ) -> None:
    address, metrics_address = live_run
    groups = json.loads(_get(f"http://{metrics_address}/sd"))
    roles = [g["labels"]["role"] for g in groups]
    assert roles.count("coordinator") == 1 and roles.count("worker") == NUM_WORKERS
    status = CoordinatorClient(address).run_status()
    expected = {w.metrics_address for w in status.workers}
    listed = {t for g in groups if g["labels"]["role"] == "worker" for t in g["targets"]}
    assert listed == expected and all(t.startswith("127.0.0.1:") for t in listed)
    for g in groups:  # every target answers with Prometheus text
        assert "# TYPE ripples_" in _get(f"http://{g['targets'][0]}/metrics")


def test_worker_metrics_follow_conventions_and_count_the_work(live_run: tuple[str, str]
                                                              ) -> None:
    address, metrics_address = live_run
    status = CoordinatorClient(address).run_status()
    for w in status.workers:
        fams = _families(w.metrics_address)
        names = {n: f.type for n, f in fams.items() if n.startswith("ripples_")}  # type: ignore[attr-defined]
        assert names == WORKER_METRICS
        labels = {"worker": str(w.worker_id), "host": w.host, "protocol": "ripples-smart"}
        iterations = _value(fams, "ripples_worker_iterations_total", **labels)
        assert iterations >= 50
        compute = _value(fams, "ripples_worker_time_seconds_total", phase="compute", **labels)
        assert compute > 0
        for phase in ("group_wait", "preduce"):
            assert _value(fams, "ripples_worker_time_seconds_total", phase=phase, **labels) >= 0
        # The worker keeps training while it is scraped, so series read one after another
        # may be an iteration apart: compare with a tolerance of a few groups.
        num_preduces = _value(fams, "ripples_worker_preduce_duration_seconds_count", **labels)
        assert num_preduces >= 1
        num_sized = _value(fams, "ripples_worker_group_size_count", **labels)
        assert abs(num_sized - num_preduces) <= 3
        assert _value(fams, "ripples_worker_group_size_sum", **labels) == 2 * num_sized
        hits = _value(fams, "ripples_worker_communicator_cache_hits_total", **labels)
        misses = _value(fams, "ripples_worker_communicator_cache_misses_total", **labels)
        assert abs(hits + misses - num_preduces) <= 3 and misses >= 1
        assert _value(fams, "ripples_worker_preduce_bytes_total", **labels) > 0
        assert 0 < _value(fams, "ripples_worker_training_loss", **labels) < 5
        _check_conventions(fams, {
            "ripples_worker_iteration_duration_seconds": ITERATION_BUCKETS,
            "ripples_worker_preduce_duration_seconds": PREDUCE_BUCKETS,
            "ripples_worker_group_size": GROUP_SIZE_BUCKETS})


def test_coordinator_metrics_match_its_run_status(live_run: tuple[str, str]) -> None:
    address, metrics_address = live_run
    fams = _families(metrics_address)
    status = CoordinatorClient(address).run_status()
    names = {n: f.type for n, f in fams.items() if n.startswith("ripples_")}  # type: ignore[attr-defined]
    assert names == COORDINATOR_METRICS
    # Counters only grow: the scrape came before the status, so it is at most the status.
    formed = _value(fams, "ripples_coordinator_groups_formed_total")
    assert 0 < formed <= status.num_groups_formed
    per_worker = {s.labels["worker"]: s.value for s in
                  fams["ripples_coordinator_worker_group_requests"].samples}  # type: ignore[attr-defined]
    assert set(per_worker) == {str(w.worker_id) for w in status.workers}
    for w in status.workers:
        assert 0 < per_worker[str(w.worker_id)] <= w.request_count
    assert _value(fams, "ripples_coordinator_group_requests_total") == sum(per_worker.values())
    live = sum(_value(fams, "ripples_coordinator_workers", state=s)
               for s in ("computing", "waiting", "reducing"))
    assert live == NUM_WORKERS
    assert _value(fams, "ripples_coordinator_run_info", protocol="ripples-smart",
                  task="digits") == 1
    assert _value(fams, "ripples_coordinator_group_request_duration_seconds_count") > 0
    # Exported from the start, at 0, so that dashboards show a zero rather than no data.
    assert _value(fams, "ripples_coordinator_background_errors_total", task="lease-reaper") == 0
    _check_conventions(fams, {})


def _check_conventions(fams: dict[str, object], buckets: dict[str, tuple[float, ...]]) -> None:
    for name, family in fams.items():
        f = family
        assert name.startswith("ripples_"), name
        assert not name.endswith(("_ms", "_milliseconds", "_kb", "_mb")), f"{name}: base units"
        assert f.documentation, f"{name} has no help text"  # type: ignore[attr-defined]
        for s in f.samples:  # type: ignore[attr-defined]
            assert set(s.labels) <= ALLOWED_LABELS, f"{s.name}: label {set(s.labels)}"
            if f.type == "counter":  # type: ignore[attr-defined]
                assert s.name.endswith("_total"), s.name
        if f.type == "histogram":  # type: ignore[attr-defined]
            les = sorted({float(s.labels["le"]) for s in f.samples  # type: ignore[attr-defined]
                          if s.name.endswith("_bucket")})
            assert les[-1] == float("inf")
            if name in buckets:
                assert les[:-1] == [float(b) for b in buckets[name]], name
