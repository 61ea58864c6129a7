"""The Grafana dashboard queries the provisioned datasource and only metrics the code exports.

deploy/grafana/dashboards/ripples.json, read with tests/deploy/grafana_dashboard.py: every
panel, target and query variable uses the provisioned Prometheus datasource, every rate
window is $__rate_interval, the real promtool parses every query (Grafana's variables
replaced) as a recording rule, and the metric names are those of the real coordinator and
worker registries, each exported metric on some panel. tests/e2e/test_prometheus.py runs
every dashboard query against a real Prometheus scraping a real run.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import yaml
from compose_files import provisioned_datasource
from deploy_tree import PROMTOOL, needs_promtool
from grafana_dashboard import load_dashboard, panels, queries, template_variables, to_promql
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def test_every_dashboard_panel_queries_the_provisioned_datasource() -> None:
    uid = provisioned_datasource()["uid"]
    dashboard = load_dashboard()
    charts = [p for p in panels(dashboard) if p["type"] != "row"]
    assert len(charts) >= 15
    for panel in charts:
        title = panel.get("title")
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, title
        exprs = [t.get("expr") for t in panel.get("targets", [])]
        assert exprs and all(exprs), f"panel {title!r} needs targets, each with an expr"
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": uid}, title
    for variable in template_variables(dashboard):
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == uid, variable["name"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_every_rate_uses_grafana_rate_interval() -> None:
    for query in queries(load_dashboard()):
        for window in re.findall(r"\[([^\]]+)\]", query.expr):
            assert window == "$__rate_interval", f"{query}: use [$__rate_interval]"


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each expression, variables replaced, as a recording rule."""
    dashboard = load_dashboard()
    exprs = [to_promql(q.expr, dashboard) for q in queries(dashboard)]
    exprs += [f"count by ({label}) ({metric})" for metric, label in _variable_queries(dashboard)]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _variable_queries(dashboard: dict) -> list[tuple[str, str]]:
    found = []
    for variable in template_variables(dashboard):
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable.get("definition", ""))
        assert match, f"variable {variable['name']}: expected label_values(metric, label)"
        found.append((match.group(1), match.group(2)))
    return found


def exported_series() -> dict[str, str]:
    """Series name -> metric family, for every metric the coordinator and a worker register.

    Read from the real registries (a coordinator core with no workers, a worker's metrics
    attached to an empty communicator cache, with every protocol runtime's own metrics
    declared), so the names cannot drift from the code.
    """
    from ripples.coordinator.config import RunSettings
    from ripples.coordinator.core import CoordinatorCore
    from ripples.coordinator.metrics import CoordinatorMetrics
    from ripples.protocols.registry import PROTOCOLS
    from ripples.worker.metrics import WorkerMetrics

    class EmptyCache:
        num_hits = 0
        num_misses = 0

        def __len__(self) -> int:
            return 0

    worker = WorkerMetrics()
    worker.attach(worker_id=0, host="node", protocol="ripples-smart", cache=EmptyCache())
    runtimes = {spec.runtime_class() for spec in PROTOCOLS.values()}
    for runtime in runtimes:
        worker.for_protocol().declare(*getattr(runtime, "metrics", ()))
    registries = [CoordinatorMetrics(CoordinatorCore(RunSettings(), now=time.monotonic()))
                  .registry, worker.registry]
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["", "_sum", "_count"], "info": ["_info"]}
    series: dict[str, str] = {}
    for registry in registries:
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for suffix in suffixes.get(family.type, [""]):
                series[family.name + suffix] = family.name
    return series


def test_dashboard_queries_only_metrics_the_code_exports() -> None:
    exported = exported_series()
    dashboard = load_dashboard()
    used: set[str] = set()
    for query in queries(dashboard):
        names = set(re.findall(r"\bripples_\w+", query.expr))
        assert names, f"{query}: queries no ripples_ metric"
        unknown = names - exported.keys()
        assert not unknown, f"{query}: no such metric {sorted(unknown)}"
        used |= names
    used |= {metric for metric, _ in _variable_queries(dashboard)}
    missing = set(exported.values()) - {exported[name] for name in used}
    assert not missing, f"metrics exported but on no dashboard panel: {sorted(missing)}"
