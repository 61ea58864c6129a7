"""deploy/compose/init-secrets.sh makes every secret the compose services read, and a real
coordinator runs on them.

No Docker runs here: the real init script writes into stand-ins for the volumes the init
service mounts (it makes the certificates with openssl; those tests skip without it). The
tests look up every file a Ripples service or Prometheus names on those stand-ins, check
the files' modes and owners, read the certificate with `cryptography`, and start a real
coordinator with the compose command (paths mapped onto the stand-ins, free ports on
127.0.0.1) that answers the compose health check, every client's token and CA over TLS,
and Prometheus' tokens over HTTP.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from compose_files import (
    INIT_SCRIPT,
    client_files,
    client_services,
    health_commands,
    is_bind,
    load_compose,
    local_file,
    mount_source,
    mounts,
    option_values,
    prometheus_config_file,
    ripples_services,
    service_command,
)
from cryptography import x509
from deploy_tree import DEPLOY, RIPPLES_UID, load_yaml

from tests.integration.helpers import free_port

needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl not found: install the Debian package "
    "openssl (the init script makes the certificates with it)")


def _init_volumes(tmp_path: Path) -> Path:
    """Stand-ins for the volumes init writes, as the init service mounts them."""
    init = load_compose()["services"]["init"]
    assert init["entrypoint"][0] == "sh"
    assert mount_source(init, init["entrypoint"][1]) == ("./compose/init-secrets.sh", ".")
    (root,) = init["command"]
    volumes = tmp_path / "volumes"
    for src, target in mounts(init):
        if not is_bind(src):
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
    for name, service in ripples_services(compose).items():
        options = option_values(service_command(service))
        for key in ("token-file", "read-token-file", "tls-cert", "tls-key", "tls-ca"):
            if key in options:
                files.append((name, options[key]))
        for key in ("RIPPLES_TOKEN_FILE", "RIPPLES_TLS_CA"):
            if key in service.get("environment", {}):
                files.append((name, service["environment"][key]))
    config = load_yaml(prometheus_config_file())
    for job in config["scrape_configs"]:
        for auth in [job["authorization"]] + [sd["authorization"]
                                              for sd in job["http_sd_configs"]]:
            files.append(("prometheus", auth["credentials_file"]))
    return files


@needs_openssl
def test_init_makes_every_secret_the_services_read(volumes: Path) -> None:
    compose = load_compose()
    for name, path in _every_file_a_service_reads(compose):
        local = local_file(compose["services"][name], path, volumes)
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
    compose = load_compose()
    cert = x509.load_pem_x509_certificate((volumes / "tls" / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((volumes / "tls-ca" / "ca.crt").read_bytes())
    assert (volumes / "tls" / "ca.crt").read_bytes() == (volumes / "tls-ca" / "ca.crt").read_bytes()
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = set(cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
    dialled = {client_files(s)["coordinator"].rsplit(":", 1)[0]
               for s in client_services(compose).values()}
    probe = option_values(health_commands(compose)["coordinator"])
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
    service = load_compose()["services"]["coordinator"]
    state = tmp_path / "coordinator-state"
    state.mkdir()
    port, metrics_port = free_port(), free_port()
    mapped = {"host": "127.0.0.1", "port": str(port), "store-port": "0",
              "metrics-port": str(metrics_port), "state-dir": str(state)}
    command = []
    for arg in service_command(service):
        name, _, value = arg[2:].partition("=")
        if arg.startswith("--") and value:
            if name in mapped:
                value = mapped[name]
            elif value.startswith("/"):
                value = str(local_file(service, value, volumes))
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
    compose = load_compose()
    with _compose_coordinator(volumes, tmp_path) as (port, metrics_port, coordinator):
        probe = []
        for arg in health_commands(compose)["coordinator"]:
            if arg.startswith("--coordinator="):
                arg = f"--coordinator=127.0.0.1:{port}"
            elif arg.startswith("--tls-ca="):
                arg = f"--tls-ca={local_file(coordinator, arg.split('=', 1)[1], volumes)}"
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
        for name, service in client_services(compose).items():
            files = client_files(service)
            pairs.setdefault((local_file(service, files["token"], volumes),
                              local_file(service, files["ca"], volumes)), name)
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
        tokens = {mount_source(prometheus, job["authorization"]["credentials_file"])
                  for job in load_yaml(prometheus_config_file())["scrape_configs"]}
        for volume, inside in tokens:
            token = (volumes / volume / inside).read_text().strip()
            for path in ("/sd", "/metrics"):
                url = f"http://127.0.0.1:{metrics_port}{path}"
                assert _http_status(url, token) == 200, (volume, path)
        assert _http_status(f"http://127.0.0.1:{metrics_port}/sd") == 401
