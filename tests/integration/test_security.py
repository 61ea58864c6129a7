"""The control plane's security (ripples/security.py, docs/security.md) on a real gRPC
coordinator on loopback, with a CA and certificates made here: TLS, mutual TLS, the
token and the read-only token checked before anything reaches the run, health checking
without a token, server reflection, and a whole run over TLS with a token from the CLI."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ripples.client_security import ClientSecurity
from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.rpc import CoordinatorCallError, aio_channel, coordinator_channel
from ripples.security import read_secret
from ripples.server_security import ServerSecurity
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc
from ripples.worker.client import CoordinatorClient
from ripples.worker.metrics import WorkerMetrics
from tests.integration.helpers import REPO, finish
from tests.pki import READ_TOKEN, TOKEN, Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secured(pki: Pki) -> Iterator[CoordinatorServer]:
    security = ServerSecurity(token=TOKEN, read_token=READ_TOKEN, cert_file=str(pki.server_cert),
                              key_file=str(pki.server_key))
    server = CoordinatorServer(ServerConfig(
        host="127.0.0.1", port=0, run=RunSettings.build(num_workers=2, task="digits"),
        security=security))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _worker_stub(address: str, security: ClientSecurity) -> pb_grpc.WorkerStub:
    return pb_grpc.WorkerStub(coordinator_channel(address, security))


def _runs_stub(address: str, security: ClientSecurity) -> pb_grpc.RunsStub:
    return pb_grpc.RunsStub(coordinator_channel(address, security))


def _address(server: CoordinatorServer) -> str:
    return f"127.0.0.1:{server.port}"


# ---------------------------------------------------------------------------- tokens
def test_a_missing_or_wrong_token_is_refused_and_leaves_no_trace(
        secured: CoordinatorServer, pki: Pki) -> None:
    core = secured.service.core  # type: ignore[union-attr]
    register = pb.RegisterRequest(host="intruder", local_rank=0, device="cpu", pid=1)
    for token, message in [("", "this coordinator requires a token"),
                           ("not-the-token", "wrong token")]:
        security = ClientSecurity(token=token, ca_file=str(pki.ca))
        with pytest.raises(grpc.RpcError) as refused:
            _worker_stub(_address(secured), security).Register(register, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert message in refused.value.details()
        assert TOKEN not in refused.value.details()
        with pytest.raises(grpc.RpcError) as stopped:
            _runs_stub(_address(secured), security).StopRun(
                pb.StopRunRequest(reason="let me in"), timeout=10)
        assert stopped.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not core.workers and not core.stopped  # nothing reached the run
    # The streaming call (Synchronize) is refused the same way.
    stub = _worker_stub(_address(secured), ClientSecurity(ca_file=str(pki.ca)))
    with pytest.raises(grpc.RpcError) as streamed:
        list(stub.Synchronize(iter([pb.SyncMessage()]), timeout=10))
    assert streamed.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_read_only_token_reads_but_changes_nothing(secured: CoordinatorServer,
                                                        pki: Pki) -> None:
    core = secured.service.core  # type: ignore[union-attr]
    reader = CoordinatorClient(_address(secured), rpc_timeout_seconds=10,
                               security=ClientSecurity(token=READ_TOKEN, ca_file=str(pki.ca)))
    status = reader.run_status()
    assert status.config.num_workers == 2
    with pytest.raises(CoordinatorCallError, match="PERMISSION_DENIED.*read-only token may "
                                                   "not call StopRun"):
        reader.stop_run("a dashboard tried")
    with pytest.raises(CoordinatorCallError, match="PERMISSION_DENIED"):
        reader.register("node0", 0, "cpu", 1)
    # The service's views are readable; submitting, and an agent's poll, are not.
    assert [r.run_id for r in reader.list_runs().runs] == [status.config.run_id]
    assert list(reader.logs(status.config.run_id)) == []
    with pytest.raises(CoordinatorCallError, match="PERMISSION_DENIED.*SubmitRun"):
        reader.submit_run('{"num_workers": 2, "task": "digits", "iterations": 5}')
    with pytest.raises(CoordinatorCallError, match="PERMISSION_DENIED.*AgentPoll"):
        reader.agent_poll(pb.AgentPollRequest(host="h", slots=1))
    assert len(reader.list_runs().runs) == 1 and not core.stopped and not core.workers
    writer = CoordinatorClient(_address(secured), rpc_timeout_seconds=10,
                               security=ClientSecurity(token=TOKEN, ca_file=str(pki.ca)))
    reply = writer.register("node0", 0, "cpu", 1)
    assert reply.worker_id in core.workers


def test_the_dashboards_asyncio_channel_carries_the_read_only_token(
        secured: CoordinatorServer, pki: Pki) -> None:
    """The dashboard polls GetRunStatus over an asyncio channel (ripples.rpc.aio_channel):
    a read-only token is all it needs."""
    async def poll() -> tuple[int, grpc.StatusCode]:
        security = ClientSecurity(token=READ_TOKEN, ca_file=str(pki.ca))
        async with aio_channel(_address(secured), security) as channel:
            stub = pb_grpc.RunsStub(channel)
            status = await stub.GetRunStatus(pb.RunStatusRequest(), timeout=10)
            try:
                await stub.StopRun(pb.StopRunRequest(reason="no"), timeout=10)
            except grpc.aio.AioRpcError as err:
                return status.config.num_workers, err.code()
        raise AssertionError("StopRun was allowed with a read-only token")

    assert asyncio.run(poll()) == (2, grpc.StatusCode.PERMISSION_DENIED)
    assert not secured.service.core.stopped  # type: ignore[union-attr]


def test_health_needs_no_token_and_reflection_lists_the_api(secured: CoordinatorServer,
                                                            pki: Pki) -> None:
    no_token = coordinator_channel(_address(secured), ClientSecurity(ca_file=str(pki.ca)))
    health = health_pb2_grpc.HealthStub(no_token)
    for service in ("", "ripples.v1.Worker", "ripples.v1.Runs", "ripples.v1.Agents"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with_token = coordinator_channel(_address(secured),
                                     ClientSecurity(token=TOKEN, ca_file=str(pki.ca)))
    replies = reflection_pb2_grpc.ServerReflectionStub(with_token).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"ripples.v1.Worker", "ripples.v1.Runs", "ripples.v1.Agents",
            "grpc.health.v1.Health"} <= names
    refused = reflection_pb2_grpc.ServerReflectionStub(no_token).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        list(refused)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---------------------------------------------------------------------------- TLS
def test_a_client_without_tls_or_trusting_another_ca_cannot_connect(
        secured: CoordinatorServer, pki: Pki) -> None:
    for security in (ClientSecurity(token=TOKEN),
                     ClientSecurity(token=TOKEN, ca_file=str(pki.other_ca))):
        stub = _runs_stub(_address(secured), security)
        with pytest.raises(grpc.RpcError) as failed:
            stub.GetRunStatus(pb.RunStatusRequest(), timeout=5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    # What a worker says (and it does not retry a failed handshake for its outage window).
    plaintext = CoordinatorClient(_address(secured), rpc_timeout_seconds=5,
                                  security=ClientSecurity(token=TOKEN))
    with pytest.raises(CoordinatorCallError, match="speaks TLS and this client does not: "
                                                   "give --tls-ca"):
        plaintext.run_status()
    wrong_ca = CoordinatorClient(_address(secured), rpc_timeout_seconds=5,
                                 security=ClientSecurity(token=TOKEN, ca_file=str(pki.other_ca)))
    wrong_ca.outage_seconds = 60.0
    started = time.monotonic()
    with pytest.raises(CoordinatorCallError, match="certificate check failed: unable to get "
                                                   "local issuer certificate; check --tls-ca"):
        wrong_ca.run_status()
    assert time.monotonic() - started < 30


def test_mutual_tls_requires_a_client_certificate(pki: Pki) -> None:
    security = ServerSecurity(token=TOKEN, cert_file=str(pki.server_cert),
                              key_file=str(pki.server_key), client_ca_file=str(pki.ca))
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, security=security,
                                            run=RunSettings.build(num_workers=2)))
    server.start()
    try:
        anonymous = _runs_stub(_address(server), ClientSecurity(token=TOKEN, ca_file=str(pki.ca)))
        with pytest.raises(grpc.RpcError) as failed:
            anonymous.GetRunStatus(pb.RunStatusRequest(), timeout=5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        known = _runs_stub(_address(server), ClientSecurity(
            token=TOKEN, ca_file=str(pki.ca), cert_file=str(pki.client_cert),
            key_file=str(pki.client_key)))
        assert known.GetRunStatus(pb.RunStatusRequest(), timeout=10).config.num_workers == 2
    finally:
        server.stop()


# ---------------------------------------------------------------------------- settings
def test_bad_security_settings_say_what_is_wrong_and_never_show_a_token(
        pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="token file .*empty is empty"):
        read_secret(empty)
    with pytest.raises(ValueError, match="cannot read the token file .*absent"):
        ServerSecurity.build(token_file=str(tmp_path / "absent"), environ={})
    with pytest.raises(ValueError, match="certificate and its key"):
        ServerSecurity.build(cert_file=str(pki.server_cert), environ={})
    with pytest.raises(ValueError, match="read-only token needs a full token"):
        ServerSecurity.build(read_token_file=str(pki.read_token), environ={})
    with pytest.raises(ValueError, match="must differ"):
        ServerSecurity.build(token_file=str(pki.token), read_token_file=str(pki.token),
                             environ={})
    with pytest.raises(ValueError, match="both a client certificate and its key"):
        ClientSecurity.from_env({"RIPPLES_TLS_CLIENT_CERT": str(pki.client_cert)})
    with pytest.raises(ValueError, match="RIPPLES_TOKEN holds whitespace"):
        ClientSecurity.from_env({"RIPPLES_TOKEN": "two words"})
    # The environment's token: from the file it names first, else its value.
    assert ClientSecurity.from_env({"RIPPLES_TOKEN_FILE": str(pki.token),
                                    "RIPPLES_TOKEN": "other"}).token == TOKEN
    secure = ServerSecurity.build(token_file=str(pki.token), read_token_file=str(pki.read_token),
                                  cert_file=str(pki.server_cert), key_file=str(pki.server_key),
                                  environ={})
    assert TOKEN not in repr(secure) and READ_TOKEN not in repr(secure)
    assert TOKEN not in repr(ClientSecurity(token=TOKEN))
    assert secure.describe() == "TLS, token + read-only token"
    with caplog.at_level(logging.DEBUG):
        ClientSecurity(token=TOKEN).channel("10.0.0.1:1", []).close()
    assert "without TLS" in caplog.text and TOKEN not in caplog.text


def test_the_cli_refuses_bad_client_flags_before_starting_anything(pki: Pki) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ripples.cli", "worker", "run", "--coordinator",
         "127.0.0.1:1", "--tls-client-cert", str(pki.client_cert)],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2
    assert "both a client certificate and its key" in done.stderr


# ---------------------------------------------------------------------------- a whole run
@pytest.mark.slow
def test_a_run_over_tls_with_a_token_from_the_cli(pki: Pki, tmp_path: Path) -> None:
    """`ripples coordinator serve` with TLS and a token; two `ripples worker run` with the
    CA and the token file complete the run; a worker without the token is refused at
    once with the reason, and the run never sees it."""
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "ripples.cli", "coordinator", "serve", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", "--workers", "2", "--task", "digits",
         "--iterations", "150", "--exit-when-done", "--tls-cert", str(pki.server_cert),
         "--tls-key", str(pki.server_key), "--token-file", str(pki.token)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    workers: list[subprocess.Popen[str]] = []
    try:
        assert coordinator.stdout is not None
        first = coordinator.stdout.readline()
        assert "listening on" in first, first
        address = first.split("listening on ")[1].split()[0].replace("0.0.0.0", "127.0.0.1")
        intruder = subprocess.run(
            [sys.executable, "-m", "ripples.cli", "worker", "run", "--coordinator", address,
             "--tls-ca", str(pki.ca), "--metrics-port", "-1"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert intruder.returncode != 0
        assert "requires a token" in intruder.stdout + intruder.stderr
        workers = [subprocess.Popen(
            [sys.executable, "-m", "ripples.cli", "worker", "run", "--coordinator", address,
             "--host", f"node{r}", "--metrics-port", "-1", "--tls-ca", str(pki.ca),
             "--token-file", str(pki.token)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
            for r in range(2)]
        outputs = finish(workers, 180)
        assert all(p.returncode == 0 for p in workers), "\n".join(outputs)[-4000:]
        rest, _ = coordinator.communicate(timeout=60)
        assert coordinator.returncode == 0, rest[-3000:]
        log = first + rest + "\n".join(outputs)
        assert "TLS, token" in log
        assert TOKEN not in log and TOKEN not in intruder.stdout + intruder.stderr
    finally:
        for p in [*workers, coordinator]:
            if p.poll() is None:
                p.kill()


# ---------------------------------------------------------------------------- HTTP
def _get(url: str, token: str = "") -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}
                                     if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode(), dict(answer.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def test_the_coordinators_metrics_and_discovery_need_a_token(
        secured: CoordinatorServer) -> None:
    base = f"http://127.0.0.1:{secured.metrics_port}"
    for path in ("/metrics", "/sd"):
        code, body, headers = _get(base + path)
        assert code == 401 and "requires the run's token" in body
        assert headers["www-authenticate"].startswith("Bearer")
        assert _get(base + path, "wrong")[0] == 401
        assert _get(base + path, TOKEN)[0] == 200
        assert _get(base + path, READ_TOKEN)[0] == 200  # Prometheus may hold the read one
    assert _get(base + "/healthz")[0] == 200  # liveness probes carry no token
    assert "ripples_coordinator" in _get(base + "/metrics", TOKEN)[1]


def test_a_workers_metrics_endpoint_needs_the_runs_token() -> None:
    metrics = WorkerMetrics()
    port = metrics.serve("127.0.0.1", 0, tokens=(TOKEN,))
    try:
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 401
        assert _get(f"http://127.0.0.1:{port}/metrics", TOKEN)[0] == 200
    finally:
        metrics.close()
    open_metrics = WorkerMetrics()
    port = open_metrics.serve("127.0.0.1", 0)
    try:
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200  # no token: open
    finally:
        open_metrics.close()
