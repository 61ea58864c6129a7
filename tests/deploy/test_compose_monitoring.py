"""The compose stack's Prometheus and Grafana are wired to its services.

The Prometheus config that the compose Prometheus runs (deploy/k8s's, bind-mounted) and the
tokenless template that tests/e2e/test_prometheus.py starts from pass the real promtool;
the config scrapes the coordinator's /sd and the targets with the tokens they take; and
Grafana's provisioning matches the compose mounts, the Prometheus service and its scrape
interval. Read from the parsed files: no Docker runs here.
"""

from __future__ import annotations

import re
import subprocess

from compose_files import (
    load_compose,
    mount_source,
    mount_target,
    option_values,
    prometheus_config_file,
    provisioned_datasource,
    service_command,
)
from deploy_tree import DEPLOY, PROMTOOL, load_yaml, needs_promtool

PROMETHEUS_TEMPLATE = DEPLOY / "prometheus" / "prometheus.yml"
"""The tokenless single-job config (tests/e2e/test_prometheus.py starts from it)."""
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "ripples.yaml"


@needs_promtool
def test_prometheus_configs_pass_promtool() -> None:
    assert PROMTOOL is not None
    # --syntax-only: the token files exist in the container only.
    for command in (["--syntax-only", str(prometheus_config_file())],
                    [str(PROMETHEUS_TEMPLATE)]):
        result = subprocess.run([PROMTOOL, "check", "config", *command],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_with_the_tokens_the_targets_take() -> None:
    """One config for compose and deploy/k8s: the coordinator's /sd and /metrics with the
    read-only token, the workers' /metrics with the run's token (the only one they take)."""
    compose = load_compose()
    services = compose["services"]
    prometheus, coordinator = services["prometheus"], services["coordinator"]
    assert prometheus_config_file() == DEPLOY / "k8s" / "base" / "prometheus" / "prometheus.yml"
    options = option_values(service_command(coordinator))
    names = {"coordinator", *coordinator["networks"]["default"]["aliases"]}
    token = mount_source(coordinator, options["token-file"])
    read_token = mount_source(coordinator, options["read-token-file"])
    config = load_yaml(prometheus_config_file())
    roles = {}
    for job in config["scrape_configs"]:
        (sd,) = job["http_sd_configs"]
        match = re.fullmatch(r"http://([\w.-]+):(\d+)/sd", sd["url"])
        assert match and match.group(1) in names, sd["url"]
        assert match.group(2) == options["metrics-port"], sd["url"]
        assert mount_source(prometheus, sd["authorization"]["credentials_file"]) == read_token
        (keep,) = job["relabel_configs"]
        assert keep["source_labels"] == ["role"] and keep["action"] == "keep"
        roles[keep["regex"]] = mount_source(prometheus, job["authorization"]["credentials_file"])
    assert roles == {"coordinator": read_token, "worker": token}
    # The tokenless template has the same scrape timing (Grafana's timeInterval).
    assert load_yaml(PROMETHEUS_TEMPLATE)["global"] == config["global"]


# ---------------------------------------------------------------------------- grafana


def test_grafana_provisioning_matches_the_compose_mounts() -> None:
    grafana = load_compose()["services"]["grafana"]
    assert mount_target(grafana, "./grafana/provisioning") == "/etc/grafana/provisioning"
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == mount_target(grafana, "./grafana/dashboards")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/ripples.json"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_grafana_datasource_is_the_compose_prometheus() -> None:
    datasource = provisioned_datasource()
    assert datasource["type"] == "prometheus"
    assert datasource["uid"], "the dashboard needs a fixed datasource uid"
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in load_compose()["services"]
    # $__rate_interval is derived from timeInterval: it must be the real scrape interval.
    scrape_interval = load_yaml(prometheus_config_file())["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape_interval
