"""Every query of the Grafana dashboard returns data from a real Prometheus.

A real coordinator and three real worker processes train `digits` on loopback; a real
`prometheus` binary (Debian package prometheus) finds them through the coordinator's
HTTP service discovery, with deploy/prometheus/prometheus.yml's scrape job pointed at the
test coordinator, and scrapes them every second. Then each PromQL expression of
deploy/grafana/dashboards/ripples.json, with Grafana's variables replaced, must return a
non-empty result.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "integration"), str(TESTS / "deploy")]

from grafana_dashboard import load_dashboard, queries, template_variables, to_promql  # noqa: E402
from helpers import REPO, free_port, running_coordinator, start_worker  # noqa: E402

from ripples.worker.client import CoordinatorClient  # noqa: E402

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.prometheus,
    pytest.mark.skipif(PROMETHEUS is None,
                       reason="prometheus not found: install the Debian package prometheus"),
]

SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
# Two logical nodes, so that the dashboard's $host variable has more than one value.
WORKERS = [("node-a", 0), ("node-a", 1), ("node-b", 0)]
RATE_INTERVAL = "10s"  # what Grafana makes of $__rate_interval at a 1 s scrape interval


def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def _wait_for(what: str, check: Callable[[], Any], timeout_seconds: float,
              details: Callable[[], str] = lambda: "") -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            result = check()
        except (OSError, ValueError):  # not listening yet, or a half-written answer
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_seconds:.0f} s. {details()}")
        time.sleep(0.25)


class Prometheus:
    """The HTTP API of a running Prometheus."""

    def __init__(self, address: str, log: Path) -> None:
        self.url = f"http://{address}"
        self.log = log

    def api(self, path: str, **params: str) -> Any:
        body = _get_json(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        return self.api("query", query=promql)["result"]

    def log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines()[-20:]
        return "prometheus log:\n" + "\n".join(lines)


def _config(sd_url: str) -> dict:
    """deploy/prometheus/prometheus.yml, pointed at `sd_url`, scraping every second."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    (job,) = config["scrape_configs"]
    (sd,) = job["http_sd_configs"]
    sd.update(url=sd_url, refresh_interval="1s")
    return config


@contextmanager
def running_prometheus(tmp_path: Path, sd_url: str,
                       token_file: Path | None = None) -> Iterator[Prometheus]:
    """Prometheus on deploy's config; with `token_file`, its discovery and its scrapes
    send that token (`authorization.credentials_file`, docs/security.md)."""
    assert PROMETHEUS is not None
    config = tmp_path / "prometheus.yml"
    settings = _config(sd_url)
    if token_file is not None:
        (job,) = settings["scrape_configs"]
        bearer = {"type": "Bearer", "credentials_file": str(token_file)}
        job["authorization"] = bearer
        job["http_sd_configs"][0]["authorization"] = bearer
    config.write_text(yaml.safe_dump(settings))
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "prometheus.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={address}", "--log.level=warn"],
            stdout=log_file, stderr=subprocess.STDOUT, cwd=tmp_path)
    prometheus = Prometheus(address, log)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with {proc.returncode}. {prometheus.log_tail()}")
            with urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=2) as response:
                return response.status == 200

        _wait_for("prometheus ready", ready, 30, prometheus.log_tail)
        yield prometheus
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _stop_workers(workers: list[subprocess.Popen[str]]) -> list[str]:
    """Wait for the workers to leave (the run was stopped), killing stragglers; their output."""
    deadline = time.monotonic() + 30
    outputs = []
    for proc in workers:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=10)
        outputs.append(out or "")
    return outputs


# The protocols whose runs between them export every metric of the dashboard: the shared
# ones and the group generator's (ripples-smart), and each protocol's own (hop, a2cid2).
RUNS = {"ripples-smart": {}, "hop": {"topology": "ring"}, "a2cid2": {}}


@pytest.mark.parametrize("protocol", list(RUNS))
def test_every_dashboard_query_returns_data_from_a_real_run(protocol: str,
                                                            tmp_path: Path) -> None:
    """Each panel returns data from a real run of a protocol that exports its metrics;
    together the runs cover every panel (a panel of one protocol shows no data in another's
    run, as Grafana users see it)."""
    dashboard = load_dashboard()
    panel_queries = [q for q in queries(dashboard) if _exported_by(q.expr, protocol)]
    assert panel_queries, "the dashboard has no queries"
    with running_coordinator(protocol=protocol, task="digits", num_workers=len(WORKERS),
                             workers_per_node=2, iterations=1_000_000,
                             **RUNS[protocol]) as server:
        workers = [start_worker(server.address, "--host", host, "--local-rank", str(rank),
                                "--metrics-bind", "127.0.0.1", "--quiet")
                   for host, rank in WORKERS]
        client = CoordinatorClient(server.address)
        stopped = False
        try:
            with running_prometheus(tmp_path, f"http://{server.metrics_address}/sd") as prom:
                _check_dashboard(prom, dashboard, panel_queries)
            client.stop_run("end-to-end test done")
            stopped = True
        finally:
            if not stopped:
                client.stop_run("end-to-end test failed")
            client.close()
            outputs = _stop_workers(workers)
        codes = [w.returncode for w in workers]
        assert codes == [0] * len(workers), (
            f"workers exited with {codes}:\n" + "\n---\n".join(o[-2000:] for o in outputs))


def _protocol_metrics() -> dict[str, set[str]]:
    """Protocol -> the metric names its runtime declares besides the shared ones."""
    from ripples.protocols.registry import PROTOCOLS

    return {name: {m.name for m in getattr(spec.runtime_class(), "metrics", ())}
            for name, spec in PROTOCOLS.items()}


def _exported_by(expr: str, protocol: str) -> bool:
    """Whether a run of `protocol` exports every metric the query reads."""
    own = _protocol_metrics()
    others = set().union(*own.values()) - own[protocol]
    return not any(name in others or name.removesuffix("_total") in others
                   for name in re.findall(r"\bripples_\w+", expr))


def test_the_runs_cover_every_dashboard_query() -> None:
    dashboard = load_dashboard()
    uncovered = [q for q in queries(dashboard)
                 if not any(_exported_by(q.expr, p) for p in RUNS)]
    assert not uncovered, f"no run of {list(RUNS)} exports these queries' metrics: {uncovered}"


def _check_dashboard(prom: Prometheus, dashboard: dict, panel_queries: list) -> None:
    num_targets = 1 + len(WORKERS)

    def targets_up() -> bool:
        active = prom.api("targets", state="active")["activeTargets"]
        return len(active) == num_targets and all(t["health"] == "up" for t in active)

    def targets_details() -> str:
        active = prom.api("targets", state="active")["activeTargets"]
        return (f"expected {num_targets} targets (coordinator + workers) up, got "
                + json.dumps([(t["scrapeUrl"], t["health"], t["lastError"]) for t in active]))

    _wait_for("every target discovered through /sd and up", targets_up, 60, targets_details)

    # The workers' series appear once they train; rate() needs a few samples of each.
    def trained() -> bool:
        counts = prom.query("count_over_time(ripples_worker_iterations_total[1m])")
        return len(counts) == len(WORKERS) and all(float(c["value"][1]) >= 4 for c in counts)

    _wait_for("four scrapes of every worker's iteration counter", trained, 45,
              lambda: f"got {prom.query('ripples_worker_iterations_total')}")

    for metric, label in _variable_sources(dashboard):
        values = prom.api(f"label/{label}/values", **{"match[]": metric})
        assert sorted(values) == sorted({host for host, _ in WORKERS}), (metric, label, values)

    # A histogram's rate can lag its counter by a scrape: give empty answers a few retries.
    empty = list(panel_queries)
    deadline = time.monotonic() + 10
    while empty and time.monotonic() < deadline:
        empty = [q for q in empty if not prom.query(to_promql(q.expr, dashboard,
                                                              rate_interval=RATE_INTERVAL))]
        if empty:
            time.sleep(1)
    assert not empty, "dashboard queries with no data:\n" + "\n".join(
        f"  {q}\n    as sent: {to_promql(q.expr, dashboard, rate_interval=RATE_INTERVAL)}"
        for q in empty)


def _variable_sources(dashboard: dict) -> list[tuple[str, str]]:
    """(metric, label) of each `label_values(metric, label)` template variable."""
    sources = []
    for variable in template_variables(dashboard):
        inner = variable["definition"].removeprefix("label_values(").removesuffix(")")
        metric, label = (part.strip() for part in inner.split(","))
        sources.append((metric, label))
    return sources


def test_prometheus_scrapes_a_run_that_requires_a_token(tmp_path: Path) -> None:
    """A coordinator with a token guards /sd and /metrics, and its workers guard theirs
    with the same token: Prometheus, given the token file, discovers and scrapes them all."""
    from ripples.client_security import ClientSecurity
    from ripples.coordinator.config import RunSettings
    from ripples.coordinator.server import CoordinatorServer, ServerConfig
    from ripples.server_security import ServerSecurity

    token = "5e1f0c2b7a9d4e3f8a6b1c0d2e4f6a8b"
    token_file = tmp_path / "prometheus.token"
    token_file.write_text(token + "\n")
    server = CoordinatorServer(ServerConfig(
        host="127.0.0.1", port=0, security=ServerSecurity(token=token),
        run=RunSettings.build(task="digits", num_workers=len(WORKERS), workers_per_node=2,
                              iterations=1_000_000)))
    server.start()
    workers = [start_worker(server.address, "--host", host, "--local-rank", str(rank),
                            "--metrics-bind", "127.0.0.1", "--quiet",
                            env={"RIPPLES_TOKEN_FILE": str(token_file)})
               for host, rank in WORKERS]
    client = CoordinatorClient(server.address, security=ClientSecurity(token=token))
    try:
        with running_prometheus(tmp_path, f"http://{server.metrics_address}/sd",
                                token_file) as prom:
            def all_up() -> bool:
                up = prom.query("up")
                return (len(up) == len(WORKERS) + 1
                        and all(r["value"][1] == "1" for r in up))

            _wait_for("every target up", all_up, 90, prom.log_tail)
            _wait_for("worker iterations scraped",
                      lambda: len(prom.query("ripples_worker_iterations_total")) == len(WORKERS),
                      60, prom.log_tail)
        client.stop_run("end-to-end test done")
    finally:
        client.close()
        outputs = _stop_workers(workers)
        server.stop()
    codes = [w.returncode for w in workers]
    assert codes == [0] * len(workers), "\n---\n".join(o[-2000:] for o in outputs)
