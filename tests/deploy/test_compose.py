"""deploy/compose.yaml follows the Compose Specification and agrees with the `ripples` CLI.

No Docker runs here (the dev and CI machines have no engine): the compose file is checked
against the Compose Specification's JSON schema (tests/data/compose-spec.json) and its
commands, health checks included, against the real `ripples` parser. The other tests read
the parsed file: the service flow (one-shot services, health checks, the conditions each
service waits for, mounts of what init makes), the coordinator starting with no run, the
agents' slots against the submitted run, and the tokens and CA that the clients and the
coordinator share.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from compose_files import (
    agent_services,
    client_files,
    client_services,
    health_commands,
    is_bind,
    load_compose,
    mount_source,
    mounts,
    option_values,
    ripples_services,
    service_command,
)
from deploy_tree import DEPLOY, REPO

from ripples.cli.main import build_parser, split_script

COMPOSE_SCHEMA = REPO / "tests" / "data" / "compose-spec.json"
ONE_SHOTS = {"init", "submit"}
"""Services that run once and exit (no health check; dependents wait for their success)."""
COORDINATOR_SERVE_OPTIONS = {
    "host", "port", "store-port", "metrics-port", "advertise-host", "state-dir",
    "token-file", "read-token-file", "tls-cert", "tls-key"}
"""What the compose coordinator may be given: no run option (it starts with no run)."""


def test_compose_file_follows_the_compose_specification() -> None:
    with open(COMPOSE_SCHEMA) as f:
        schema = json.load(f)
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(load_compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors)


def test_compose_runs_the_service_flow_with_health_checks() -> None:
    compose = load_compose()
    services = compose["services"]
    assert {"init", "coordinator", "submit", "dashboard", "prometheus", "grafana"} <= (
        services.keys())
    assert len(agent_services(compose)) == 2, (
        f"expected two agents, got {sorted(agent_services(compose))}")
    written = {src for src, _ in mounts(services["init"]) if not is_bind(src)}
    for name, service in services.items():
        if name in ONE_SHOTS:
            assert service["restart"] == "no", f"{name} runs once"
        else:
            assert "healthcheck" in service, f"service {name} has no health check"
        depends = service.get("depends_on", {})
        for dependency, condition in depends.items():
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            expected = ("service_completed_successfully" if dependency in ONE_SHOTS
                        else "service_healthy" if "healthcheck" in services[dependency]
                        else "service_started")
            assert condition.get("condition") == expected, (
                f"{name} should wait for {dependency} with {expected}")
        for src, _ in mounts(service):
            if is_bind(src):
                assert (DEPLOY / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in compose["volumes"], f"{name} mounts undeclared volume {src}"
                # What init makes must be there before the service starts.
                if src in written and name != "init":
                    assert depends.get("init", {}).get("condition") == (
                        "service_completed_successfully"), f"{name} reads {src} before init"
    # The agents drain on SIGTERM: give them the time to.
    for name, agent in agent_services(compose).items():
        assert agent["stop_grace_period"] == "60s" and agent["init"] is True, name


def test_compose_commands_parse_with_the_ripples_cli() -> None:
    compose = load_compose()
    parser = build_parser()
    lines = {name: service_command(s) for name, s in ripples_services(compose).items()}
    lines |= {f"{name} (health check)": c for name, c in health_commands(compose).items()}
    assert "coordinator (health check)" in lines
    for name, command in lines.items():
        options, script = split_script(command)
        try:
            parser.parse_args(options)
        except SystemExit as exit_:
            pytest.fail(f"service {name}: `ripples {' '.join(command)}` is rejected by the "
                        f"CLI (exit {exit_.code}); see the error above")
        if script:
            assert options[0] == "submit", f"{name}: only the submitted run has a script"
    commands = {" ".join(c[:2]) for c in lines.values()}
    assert {"coordinator serve", "worker run", "submit --wait", "dashboard serve",
            "coordinator health"} <= commands, commands


def test_compose_coordinator_starts_with_no_run() -> None:
    command = service_command(load_compose()["services"]["coordinator"])
    assert command[:2] == ["coordinator", "serve"]
    options = option_values(command)
    extra = set(options) - COORDINATOR_SERVE_OPTIONS
    assert not extra, f"run options make the coordinator's one-run form: {extra}"
    assert options["advertise-host"] == "coordinator"
    state = mount_source(load_compose()["services"]["coordinator"], options["state-dir"])
    assert not is_bind(state[0]) and state[1] == ".", "the state dir is a named volume"


def test_compose_agents_have_the_slots_the_submitted_run_needs() -> None:
    compose = load_compose()
    services = compose["services"]
    coordinator = option_values(service_command(services["coordinator"]))
    address = f"coordinator:{coordinator['port']}"
    submit_command = service_command(services["submit"])
    options, script = split_script(submit_command)
    run = option_values(options)
    assert options[:2] == ["submit", "--wait"]
    agents = {n: option_values(service_command(s)) for n, s in agent_services(compose).items()}
    slots = [int(a["nproc-per-node"]) for a in agents.values()]
    assert sum(slots) >= int(run["workers"]), (slots, run["workers"])
    assert set(slots) == {int(run["workers-per-node"])}, (slots, run["workers-per-node"])
    assert len({a["host"] for a in agents.values()}) == len(agents)
    for name, options in agents.items():
        # Prometheus scrapes the address the workers register; the service name resolves
        # on the compose network.
        assert options["metrics-host"] == name and int(options["metrics-port"]) > 0
        assert mount_source(services[name], options["output-dir"])[0] == "agent-output"
    for name, service in client_services(compose).items():
        assert client_files(service)["coordinator"] == address, name
    # The example run and its knobs.
    assert script[:3] == ["python", "-m", "ripples.examples.transformer_lm"]
    assert option_values(script)["steps"] == run["iterations"]
    raw = " ".join(services["submit"]["command"])
    assert "${RIPPLES_PROTOCOL:-" in raw and "${RIPPLES_ITERATIONS:-" in raw


def test_compose_clients_and_coordinator_agree_on_tokens_and_tls() -> None:
    compose = load_compose()
    services = compose["services"]
    coordinator = services["coordinator"]
    options = option_values(service_command(coordinator))
    token = mount_source(coordinator, options["token-file"])
    read_token = mount_source(coordinator, options["read-token-file"])
    cert = mount_source(coordinator, options["tls-cert"])
    key = mount_source(coordinator, options["tls-key"])
    assert token[0] != read_token[0] and cert[0] == key[0]
    probe_options = option_values(health_commands(compose)["coordinator"])
    assert mount_source(coordinator, probe_options["tls-ca"]) == (cert[0], "ca.crt")
    assert probe_options["coordinator"] == f"127.0.0.1:{options['port']}"
    assert probe_options["tls-server-name"] == "coordinator"
    ca_files = set()
    for name, service in client_services(compose).items():
        files = client_files(service)
        assert files["token"] and files["ca"], f"{name} needs a token and the CA"
        expected = read_token if name == "dashboard" else token
        assert mount_source(service, files["token"]) == expected, name
        ca_files.add(mount_source(service, files["ca"]))
        # The CA only: no client mounts the coordinator's key.
        assert key[0] not in {src for src, _ in mounts(service)}, name
    assert ca_files == {("tls-ca", "ca.crt")}
    # The dashboard holds the read-only token only.
    assert token[0] not in {src for src, _ in mounts(services["dashboard"])}
