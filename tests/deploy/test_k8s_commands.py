"""deploy/k8s's processes run commands the CLI takes, and listen where they are looked for.

On the objects `kubectl kustomize` renders (tests/deploy/k8s_rendering.py): every `ripples`
command line of the manifests (the readiness probe's included, `$(VAR)` expanded as the
kubelet does) parses with the real `ripples` parser; the coordinator's, the agents' and
the dashboard's ports, probes and coordinator addresses agree; and every Service reaches
a declared container port, with one number on both sides.
"""

from __future__ import annotations

import contextlib
import io

import pytest
from k8s_rendering import (
    COORDINATOR_SERVICE,
    WORKER_METRICS_PORTS,
    Rendering,
    arg_options,
    container_ports,
    expand_env,
    is_ripples_image,
    labels,
    port_number,
)

from ripples.cli.main import build_parser


def _commands(rendering: Rendering) -> dict[str, tuple[dict, list[str]]]:
    """Every `ripples` command line of the manifests, by what it is: (container, argv)."""
    coordinator = rendering.container("coordinator")
    return {
        "coordinator serve": (coordinator, coordinator["args"]),
        "coordinator health (readiness probe)": (
            coordinator, coordinator["readinessProbe"]["exec"]["command"][1:]),
        "worker run --agent": (rendering.container("agent"),
                               rendering.container("agent")["args"]),
        "dashboard serve": (rendering.container("dashboard"),
                            rendering.container("dashboard")["args"]),
    }


@pytest.mark.parametrize("command", ["coordinator serve", "coordinator health (readiness probe)",
                                     "worker run --agent", "dashboard serve"])
def test_commands_parse_with_the_ripples_cli(rendered: Rendering, command: str) -> None:
    container, args = _commands(rendered)[command]
    assert is_ripples_image(container)
    if command.startswith("coordinator health"):
        assert container["readinessProbe"]["exec"]["command"][0] == "ripples"
    argv = expand_env(args, container)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            build_parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"`ripples {' '.join(argv)}` is rejected by the CLI (exit {exit_.code}): "
                    f"{errors.getvalue().strip().splitlines()[-1:]}")


def test_processes_listen_where_services_probes_and_clients_look(rendered: Rendering) -> None:
    coordinator = rendered.container("coordinator")
    serve = arg_options(coordinator["args"])
    ports = container_ports(coordinator)
    assert ports == {"grpc": int(serve["port"]), "store": int(serve["store-port"]),
                     "metrics": int(serve["metrics-port"])}
    # Workers dial the store at --advertise-host:--store-port: the Service, same port.
    assert serve["advertise-host"] == COORDINATOR_SERVICE
    address = f"{COORDINATOR_SERVICE}:{serve['port']}"
    for component in ("agent", "dashboard"):
        assert arg_options(rendered.container(component)["args"])["coordinator"] == address
    health = arg_options(coordinator["readinessProbe"]["exec"]["command"])
    assert health["coordinator"] == f"127.0.0.1:{serve['port']}"
    assert health["tls-server-name"] == COORDINATOR_SERVICE
    for probe in ("livenessProbe", "startupProbe"):
        get = coordinator[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert port_number(coordinator, get["port"]) == int(serve["metrics-port"])
    dashboard = rendered.container("dashboard")
    for probe in ("readinessProbe", "livenessProbe"):
        get = dashboard[probe]["httpGet"]
        assert (get["path"], port_number(dashboard, get["port"])) == (
            "/healthz", int(arg_options(dashboard["args"])["port"]))
    agent = rendered.container("agent")
    first_metrics_port = int(arg_options(agent["args"])["metrics-port"])
    assert first_metrics_port == WORKER_METRICS_PORTS[0] == container_ports(agent)["metrics"]


def test_services_reach_declared_container_ports(rendered: Rendering) -> None:
    for service in rendered.of_kind("Service"):
        name = service["metadata"]["name"]
        selector = service["spec"]["selector"]
        pods = [w["spec"]["template"] for w in rendered.workloads()
                if selector.items() <= labels(w["spec"]["template"]).items()]
        assert len(pods) == 1, f"Service {name} selects {len(pods)} workloads"
        (container,) = pods[0]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert isinstance(target, int) or target in container_ports(container), (
                f"Service {name}: no container port named {target}")
            # One number on both sides: clients are told container ports (the store's
            # --store-port) and dial them at the Service; NetworkPolicies match them.
            assert port_number(container, target) == port["port"], (name, port)
