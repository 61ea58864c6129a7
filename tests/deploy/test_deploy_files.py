"""The deployment files are valid and agree with each other and with the code.

No Docker runs here (the dev and CI machines have no engine): the compose file is checked
against the Compose Specification's JSON schema and its commands against the real
`ripples` parser, the Prometheus config and the dashboard's PromQL by the real promtool,
and the Grafana provisioning against the compose mounts and the metrics that the
coordinator and worker code registers. tests/e2e/test_prometheus.py runs every dashboard
query against a real Prometheus scraping a real run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import tomllib
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml
from grafana_dashboard import load_dashboard, panels, queries, template_variables, to_promql
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ripples.cli import build_parser, split_script

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "ripples.yaml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "ripples.yaml"
COMPOSE_SCHEMA = REPO / "tests" / "data" / "compose-spec.json"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found: install the Debian package prometheus")

_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def _compose() -> dict:
    return _yaml(COMPOSE)


def _interpolate(text: str) -> str:
    """Compose's `${NAME:-default}` with the defaults (the environment left out)."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", text)


def _ripples_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items()
            if s.get("image", "").startswith("ripples")}


def _options(command: list[str]) -> dict[str, str]:
    """`--name=value` options of a command (the form compose.yaml uses throughout)."""
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def _mount_target(service: dict, source: str) -> str:
    """Where a service mounts the bind source `source` (relative to deploy/)."""
    for volume in service.get("volumes", []):
        src, target, *_ = volume.split(":")
        if PurePosixPath(src) == PurePosixPath(source):
            return target
    raise AssertionError(f"{source} is not mounted: {service.get('volumes')}")


def _provisioned_datasource() -> dict:
    (datasource,) = _yaml(DATASOURCES)["datasources"]
    return datasource


# ---------------------------------------------------------------------------- compose


def test_compose_file_follows_the_compose_specification() -> None:
    with open(COMPOSE_SCHEMA) as f:
        schema = json.load(f)
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(_compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors)


def test_compose_runs_the_whole_stack_with_health_checks() -> None:
    services = _compose()["services"]
    assert {"coordinator", "dashboard", "prometheus", "grafana"} <= services.keys()
    nodes = {n for n, s in services.items() if s.get("command", [None])[0] == "worker"}
    assert len(nodes) == 2, f"expected two node services, got {sorted(nodes)}"
    for name, service in services.items():
        assert "healthcheck" in service, f"service {name} has no health check"
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            assert condition.get("condition") in ("service_healthy", "service_started"), (
                f"{name} waits for {dependency} without a condition")
            if "healthcheck" in services[dependency]:
                assert condition["condition"] == "service_healthy", (
                    f"{name} should wait for {dependency} to be healthy, not just started")
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"


def test_compose_commands_parse_with_the_ripples_cli() -> None:
    parser = build_parser()
    for name, service in _ripples_services(_compose()).items():
        command = [_interpolate(str(arg)) for arg in service["command"]]
        options, script = split_script(command)
        try:
            parser.parse_args(options)
        except SystemExit as exit_:
            pytest.fail(f"service {name}: `ripples {' '.join(command)}` is rejected by the "
                        f"CLI (exit {exit_.code}); see the error above")
        if script:
            assert options[:2] == ["worker", "run"], f"{name}: only workers run a script"


def test_compose_nodes_match_the_coordinator_layout() -> None:
    compose = _compose()
    ripples = _ripples_services(compose)
    coordinator = _options([_interpolate(a) for a in ripples["coordinator"]["command"]])
    nodes = {n: _options(split_script(s["command"])[0]) for n, s in ripples.items()
             if s["command"][:2] == ["worker", "run"]}
    per_node = [int(options["nproc-per-node"]) for options in nodes.values()]
    assert sum(per_node) == int(coordinator["workers"])
    assert set(per_node) == {int(coordinator["workers-per-node"])}, per_node
    assert len({options["host"] for options in nodes.values()}) == len(nodes)
    for name, options in nodes.items():
        # Prometheus scrapes the address the workers register; the service name resolves
        # on the compose network, and each worker picks a free port.
        assert options["metrics-host"] == name and options["metrics-port"] == "0"
        env = ripples[name].get("environment", {})
        assert env.get("RIPPLES_COORDINATOR") == f"coordinator:{coordinator['port']}"
        script = split_script(ripples[name]["command"])[1]
        assert script[:3] == ["python", "-m", "ripples.examples.transformer_lm"]
    dashboard = _options(ripples["dashboard"]["command"])
    assert dashboard["coordinator"] == f"coordinator:{coordinator['port']}"
    assert coordinator["advertise-host"] == "coordinator"


# ---------------------------------------------------------------------------- prometheus


@needs_promtool
def test_prometheus_config_passes_promtool() -> None:
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "config", str(PROMETHEUS_CONFIG)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_discovers_targets_through_the_coordinator() -> None:
    config = _yaml(PROMETHEUS_CONFIG)
    coordinator = _options(_compose()["services"]["coordinator"]["command"])
    (job,) = config["scrape_configs"]
    (sd,) = job["http_sd_configs"]
    assert sd["url"] == f"http://coordinator:{coordinator['metrics-port']}/sd"
    prometheus = _compose()["services"]["prometheus"]
    assert _mount_target(prometheus, "./prometheus/prometheus.yml") in " ".join(
        prometheus["command"])


# ---------------------------------------------------------------------------- grafana


def test_grafana_provisioning_matches_the_compose_mounts() -> None:
    grafana = _compose()["services"]["grafana"]
    assert _mount_target(grafana, "./grafana/provisioning") == "/etc/grafana/provisioning"
    (provider,) = _yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == _mount_target(grafana, "./grafana/dashboards")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/ripples.json"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_grafana_datasource_is_the_compose_prometheus() -> None:
    datasource = _provisioned_datasource()
    assert datasource["type"] == "prometheus"
    assert datasource["uid"], "the dashboard needs a fixed datasource uid"
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in _compose()["services"]
    # $__rate_interval is derived from timeInterval: it must be the real scrape interval.
    scrape_interval = _yaml(PROMETHEUS_CONFIG)["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape_interval


def test_every_dashboard_panel_queries_the_provisioned_datasource() -> None:
    uid = _provisioned_datasource()["uid"]
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
    from ripples.protocols import PROTOCOLS
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


# ---------------------------------------------------------------------------- image


def _torch_pin() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    (pin,) = [d.split(";")[0].strip() for d in dependencies if re.match(r"torch\b", d)]
    return pin


def test_dockerfile_installs_the_pinned_torch_then_the_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = [line.strip() for line in text.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    assert instructions[0] == "FROM python:3.11-slim"
    pin = _torch_pin()
    assert pin == "torch==2.13.0"
    torch_runs = [i for i in instructions if i.startswith("RUN") and "torch" in i]
    assert len(torch_runs) == 1 and re.search(rf"\s{re.escape(pin)}(\s|$)", torch_runs[0]), (
        f"the Dockerfile must install {pin}: {torch_runs}")
    assert "--index-url \"${TORCH_INDEX_URL}\"" in torch_runs[0]
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in instructions
    assert any(i.startswith("USER ") and i.split()[1] not in ("root", "0")
               for i in instructions), "the image must run as a non-root user"
    assert instructions[-2:] == ['ENTRYPOINT ["ripples"]', 'CMD ["--help"]']


def test_image_copies_every_package_directory() -> None:
    """Each source directory of pyproject's package-dir is copied and not docker-ignored."""
    with open(REPO / "pyproject.toml", "rb") as f:
        package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"].values()
    roots = {PurePosixPath(d).parts[0] for d in package_dirs}
    text = (DEPLOY / "Dockerfile").read_text()
    assert "COPY pyproject.toml README.md ./" in text
    copied = set(re.findall(r"^COPY (\S+) \S+$", text, flags=re.MULTILINE))
    assert roots <= copied, f"not copied into the image: {sorted(roots - copied)}"
    kept = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    assert roots | {"pyproject.toml", "README.md"} <= kept
