"""Hostile topology input against a real coordinator: a full-token holder
cannot make the coordinator open a file (its environment, its token) through a run's
topology, nor freeze its event loop with a FIFO or a huge run. A real coordinator (TLS
and a token, in this process) on loopback; raw gRPC and the real CLI."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ripples.client_security import ClientSecurity
from ripples.coordinator.config import MAX_WORKERS
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.rpc import CoordinatorCallError, coordinator_channel
from ripples.server_security import RUNS_SERVICE, ServerSecurity
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import ripples_cli, wait_for
from tests.pki import TOKEN, Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def service(pki: Pki, tmp_path: Path) -> Iterator[CoordinatorServer]:
    security = ServerSecurity(token=TOKEN, cert_file=str(pki.server_cert),
                              key_file=str(pki.server_key))
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                            state_dir=str(tmp_path / "state"),
                                            security=security))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _address(server: CoordinatorServer) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
def client(service: CoordinatorServer, pki: Pki) -> Iterator[CoordinatorClient]:
    client = CoordinatorClient(_address(service), rpc_timeout_seconds=60.0,
                               security=ClientSecurity(token=TOKEN, ca_file=str(pki.ca)))
    try:
        yield client
    finally:
        client.close()


def _options(**changes: object) -> str:
    options: dict[str, object] = {"protocol": "a2cid2", "num_workers": 4, "task": "digits",
                                  "iterations": 10}
    options.update(changes)
    return json.dumps(options)


def _cli(service: CoordinatorServer, pki: Pki, *args: str):  # type: ignore[no-untyped-def]
    return ripples_cli("submit", "--coordinator", _address(service), "--token-file",
                       str(pki.token), "--tls-ca", str(pki.ca), "--protocol", "a2cid2",
                       "--workers", "4", "--task", "digits", "--iterations", "10", *args,
                       timeout=120)


def test_a_raw_submission_naming_a_coordinator_file_is_refused_and_reveals_nothing(
        client: CoordinatorClient, pki: Pki) -> None:
    """Before: the coordinator read the file and its first line came back in the error
    (the coordinator's environment; its token). Now it opens nothing a client names."""
    environment = [entry.partition("=")[2] for entry in
                   Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")]
    for path in ("/proc/self/environ", str(pki.token)):
        with pytest.raises(CoordinatorCallError) as refused:
            client.submit_run(_options(topology="file", topology_file=path))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        message = str(refused.value)
        assert "send the edges as topology_edges" in message
        assert TOKEN not in message
        assert not [v for v in environment if len(v) >= 6 and v in message]
    assert not client.list_runs().runs


def test_the_cli_refuses_a_fifo_at_once_and_sends_a_files_edges(
        service: CoordinatorServer, client: CoordinatorClient, pki: Pki,
        tmp_path: Path) -> None:
    """A FIFO (which froze the coordinator's loop when it opened it) is refused by the
    CLI before it calls; a file topology is read by the CLI and its edges are the run's
    graph once its workers register."""
    fifo = tmp_path / "edges.fifo"
    os.mkfifo(fifo)
    done = _cli(service, pki, "--topology", "file", "--topology-file", str(fifo))
    assert done.returncode == 2, done.stderr
    assert "not a regular file" in done.stderr and "Traceback" not in done.stderr
    assert not client.list_runs().runs

    edges = tmp_path / "edges.txt"
    edges.write_text("# a ring of 4 and a chord\n0 1\n1 2\n2 3\n3 0\n0 2\n")
    done = _cli(service, pki, "--topology", "file", "--topology-file", str(edges))
    assert done.returncode == 0, done.stderr
    (run,) = client.list_runs().runs
    assert run.state == pb.RUN_STATE_RUNNING
    for local_rank in range(4):  # the run's members: its graph is built from the edges
        client.register("host-a", local_rank, "cpu", os.getpid())
    wait_for(lambda: client.run_status(run.run_id).topology_edges, "the run's graph")
    status = client.run_status(run.run_id)
    worker_of = {w.rank: w.worker_id for w in status.workers}
    expected = {tuple(sorted((worker_of[i], worker_of[j])))
                for i, j in [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)]}
    assert {(e.a, e.b) for e in status.topology_edges} == expected
    client.stop_run("test over", run.run_id)


def test_a_huge_submission_is_checked_off_the_loop_and_a_too_large_one_refused(
        service: CoordinatorServer, client: CoordinatorClient, pki: Pki) -> None:
    """Two million workers (a ring of them blocked the loop for 12 s) are refused by
    their count; the largest allowed run (its exponential graph takes a second or more to
    build and check) is checked in a worker thread: a ListRuns and a health check sent
    after it on the same connection are answered while it is being checked (its run is
    not stored yet), and then it is accepted."""
    with pytest.raises(CoordinatorCallError, match=f"num_workers must be at most "
                       f"{MAX_WORKERS}") as refused:
        client.submit_run(_options(num_workers=2_000_000, topology="ring"))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not client.list_runs().runs

    channel = coordinator_channel(_address(service),
                                  ClientSecurity(token=TOKEN, ca_file=str(pki.ca)))
    try:
        runs = pb_grpc.RunsStub(channel)
        largest = runs.SubmitRun.future(pb.SubmitRunRequest(
            options_json=_options(num_workers=MAX_WORKERS, min_workers=2,
                                  topology="exponential")), timeout=240)
        meanwhile = runs.ListRuns(pb.ListRunsRequest(), timeout=120)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=RUNS_SERVICE), timeout=120)
        assert not meanwhile.runs  # answered before the check had ended
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        info = largest.result()
    finally:
        channel.close()
    assert info.num_workers == MAX_WORKERS
    assert [r.run_id for r in client.list_runs().runs] == [info.run_id]
    client.stop_run("test over", info.run_id)
