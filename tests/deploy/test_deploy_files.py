"""The deployment files are valid and agree with each other and with the code.

No Docker runs here (the dev and CI machines have no engine): the compose file is checked
against the Compose Specification's JSON schema and its commands (health checks included)
against the real `ripples` parser; its secrets are made by the real init script
(deploy/compose/init-secrets.sh) into stand-ins for its volumes, and a real coordinator
started with the compose command (paths mapped onto those volumes) answers the compose
health check and every client's token and CA over TLS. The Prometheus config is checked
by the real promtool, the dashboard's PromQL too, and the Grafana provisioning against
the compose mounts and the metrics that the coordinator and worker code registers.
deploy/slurm/ripples.sbatch runs under bash with stand-ins for srun, squeue, scancel and
scontrol: once with a stand-in `ripples` that checks every command line with the real
parser and records the order of events, once with the real one (a run of two workers).
tests/e2e/test_prometheus.py runs every dashboard query against a real Prometheus
scraping a real run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml
from cryptography import x509
from grafana_dashboard import load_dashboard, panels, queries, template_variables, to_promql
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ripples.cli.main import build_parser, split_script
from tests.integration.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
INIT_SCRIPT = DEPLOY / "compose" / "init-secrets.sh"
SBATCH = DEPLOY / "slurm" / "ripples.sbatch"
PROMETHEUS_TEMPLATE = DEPLOY / "prometheus" / "prometheus.yml"
"""The tokenless single-job config (tests/e2e/test_prometheus.py starts from it)."""
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "ripples.yaml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "ripples.yaml"
COMPOSE_SCHEMA = REPO / "tests" / "data" / "compose-spec.json"
RIPPLES_UID = 10001  # the image's user (deploy/Dockerfile)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found: install the Debian package prometheus")
needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl not found: install the Debian package "
    "openssl (the init script makes the certificates with it)")

_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
ONE_SHOTS = {"init", "submit"}
"""Services that run once and exit (no health check; dependents wait for their success)."""
COORDINATOR_SERVE_OPTIONS = {
    "host", "port", "store-port", "metrics-port", "advertise-host", "state-dir",
    "token-file", "read-token-file", "tls-cert", "tls-key"}
"""What the compose coordinator may be given: no run option (it starts with no run)."""


def _yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def _compose() -> dict:
    return _yaml(COMPOSE)


def _interpolate(text: str) -> str:
    """Compose's `${NAME:-default}` with the defaults (the environment left out)."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", text)


def _ripples_services(compose: dict) -> dict[str, dict]:
    """Services that run the `ripples` command (the image's entry point, not replaced)."""
    return {name: s for name, s in compose["services"].items()
            if s.get("image", "").startswith("ripples") and "entrypoint" not in s}


def _command(service: dict) -> list[str]:
    return [_interpolate(str(arg)) for arg in service["command"]]


def _options(command: list[str]) -> dict[str, str]:
    """`--name=value` options of a command (the form compose.yaml uses throughout)."""
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def _agents(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in _ripples_services(compose).items()
            if s["command"][:3] == ["worker", "run", "--agent"]}


def _health_commands(compose: dict) -> dict[str, list[str]]:
    """Each service's health check that runs `ripples`: its arguments."""
    found = {}
    for name, service in compose["services"].items():
        test = service.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "ripples"]:
            found[name] = [_interpolate(a) for a in test[2:]]
    return found


def _mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each of a service's volumes (short syntax)."""
    return [tuple(v.split(":")[:2]) for v in service.get("volumes", [])]  # type: ignore[misc]


def _is_bind(source: str) -> bool:
    return source.startswith((".", "/"))


def _mount_target(service: dict, source: str) -> str:
    """Where a service mounts the bind source `source` (relative to deploy/)."""
    for src, target in _mounts(service):
        if _is_bind(src) and PurePosixPath(src) == PurePosixPath(source):
            return target
    raise AssertionError(f"{source} is not mounted: {service.get('volumes')}")


def _source(service: dict, path: str) -> tuple[str, str]:
    """(the volume or bind source, the path inside it) of a file a service names."""
    best: tuple[str, str] | None = None
    for src, target in _mounts(service):
        if PurePosixPath(path).is_relative_to(target) and (
                best is None or len(target) > len(best[1])):
            best = (src, target)
    assert best is not None, f"{path} is on no volume of the service: {service.get('volumes')}"
    return best[0], str(PurePosixPath(path).relative_to(best[1]))


def _local(service: dict, path: str, volumes: Path) -> Path:
    """The file a service's `path` is in this test: a named volume's stand-in under
    `volumes`, or the bind-mounted file of deploy/."""
    src, inside = _source(service, path)
    return (DEPLOY / src if _is_bind(src) else volumes / src) / inside


def _client_files(service: dict) -> dict[str, str]:
    """A client's token file and CA: its flags, else its environment (as `ripples` reads
    them)."""
    options = _options(_command(service))
    env = service.get("environment", {})
    return {"token": options.get("token-file", env.get("RIPPLES_TOKEN_FILE", "")),
            "ca": options.get("tls-ca", env.get("RIPPLES_TLS_CA", "")),
            "coordinator": options.get("coordinator", env.get("RIPPLES_COORDINATOR", ""))}


def _clients(compose: dict) -> dict[str, dict]:
    """Every service that calls the coordinator's gRPC service."""
    return {n: s for n, s in _ripples_services(compose).items() if n != "coordinator"}


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


def test_compose_runs_the_service_flow_with_health_checks() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"init", "coordinator", "submit", "dashboard", "prometheus", "grafana"} <= (
        services.keys())
    assert len(_agents(compose)) == 2, f"expected two agents, got {sorted(_agents(compose))}"
    written = {src for src, _ in _mounts(services["init"]) if not _is_bind(src)}
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
        for src, _ in _mounts(service):
            if _is_bind(src):
                assert (DEPLOY / src).exists(), f"{name} mounts missing {src}"
            else:
                assert src in compose["volumes"], f"{name} mounts undeclared volume {src}"
                # What init makes must be there before the service starts.
                if src in written and name != "init":
                    assert depends.get("init", {}).get("condition") == (
                        "service_completed_successfully"), f"{name} reads {src} before init"
    # The agents drain on SIGTERM: give them the time to.
    for name, agent in _agents(compose).items():
        assert agent["stop_grace_period"] == "60s" and agent["init"] is True, name


def test_compose_commands_parse_with_the_ripples_cli() -> None:
    compose = _compose()
    parser = build_parser()
    lines = {name: _command(s) for name, s in _ripples_services(compose).items()}
    lines |= {f"{name} (health check)": c for name, c in _health_commands(compose).items()}
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
    command = _command(_compose()["services"]["coordinator"])
    assert command[:2] == ["coordinator", "serve"]
    options = _options(command)
    extra = set(options) - COORDINATOR_SERVE_OPTIONS
    assert not extra, f"run options make the coordinator's one-run form: {extra}"
    assert options["advertise-host"] == "coordinator"
    state = _source(_compose()["services"]["coordinator"], options["state-dir"])
    assert not _is_bind(state[0]) and state[1] == ".", "the state dir is a named volume"


def test_compose_agents_have_the_slots_the_submitted_run_needs() -> None:
    compose = _compose()
    services = compose["services"]
    coordinator = _options(_command(services["coordinator"]))
    address = f"coordinator:{coordinator['port']}"
    submit_command = _command(services["submit"])
    options, script = split_script(submit_command)
    run = _options(options)
    assert options[:2] == ["submit", "--wait"]
    agents = {n: _options(_command(s)) for n, s in _agents(compose).items()}
    slots = [int(a["nproc-per-node"]) for a in agents.values()]
    assert sum(slots) >= int(run["workers"]), (slots, run["workers"])
    assert set(slots) == {int(run["workers-per-node"])}, (slots, run["workers-per-node"])
    assert len({a["host"] for a in agents.values()}) == len(agents)
    for name, options in agents.items():
        # Prometheus scrapes the address the workers register; the service name resolves
        # on the compose network.
        assert options["metrics-host"] == name and int(options["metrics-port"]) > 0
        assert _source(services[name], options["output-dir"])[0] == "agent-output"
    for name, service in _clients(compose).items():
        assert _client_files(service)["coordinator"] == address, name
    # The example run and its knobs.
    assert script[:3] == ["python", "-m", "ripples.examples.transformer_lm"]
    assert _options(script)["steps"] == run["iterations"]
    raw = " ".join(services["submit"]["command"])
    assert "${RIPPLES_PROTOCOL:-" in raw and "${RIPPLES_ITERATIONS:-" in raw


def test_compose_clients_and_coordinator_agree_on_tokens_and_tls() -> None:
    compose = _compose()
    services = compose["services"]
    coordinator = services["coordinator"]
    options = _options(_command(coordinator))
    token = _source(coordinator, options["token-file"])
    read_token = _source(coordinator, options["read-token-file"])
    cert = _source(coordinator, options["tls-cert"])
    key = _source(coordinator, options["tls-key"])
    assert token[0] != read_token[0] and cert[0] == key[0]
    probe_options = _options(_health_commands(compose)["coordinator"])
    assert _source(coordinator, probe_options["tls-ca"]) == (cert[0], "ca.crt")
    assert probe_options["coordinator"] == f"127.0.0.1:{options['port']}"
    assert probe_options["tls-server-name"] == "coordinator"
    ca_files = set()
    for name, service in _clients(compose).items():
        files = _client_files(service)
        assert files["token"] and files["ca"], f"{name} needs a token and the CA"
        expected = read_token if name == "dashboard" else token
        assert _source(service, files["token"]) == expected, name
        ca_files.add(_source(service, files["ca"]))
        # The CA only: no client mounts the coordinator's key.
        assert key[0] not in {src for src, _ in _mounts(service)}, name
    assert ca_files == {("tls-ca", "ca.crt")}
    # The dashboard holds the read-only token only.
    assert token[0] not in {src for src, _ in _mounts(services["dashboard"])}


# ---------------------------------------------------------------------------- init


def _init_volumes(tmp_path: Path) -> Path:
    """Stand-ins for the volumes init writes, as the init service mounts them."""
    init = _compose()["services"]["init"]
    assert init["entrypoint"][0] == "sh"
    assert _source(init, init["entrypoint"][1]) == ("./compose/init-secrets.sh", ".")
    (root,) = init["command"]
    volumes = tmp_path / "volumes"
    for src, target in _mounts(init):
        if not _is_bind(src):
            assert target == f"{root}/{src}", "init sees each volume under its own name"
            (volumes / src).mkdir(parents=True)
    return volumes


def _run_init(volumes: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["sh", str(INIT_SCRIPT), str(volumes)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The init script's output, once per module: the volumes' stand-ins."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found: install the Debian package openssl")
    made = _init_volumes(tmp_path_factory.mktemp("compose"))
    _run_init(made)
    return made


def _every_file_a_service_reads(compose: dict) -> list[tuple[str, str]]:
    """(service, container path) of every secret a Ripples service or Prometheus reads."""
    files = []
    for name, service in _ripples_services(compose).items():
        options = _options(_command(service))
        for key in ("token-file", "read-token-file", "tls-cert", "tls-key", "tls-ca"):
            if key in options:
                files.append((name, options[key]))
        for key in ("RIPPLES_TOKEN_FILE", "RIPPLES_TLS_CA"):
            if key in service.get("environment", {}):
                files.append((name, service["environment"][key]))
    config = _yaml(_prometheus_config_file())
    for job in config["scrape_configs"]:
        for auth in [job["authorization"]] + [sd["authorization"]
                                              for sd in job["http_sd_configs"]]:
            files.append(("prometheus", auth["credentials_file"]))
    return files


@needs_openssl
def test_init_makes_every_secret_the_services_read(volumes: Path) -> None:
    compose = _compose()
    for name, path in _every_file_a_service_reads(compose):
        local = _local(compose["services"][name], path, volumes)
        assert local.is_file() and local.stat().st_size, f"{name}: {path} is not made by init"
    token = (volumes / "token" / "token").read_text().strip()
    read_token = (volumes / "read-token" / "token").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", token) and re.fullmatch(r"[0-9a-f]{64}", read_token)
    assert token != read_token
    # Only what the coordinator needs: no CA key left anywhere.
    made = sorted(str(p.relative_to(volumes)) for p in volumes.rglob("*") if p.is_file())
    assert made == ["read-token/token", "tls-ca/ca.crt", "tls/ca.crt", "tls/tls.crt",
                    "tls/tls.key", "token/token"], made
    modes = {"token/token": 0o440, "read-token/token": 0o440, "tls/tls.key": 0o400,
             "tls/tls.crt": 0o444, "tls/ca.crt": 0o444, "tls-ca/ca.crt": 0o444}
    for path, mode in modes.items():
        assert stat.S_IMODE((volumes / path).stat().st_mode) == mode, path
    if os.geteuid() == 0:  # as in the container: handed to the image's user
        for path in [*modes, "coordinator-state", "agent-output"]:
            st = (volumes / path).stat()
            assert (st.st_uid, st.st_gid) == (RIPPLES_UID, RIPPLES_UID), path
    # Prometheus (the image's user nobody) reads the tokens as a member of their group.
    assert str(RIPPLES_UID) in compose["services"]["prometheus"]["group_add"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"--uid {RIPPLES_UID}" in dockerfile


@needs_openssl
def test_init_certificate_names_what_the_clients_dial(volumes: Path) -> None:
    compose = _compose()
    cert = x509.load_pem_x509_certificate((volumes / "tls" / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((volumes / "tls-ca" / "ca.crt").read_bytes())
    assert (volumes / "tls" / "ca.crt").read_bytes() == (volumes / "tls-ca" / "ca.crt").read_bytes()
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = set(cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
    dialled = {_client_files(s)["coordinator"].rsplit(":", 1)[0]
               for s in _clients(compose).values()}
    probe = _options(_health_commands(compose)["coordinator"])
    assert dialled | {probe["tls-server-name"], "localhost"} <= names, names
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in usage


@needs_openssl
def test_init_keeps_the_secrets_of_an_earlier_up(tmp_path: Path) -> None:
    volumes = _init_volumes(tmp_path)
    _run_init(volumes)
    before = {p: p.read_bytes() for p in volumes.rglob("*") if p.is_file()}
    again = _run_init(volumes)
    assert "keeping the certificate" in again.stdout
    assert {p: p.read_bytes() for p in volumes.rglob("*") if p.is_file()} == before
    # A certificate that no longer verifies against the clients' CA is made again.
    (volumes / "tls-ca" / "ca.crt").unlink()
    _run_init(volumes)
    assert (volumes / "tls" / "tls.crt").read_bytes() != before[volumes / "tls" / "tls.crt"]
    assert (volumes / "token" / "token").read_bytes() == before[volumes / "token" / "token"]


def test_init_refuses_to_run_without_its_volumes(tmp_path: Path) -> None:
    result = subprocess.run(["sh", str(INIT_SCRIPT), str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "mount the volume" in result.stderr


@contextmanager
def _compose_coordinator(volumes: Path, tmp_path: Path) -> Iterator[tuple[int, int, dict]]:
    """The compose coordinator's command on this machine: its files mapped onto the
    volumes' stand-ins, its ports free ones on 127.0.0.1. Yields its gRPC and HTTP ports
    and its service."""
    service = _compose()["services"]["coordinator"]
    state = tmp_path / "coordinator-state"
    state.mkdir()
    port, metrics_port = free_port(), free_port()
    mapped = {"host": "127.0.0.1", "port": str(port), "store-port": "0",
              "metrics-port": str(metrics_port), "state-dir": str(state)}
    command = []
    for arg in _command(service):
        name, _, value = arg[2:].partition("=")
        if arg.startswith("--") and value:
            if name in mapped:
                value = mapped[name]
            elif value.startswith("/"):
                value = str(_local(service, value, volumes))
            arg = f"--{name}={value}"
        command.append(arg)
    log = open(tmp_path / "coordinator.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ripples.cli", *command], stdout=log,
                            stderr=subprocess.STDOUT, env=_clean_env())
    try:
        yield port, metrics_port, service
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _clean_env() -> dict[str, str]:
    """This environment less the RIPPLES_* variables (`ripples` reads some as options)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RIPPLES_")}


def _ripples(args: list[str], env: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ripples.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=_clean_env() | (env or {}))


def _http_status(url: str, token: str = "") -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}
                                     if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


@needs_openssl
def test_compose_coordinator_answers_its_health_check_and_every_client(
        volumes: Path, tmp_path: Path) -> None:
    compose = _compose()
    with _compose_coordinator(volumes, tmp_path) as (port, metrics_port, coordinator):
        probe = []
        for arg in _health_commands(compose)["coordinator"]:
            if arg.startswith("--coordinator="):
                arg = f"--coordinator=127.0.0.1:{port}"
            elif arg.startswith("--tls-ca="):
                arg = f"--tls-ca={_local(coordinator, arg.split('=', 1)[1], volumes)}"
            probe.append(arg)
        deadline = time.monotonic() + 60
        while (result := _ripples(probe)).returncode != 0:
            assert time.monotonic() < deadline, (
                result.stderr + (tmp_path / "coordinator.log").read_text())
            time.sleep(0.5)
        assert "SERVING" in result.stdout
        # Each client's token and CA (each pair once), through the name the certificate
        # holds for the Docker host (the compose names do not resolve here).
        pairs: dict[tuple[Path, Path], str] = {}
        for name, service in _clients(compose).items():
            files = _client_files(service)
            pairs.setdefault((_local(service, files["token"], volumes),
                              _local(service, files["ca"], volumes)), name)
        assert len(pairs) == 2, pairs  # the run's token, the read-only token
        for (token, ca), name in pairs.items():
            env = {"RIPPLES_TOKEN_FILE": str(token), "RIPPLES_TLS_CA": str(ca)}
            result = _ripples(["runs", f"--coordinator=localhost:{port}"], env)
            assert result.returncode == 0, f"{name}: {result.stderr}"
            assert "no runs yet" in result.stdout, name
        # Without the token: refused.
        result = _ripples(["runs", f"--coordinator=localhost:{port}",
                           f"--tls-ca={volumes / 'tls-ca' / 'ca.crt'}"])
        assert result.returncode != 0 and "requires a token" in result.stderr
        # Prometheus' tokens over HTTP: /sd and the coordinator's /metrics take the
        # read-only one (and the run's), and nothing without one.
        prometheus = compose["services"]["prometheus"]
        tokens = {_source(prometheus, job["authorization"]["credentials_file"])
                  for job in _yaml(_prometheus_config_file())["scrape_configs"]}
        for volume, inside in tokens:
            token = (volumes / volume / inside).read_text().strip()
            for path in ("/sd", "/metrics"):
                url = f"http://127.0.0.1:{metrics_port}{path}"
                assert _http_status(url, token) == 200, (volume, path)
        assert _http_status(f"http://127.0.0.1:{metrics_port}/sd") == 401


# ---------------------------------------------------------------------------- prometheus


def _prometheus_config_file() -> Path:
    """The config file the compose Prometheus runs (its --config.file, as mounted)."""
    prometheus = _compose()["services"]["prometheus"]
    (config,) = [a.split("=", 1)[1] for a in prometheus["command"]
                 if a.startswith("--config.file=")]
    src, inside = _source(prometheus, config)
    assert _is_bind(src) and inside == "."
    return DEPLOY / src


@needs_promtool
def test_prometheus_configs_pass_promtool() -> None:
    assert PROMTOOL is not None
    # --syntax-only: the token files exist in the container only.
    for command in (["--syntax-only", str(_prometheus_config_file())],
                    [str(PROMETHEUS_TEMPLATE)]):
        result = subprocess.run([PROMTOOL, "check", "config", *command],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_with_the_tokens_the_targets_take() -> None:
    """One config for compose and deploy/k8s: the coordinator's /sd and /metrics with the
    read-only token, the workers' /metrics with the run's token (the only one they take)."""
    compose = _compose()
    services = compose["services"]
    prometheus, coordinator = services["prometheus"], services["coordinator"]
    assert _prometheus_config_file() == DEPLOY / "k8s" / "base" / "prometheus" / "prometheus.yml"
    options = _options(_command(coordinator))
    names = {"coordinator", *coordinator["networks"]["default"]["aliases"]}
    token = _source(coordinator, options["token-file"])
    read_token = _source(coordinator, options["read-token-file"])
    config = _yaml(_prometheus_config_file())
    roles = {}
    for job in config["scrape_configs"]:
        (sd,) = job["http_sd_configs"]
        match = re.fullmatch(r"http://([\w.-]+):(\d+)/sd", sd["url"])
        assert match and match.group(1) in names, sd["url"]
        assert match.group(2) == options["metrics-port"], sd["url"]
        assert _source(prometheus, sd["authorization"]["credentials_file"]) == read_token
        (keep,) = job["relabel_configs"]
        assert keep["source_labels"] == ["role"] and keep["action"] == "keep"
        roles[keep["regex"]] = _source(prometheus, job["authorization"]["credentials_file"])
    assert roles == {"coordinator": read_token, "worker": token}
    # The tokenless template has the same scrape timing (Grafana's timeInterval).
    assert _yaml(PROMETHEUS_TEMPLATE)["global"] == config["global"]


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
    scrape_interval = _yaml(_prometheus_config_file())["global"]["scrape_interval"]
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


# ---------------------------------------------------------------------------- slurm


SLURM_STANDINS = {
    # One task on this machine whatever the node count; the step's pid kept by its name
    # (exec: the pid the sbatch holds is the command's).
    "srun": r"""#!/usr/bin/env bash
name=step
while [[ $1 == --* ]]; do
    case $1 in --job-name=*) name=${1#--job-name=} ;; esac
    shift
done
echo $$ > "$STANDIN_STEPS/$name"
exec "$@"
""",
    "squeue": r"""#!/usr/bin/env bash
if [[ " $* " == *" --steps "* ]]; then
    for f in "$STANDIN_STEPS"/*; do
        [[ -e $f ]] && echo "$SLURM_JOB_ID.$(basename "$f") $(basename "$f")"
    done
else
    echo "${STANDIN_TIME_LEFT:-1-00:00:00}"
fi
""",
    "scancel": r"""#!/usr/bin/env bash
sig=KILL
for a in "$@"; do case $a in --signal=*) sig=${a#--signal=} ;; *) target=$a ;; esac; done
echo "scancel $sig $target" >> "$STANDIN_SCANCEL_LOG"
kill -s "$sig" "$(cat "$STANDIN_STEPS/${target#*.}")"
""",
    "scontrol": """#!/usr/bin/env bash
echo localhost
""",
}

RIPPLES_STANDIN = '''#!{python}
"""Stand-in for `ripples`: checks its command line with the real parser, records it,
and plays its part: serve and agents until SIGTERM, health SERVING once serve started,
submit waits
STANDIN_SUBMIT_SECONDS and exits STANDIN_SUBMIT_CODE."""
import json, os, signal, sys, time
from ripples.cli.main import build_parser, split_script

argv = sys.argv[1:]
options, script = split_script(argv)


def record(event):
    with open(os.environ["STANDIN_LOG"], "a") as f:
        f.write(json.dumps({{"event": event, "argv": argv, "time": time.time()}}) + "\\n")


def end(event, code):
    record(event)
    sys.exit(code)


try:
    build_parser().parse_args(options)
except SystemExit:
    end("rejected", 2)
if options[:2] == ["coordinator", "health"]:  # SERVING once the coordinator started
    with open(os.environ["STANDIN_LOG"]) as f:
        events = [json.loads(line) for line in f]
    if any(e["event"] == "start" and e["argv"][:2] == ["coordinator", "serve"] for e in events):
        end("serving", 0)
    end("not serving", 1)
record("start")
if options[:2] == ["coordinator", "serve"] or "--agent" in options:
    if "--agent" in options and os.environ.get("STANDIN_AGENT_EXIT"):
        end("exit", int(os.environ["STANDIN_AGENT_EXIT"]))
    signal.signal(signal.SIGTERM, lambda *_: end("term", 0))
    time.sleep(120)
    end("never stopped", 3)
if options[:1] == ["submit"]:
    time.sleep(float(os.environ.get("STANDIN_SUBMIT_SECONDS", "1")))
    sys.exit(int(os.environ.get("STANDIN_SUBMIT_CODE", "0")))
'''


class SbatchRun:
    """One run of deploy/slurm/ripples.sbatch under the stand-ins."""

    def __init__(self, result: subprocess.CompletedProcess[str], tmp_path: Path,
                 job_dir: Path) -> None:
        self.result = result
        self.job_dir = job_dir
        log = tmp_path / "ripples.log"
        self.events = [json.loads(line) for line in log.read_text().splitlines()] if (
            log.exists()) else []
        scancel = tmp_path / "scancel.log"
        self.scancels = scancel.read_text().splitlines() if scancel.exists() else []

    @property
    def output(self) -> str:
        return self.result.stdout + self.result.stderr

    def started(self, *prefix: str) -> list[list[str]]:
        return [e["argv"] for e in self.events
                if e["event"] == "start" and e["argv"][:len(prefix)] == list(prefix)]

    def time_of(self, event: str, *prefix: str) -> float:
        (found,) = [e["time"] for e in self.events
                    if e["event"] == event and e["argv"][:len(prefix)] == list(prefix)]
        return float(found)


def _run_sbatch(tmp_path: Path, args: list[str], *, standin: bool = True,
                env: dict[str, str] | None = None, nodes: int = 2, gpus: int = 4,
                timeout: float = 180) -> SbatchRun:
    bin_dir = tmp_path / "bin"
    steps = tmp_path / "steps"
    bin_dir.mkdir()
    steps.mkdir()
    scripts = dict(SLURM_STANDINS)
    if standin:
        scripts["ripples"] = RIPPLES_STANDIN.format(python=sys.executable)
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job_id = "4242"
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("RIPPLES_", "SLURM"))} | {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "STANDIN_STEPS": str(steps), "STANDIN_LOG": str(tmp_path / "ripples.log"),
        "STANDIN_SCANCEL_LOG": str(tmp_path / "scancel.log"),
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_JOB_NODELIST": "localhost", "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_GPUS_PER_NODE": str(gpus), "RIPPLES_PORT": str(free_port()),
        "RIPPLES_METRICS_PORT": "0", "RIPPLES_STOP_GRACE": "20"} | (env or {})
    proc = subprocess.Popen(["bash", str(SBATCH), *args], cwd=tmp_path, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"the sbatch did not end within {timeout}s:\n{stdout}{stderr}")
    finally:
        # Whatever the script left behind (its process group is this test's alone).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return SbatchRun(result, tmp_path, tmp_path / f"ripples-{job_id}")


def test_sbatch_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        result = subprocess.run([shellcheck, str(SBATCH), str(INIT_SCRIPT)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("code, tls", [(0, False), (1, True)], ids=["finished", "failed-tls"])
def test_sbatch_runs_agents_submits_the_run_and_exits_with_its_code(
        tmp_path: Path, code: int, tls: bool) -> None:
    tls_env = {"RIPPLES_TLS_CERT": "/certs/coord.crt", "RIPPLES_TLS_KEY": "/certs/coord.key",
               "RIPPLES_TLS_CA": "/certs/ca.crt"} if tls else {}
    run = _run_sbatch(tmp_path, ["--protocol", "hop", "--max-restarts", "2", "--",
                                 "python", "train.py", "--lr", "0.1"],
                      env={"STANDIN_SUBMIT_CODE": str(code), **tls_env})
    assert run.result.returncode == code, run.output
    assert not [e for e in run.events if e["event"] == "rejected"], run.events
    token = run.job_dir / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(run.job_dir.stat().st_mode) == 0o700
    assert re.fullmatch(r"[0-9a-f]{64}\n", token.read_text())

    def options(argv: list[str]) -> dict[str, str]:
        pairs = {}
        for i, arg in enumerate(argv):
            if arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                pairs[arg[2:]] = argv[i + 1]
        return pairs

    (serve,) = run.started("coordinator", "serve")
    (agents,) = run.started("worker", "run", "--agent")
    (submit,) = run.started("submit", "--wait")
    health = [e["argv"] for e in run.events if e["argv"][:2] == ["coordinator", "health"]]
    assert health, "the coordinator's health is checked before anything uses it"
    serve_options = options(serve)
    # No run options: the coordinator starts with no run; the run is submitted.
    assert set(serve_options) <= {"host", "port", "metrics-port", "advertise-host",
                                  "state-dir", "token-file", "tls-cert", "tls-key"}
    assert serve_options["state-dir"] == str(run.job_dir / "state")
    assert options(agents)["nproc-per-node"] == "4"
    assert options(agents)["output-dir"] == str(run.job_dir / "output")
    run_options, script = split_script(submit)
    submitted = options(run_options)
    assert (submitted["workers"], submitted["workers-per-node"]) == ("8", "4")
    assert submitted["protocol"] == "hop" and submitted["max-restarts"] == "2"
    assert script == ["python", "train.py", "--lr", "0.1"]
    for argv in (serve, agents, submit):
        assert options(argv)["token-file"] == str(token), argv
    for argv in (agents, submit, *health):
        assert options(argv).get("tls-ca") == ("/certs/ca.crt" if tls else None), argv
    assert (serve_options.get("tls-cert"), serve_options.get("tls-key")) == (
        ("/certs/coord.crt", "/certs/coord.key") if tls else (None, None))
    # In order: the coordinator serves (its health check answers), then the agents and
    # the run start; at its end the agents drain (SIGTERM to their step's tasks), then
    # the coordinator stops.
    served = run.time_of("serving", "coordinator", "health")
    assert run.time_of("start", "coordinator", "serve") < served
    assert served < run.time_of("start", "worker") and served < run.time_of("start", "submit")
    assert run.time_of("term", "worker") < run.time_of("term", "coordinator", "serve")
    assert run.scancels == ["scancel TERM 4242.ripples-agents",
                            "scancel TERM 4242.ripples-coordinator"]


def test_sbatch_ends_the_job_when_the_agents_fail(tmp_path: Path) -> None:
    start = time.monotonic()
    run = _run_sbatch(tmp_path, ["--task", "digits"],
                      env={"STANDIN_AGENT_EXIT": "1", "STANDIN_SUBMIT_SECONDS": "100"})
    assert run.result.returncode == 1, run.output
    assert "the agents' step ended before the run" in run.result.stderr
    assert run.time_of("term", "coordinator", "serve")
    assert time.monotonic() - start < 60


def test_sbatch_bounds_the_run(tmp_path: Path) -> None:
    run = _run_sbatch(tmp_path, ["--task", "digits"],
                      env={"RIPPLES_RUN_TIMEOUT": "3", "STANDIN_SUBMIT_SECONDS": "100",
                           "SLURM_RESTART_COUNT": "1"})
    assert run.result.returncode == 1, run.output
    assert "did not end within 3s" in run.result.stderr
    assert run.time_of("term", "worker") < run.time_of("term", "coordinator", "serve")
    # A requeued job does not resume the first attempt's state beside its new run.
    (serve,) = run.started("coordinator", "serve")
    assert serve[serve.index("--state-dir") + 1] == str(tmp_path / "ripples-4242.1" / "state")


def test_sbatch_wants_all_three_tls_files_or_none(tmp_path: Path) -> None:
    run = _run_sbatch(tmp_path, ["--task", "digits"], env={"RIPPLES_TLS_CA": "/certs/ca.crt"})
    assert run.result.returncode == 2 and "TLS needs" in run.result.stderr
    assert not run.events and not run.job_dir.exists(), "nothing may start"


@pytest.mark.slow
def test_sbatch_runs_a_real_run_on_one_node(tmp_path: Path) -> None:
    """The real `ripples`: coordinator, one agent with two CPU workers, the digits task."""
    run = _run_sbatch(tmp_path, ["--protocol", "ripples-smart", "--task", "digits",
                                 "--iterations", "40"], standin=False, nodes=1, gpus=2)
    assert run.result.returncode == 0, run.output[-5000:]
    assert re.search(r"run \w+ finished", run.result.stdout), run.output[-5000:]
    (run_dir,) = (run.job_dir / "output").iterdir()
    assert sorted(p.name.rsplit("-", 1)[1] for p in run_dir.glob("model-*.pt")) == [
        "0.pt", "1.pt"]
    assert "drained, exiting" in run.result.stderr
