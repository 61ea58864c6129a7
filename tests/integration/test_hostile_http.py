"""Hostile and clumsy input at the network edges: HTTP clients that connect
and say nothing, unauthenticated calls with huge messages, clients whose TLS settings
differ from the coordinator's, and TLS or token files that are the wrong thing. Each
case against a real coordinator (a `ripples coordinator serve` process where the
process's limits or start-up matter), dashboard and worker metrics endpoint on
loopback: a clear refusal or a survived fault, and nothing changed."""

from __future__ import annotations

import os
import resource
import select
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ripples.client_security import ClientSecurity
from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.http_server import HEAD_TIMEOUT_SECONDS, MAX_CONNECTIONS
from ripples.rpc import CoordinatorCallError, coordinator_channel
from ripples.server_security import ServerSecurity
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc
from ripples.worker.client import CoordinatorClient
from ripples.worker.metrics import WorkerMetrics
from tests.integration.helpers import REPO, wait_for
from tests.pki import TOKEN, Pki, make_pki

OPEN_FILES = 256
"""The coordinator's and the dashboard's open-files limit (soft and hard) here: the
flood below opens more connections than that to each."""
IDLE_CONNECTIONS = 300
CAP = MAX_CONNECTIONS
"""The most connections any endpoint holds (MAX_CONNECTIONS; under OPEN_FILES: 32)."""
LOG_BOUND = 20_000
"""Bytes a flooded process may log (its start lines); before the connection cap, a
flood wrote ~30 MB of 'Too many open files' tracebacks in 8 s."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


@dataclass
class Served:
    process: subprocess.Popen[str]
    first_line: str
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def _serve(args: list[str], log: Path, env: dict[str, str] | None = None) -> Served:
    """A `ripples ...` server process under OPEN_FILES; its first stdout line (the
    address), its stderr (the log) in `log`."""
    with log.open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "ripples.cli", *args], stdout=subprocess.PIPE, stderr=err,
            text=True, cwd=REPO, preexec_fn=_limited, env={**os.environ, **(env or {})})
    assert process.stdout is not None
    first = process.stdout.readline()
    assert first, f"{args[0]} did not start: {log.read_text()[-3000:]}"
    return Served(process, first, log)


@pytest.fixture(scope="module")
def coordinator(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`ripples coordinator serve` with a token and a run of two workers waiting."""
    log = tmp_path_factory.mktemp("coordinator") / "stderr.log"
    served = _serve(["coordinator", "serve", "--host", "127.0.0.1", "--port", "0",
                     "--metrics-port", "0", "--token-file", str(pki.token), "--workers", "2",
                     "--task", "digits"], log)
    try:
        yield served
    finally:
        served.stop()


def _grpc_address(served: Served) -> str:
    return served.first_line.split("listening on ")[1].split()[0]


def _http_port(url_line: str) -> int:
    return int(url_line.split("http://")[1].split("/")[0].rsplit(":", 1)[1])


def _healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _closed_by_server(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1) == b""
    except OSError:  # reset: dropped at accept
        return True


# ---------------------------------------------------------------------------- HTTP floods
def test_idle_http_connections_cannot_take_the_grpc_service_down(
        coordinator: Served, pki: Pki, tmp_path: Path) -> None:
    """More idle connections than the process's open-files limit, to the coordinator's
    metrics port, a dashboard's port and a worker's metrics port: those beyond each
    endpoint's cap are closed at once, the rest once their request head is overdue;
    meanwhile the gRPC service answers health checks, ListRuns and a Register, the
    endpoints answer again, and the logs stay small."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this test's own sockets
    address = _grpc_address(coordinator)
    dashboard = _serve(["dashboard", "serve", "--coordinator", address, "--port", "0"],
                       tmp_path / "dashboard.log", env={"RIPPLES_TOKEN_FILE": str(pki.token)})
    worker_metrics = WorkerMetrics()
    ports = {"coordinator": _http_port(coordinator.first_line),
             "dashboard": _http_port(dashboard.first_line),
             "worker": worker_metrics.serve("127.0.0.1", 0, tokens=(TOKEN,))}
    flood: dict[str, list[socket.socket]] = {name: [] for name in ports}
    try:
        for name, port in ports.items():
            # Past the process's limit (the worker's endpoint, in this one: its cap).
            count = IDLE_CONNECTIONS if name != "worker" else CAP + 50
            socks = flood[name]
            for _ in range(count):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            # Beyond the cap (an eighth of the limit; at most 100): closed at once.
            wait_for(lambda s=socks, c=count: sum(map(_closed_by_server, s)) >= c - CAP,
                     f"the {name} endpoint to close the connections beyond its cap")
            flood[name] = [s for s in socks if not _closed_by_server(s)]
            for s in set(socks) - set(flood[name]):
                s.close()
            assert len(flood[name]) <= CAP
        channel = coordinator_channel(address, ClientSecurity(token=TOKEN))
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        runs = pb_grpc.RunsStub(channel).ListRuns(pb.ListRunsRequest(), timeout=30)
        assert len(runs.runs) == 1
        reply = pb_grpc.WorkerStub(channel).Register(
            pb.RegisterRequest(host="node0", local_rank=0, device="cpu", pid=1), timeout=30)
        assert reply.worker_id == 0
        # The idle ones within the cap are closed once their head is overdue.
        for name, port in ports.items():
            wait_for(lambda p=port: _healthz(p), f"the {name} endpoint to answer again",
                     timeout=HEAD_TIMEOUT_SECONDS + 60)
        assert coordinator.process.poll() is None and dashboard.process.poll() is None
    finally:
        for socks in flood.values():
            for s in socks:
                s.close()
        worker_metrics.close()
        dashboard.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for served in (coordinator, dashboard):
        size = served.log.stat().st_size
        assert size < LOG_BOUND, served.log.read_text()[-3000:]


# ---------------------------------------------------------------------------- big messages
def _peak_memory_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc: Linux only")


def test_unauthenticated_huge_messages_are_refused_unread(coordinator: Served) -> None:
    """16 concurrent unauthenticated SubmitRun calls of 15 MiB each: every one refused
    UNAUTHENTICATED, no run added, and the coordinator's peak memory grows by far less
    than the 240 MiB sent (it grew by ~400 MB when each request was read and parsed
    before the token check)."""
    address = _grpc_address(coordinator)
    before = _peak_memory_kib(coordinator.process.pid)
    payload = pb.SubmitRunRequest(options_json="x" * (15 << 20)).SerializeToString()
    codes: list[grpc.StatusCode] = []

    def submit() -> None:
        with grpc.insecure_channel(address, options=[
                ("grpc.max_send_message_length", 32 << 20)]) as channel:
            call = channel.unary_unary("/ripples.v1.Runs/SubmitRun")
            try:
                call(payload, timeout=60)
            except grpc.RpcError as err:
                codes.append(err.code())

    threads = [threading.Thread(target=submit) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 16
    grown_kib = _peak_memory_kib(coordinator.process.pid) - before
    assert grown_kib < 100 * 1024, f"the coordinator's peak memory grew by {grown_kib} KiB"
    channel = coordinator_channel(address, ClientSecurity(token=TOKEN))
    assert len(pb_grpc.RunsStub(channel).ListRuns(pb.ListRunsRequest(), timeout=30).runs) == 1


# ---------------------------------------------------------------------------- TLS settings
@pytest.fixture(scope="module")
def tls_and_plaintext(pki: Pki) -> Iterator[tuple[str, str]]:
    """A coordinator serving TLS and one serving plaintext: their addresses."""
    servers = [CoordinatorServer(ServerConfig(
        host="127.0.0.1", port=0, run=RunSettings.build(num_workers=2), security=security))
        for security in (ServerSecurity(cert_file=str(pki.server_cert),
                                        key_file=str(pki.server_key)), ServerSecurity())]
    for server in servers:
        server.start()
    try:
        yield tuple(f"127.0.0.1:{s.port}" for s in servers)  # type: ignore[misc]
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize(("case", "expected"), [
    ("plaintext to TLS", "speaks TLS and this client does not: give --tls-ca"),
    ("TLS to plaintext", "speaks plaintext, not TLS: drop --tls-ca"),
    ("another CA", "certificate check failed: unable to get local issuer certificate; "
                   "check --tls-ca"),
])
def test_a_client_with_the_wrong_tls_settings_is_told_which(
        tls_and_plaintext: tuple[str, str], pki: Pki, case: str, expected: str) -> None:
    """What `ripples status`, a worker or an agent says (it waits for the channel
    first, then calls): the setting to fix, not "unreachable... is it running?"."""
    tls, plaintext = tls_and_plaintext
    target, security = {
        "plaintext to TLS": (tls, ClientSecurity()),
        "TLS to plaintext": (plaintext, ClientSecurity(ca_file=str(pki.ca))),
        "another CA": (tls, ClientSecurity(ca_file=str(pki.other_ca))),
    }[case]
    client = CoordinatorClient(target, rpc_timeout_seconds=10, security=security)
    with pytest.raises(CoordinatorCallError, match=expected) as waited:
        client.wait_until_reachable(60)
    assert "is it running" not in str(waited.value)
    with pytest.raises(CoordinatorCallError, match=expected):
        client.run_status()


# ---------------------------------------------------------------------------- files
def _serve_refused(*flags: str) -> str:
    """`ripples coordinator serve` with `flags`: it must refuse at once (exit 2); its
    stderr."""
    done = subprocess.run([sys.executable, "-m", "ripples.cli", "coordinator", "serve",
                           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                           *flags], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def test_a_key_that_is_not_the_certificates_is_named_at_start(pki: Pki) -> None:
    said = _serve_refused("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_cert))
    assert f"--tls-key {pki.server_cert} holds no PEM private key (it holds a certificate)" in said
    assert "port in use" not in said
    with pytest.raises(ValueError, match=f"--tls-key {pki.client_key} is not the key of the "
                                         f"certificate --tls-cert {pki.server_cert}"):
        ServerSecurity.build(cert_file=str(pki.server_cert), key_file=str(pki.client_key),
                             environ={})
    with pytest.raises(ValueError, match=f"--tls-ca {pki.client_key} holds no PEM certificate"):
        ClientSecurity(ca_file=str(pki.client_key)).validate()


def test_token_and_tls_files_that_are_pipes_devices_or_huge_are_refused(
        pki: Pki, tmp_path: Path) -> None:
    """A FIFO as the token file hung the start-up (reading waits for a writer); a device
    or a huge file would be read without end."""
    fifo = tmp_path / "token.fifo"
    os.mkfifo(fifo)
    said = _serve_refused("--token-file", str(fifo))
    assert f"the token file {fifo} is a named pipe (FIFO), not a regular file" in said
    huge = tmp_path / "huge.pem"
    huge.write_bytes(b"x" * (2 << 20))
    for build, message in [
            (dict(token_file="/dev/zero"), "token file /dev/zero is a character device"),
            (dict(token_file=str(tmp_path)), f"token file {tmp_path} is a directory"),
            (dict(token_file=str(huge)), f"token file {huge} is over 4,096 bytes"),
            (dict(cert_file=str(huge), key_file=str(pki.server_key)),
             f"certificate {huge} is over 1,048,576 bytes"),
            (dict(cert_file=str(pki.server_cert), key_file=str(fifo)),
             f"key {fifo} is a named pipe")]:
        with pytest.raises(ValueError, match=message):
            ServerSecurity.build(environ={}, **build)  # type: ignore[arg-type]
