"""deploy/k8s's Prometheus scrapes with the right tokens, and Grafana mounts deploy/grafana.

The Prometheus config passes the real promtool (--syntax-only: the token files exist in
the pod only); on the objects `kubectl kustomize` renders (tests/deploy/k8s_rendering.py),
Prometheus reads its config and tokens from the ConfigMap and Secrets the scrape jobs name,
and Grafana mounts the dashboard and provisioning files that its environment and
provisioning name, as the compose stack does.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import PurePosixPath

import yaml
from deploy_tree import DEPLOY, PROMTOOL, needs_promtool
from k8s_rendering import COORDINATOR_SERVICE, K8S, Rendering, arg_options, file_source

PROMETHEUS_CONFIG = K8S / "base" / "prometheus" / "prometheus.yml"


@needs_promtool
def test_prometheus_config_passes_promtool() -> None:
    assert PROMTOOL is not None
    # --syntax-only: the token files exist in the pod only.
    result = subprocess.run([PROMTOOL, "check", "config", "--syntax-only",
                             str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_coordinator_and_workers_with_their_tokens(
        rendered: Rendering) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    compose_config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    # Grafana's datasource timeInterval is this scrape interval (the datasource is the
    # compose stack's, below).
    assert config["global"] == compose_config["global"]
    pod, container = rendered.pod("prometheus"), rendered.container("prometheus")
    config_file = arg_options(container["args"])["config.file"]
    kind, name, key = file_source(pod, container, config_file)
    assert (kind, re.sub(r"-[a-z0-9]{10}$", "", name), key) == (
        "configMap", "prometheus-config", "prometheus.yml")
    metrics_port = arg_options(rendered.container("coordinator")["args"])["metrics-port"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # /sd and the coordinator's /metrics take the read-only token; a worker's /metrics
    # takes only the run's token (worker/session.py).
    expected = {"ripples": ("coordinator", "ripples-read-token"),
                "ripples-workers": ("worker", "ripples-token")}
    assert jobs.keys() == expected.keys()
    for job_name, (role, scrape_secret) in expected.items():
        job = jobs[job_name]
        (sd,) = job["http_sd_configs"]
        assert sd["url"] == f"http://{COORDINATOR_SERVICE}:{metrics_port}/sd"
        for auth, secret in ((sd["authorization"], "ripples-read-token"),
                             (job["authorization"], scrape_secret)):
            assert auth["type"] == "Bearer"
            assert file_source(pod, container, auth["credentials_file"]) == (
                "secret", secret, "token"), job_name
        assert job["relabel_configs"] == [
            {"source_labels": ["role"], "regex": role, "action": "keep"}]


# ---------------------------------------------------------------------------- grafana


def test_grafana_mounts_what_its_provisioning_names(rendered: Rendering) -> None:
    pod, container = rendered.pod("grafana"), rendered.container("grafana")
    env = {e["name"]: e["value"] for e in container["env"]}
    compose_env = yaml.safe_load((DEPLOY / "compose.yaml").read_text())[
        "services"]["grafana"]["environment"]
    for key in ("GF_AUTH_ANONYMOUS_ENABLED", "GF_AUTH_ANONYMOUS_ORG_ROLE",
                "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"):
        assert env[key] == compose_env[key], key
    (provider,) = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards"
                                  / "ripples.yaml").read_text())["providers"]

    def config_map(path: str) -> tuple[str, str]:
        kind, name, key = file_source(pod, container, path)
        assert kind == "configMap", path
        return re.sub(r"-[a-z0-9]{10}$", "", name), key

    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home).parent == PurePosixPath(provider["options"]["path"])
    assert config_map(home) == ("grafana-dashboards", "ripples.json")
    provisioning = "/etc/grafana/provisioning"
    assert config_map(f"{provisioning}/datasources/ripples.yaml") == (
        "grafana-datasources", "ripples.yaml")
    assert config_map(f"{provisioning}/dashboards/ripples.yaml") == (
        "grafana-dashboard-providers", "ripples.yaml")
    (datasource,) = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources"
                                    / "ripples.yaml").read_text())["datasources"]
    service = rendered.get("Service", "prometheus")
    assert datasource["url"] == f"http://prometheus:{service['spec']['ports'][0]['port']}"
