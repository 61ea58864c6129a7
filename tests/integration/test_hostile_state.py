"""Hostile and clumsy handling of the state dir: a second coordinator on the
same dir, a history or run state emptied or deleted, a full disk under Register, a host
name too long for a file name in PushLogs. Each case ends in a clear refusal that
changes nothing stored, or is survived with nothing lost. Real `ripples coordinator
serve` processes where the case is the process's start; a real in-process coordinator on
loopback where it is an RPC."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.rpc import CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import REPO, free_port

START_SECONDS = 120  # a coordinator's start imports torch: slow on two busy cores


def _serve(state: Path, *extra: str) -> subprocess.Popen[str]:
    """`ripples coordinator serve` on loopback with no run, on `state`."""
    return subprocess.Popen(
        [sys.executable, "-m", "ripples.cli", "coordinator", "serve", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", "--store-port", str(free_port()),
         "--state-dir", str(state), "--quiet", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _address(proc: subprocess.Popen[str]) -> str:
    """The address a started `coordinator serve` prints on its first line."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line + (proc.stderr.read() if proc.stderr else "")
    return line.split("listening on ")[1].split()[0]


def _refused(proc: subprocess.Popen[str]) -> str:
    """The one-line error of a `coordinator serve` that must refuse to start."""
    _, err = proc.communicate(timeout=START_SECONDS)
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    return err.strip()


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (but the lock) and its bytes: what a refusal leaves."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != "lock"}


@contextlib.contextmanager
def _coordinator(state: Path, workers: int = 3) -> Iterator[CoordinatorServer]:
    """A real coordinator in this process, on `state`, with one run of `workers`."""
    server = CoordinatorServer(ServerConfig(
        host="127.0.0.1", port=0, state_dir=str(state),
        run=RunSettings.build(num_workers=workers, task="digits"))).start()
    try:
        yield server
    finally:
        server.stop()


def _run_with_two_workers(state: Path) -> str:
    """A state dir whose active run has registered workers 0 and 1; its run id."""
    with _coordinator(state) as server:
        client = CoordinatorClient(server.address)
        assert [client.register(f"node{i}", 0, "cpu", 1).worker_id for i in range(2)] == [0, 1]
        client.close()
        assert server.queue is not None and server.queue.active is not None
        return server.queue.active.info.run_id


def test_a_second_coordinator_is_refused_naming_the_first_and_a_killed_ones_successor_starts(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = _serve(state)  # a first start on a new dir
    try:
        address = _address(first)
        second = _serve(state)
        message = _refused(second)
        assert f"the state dir {state} is in use by another coordinator (pid {first.pid}" in \
            message and f"serving {address}" in message, message
        client = CoordinatorClient(address, rpc_timeout_seconds=10)
        assert client.list_runs().runs == []  # the first one still answers
        client.close()
        first.send_signal(signal.SIGKILL)  # the kernel drops a dead holder's lock
        first.wait(30)
        third = _serve(state)
        try:
            _address(third)
        finally:
            third.send_signal(signal.SIGTERM)
            third.communicate(timeout=60)
    finally:
        first.kill()
        first.communicate(timeout=30)


def test_an_emptied_or_missing_history_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _run_with_two_workers(state)
    history = state / "history.db"
    history.write_bytes(b"")  # emptied: run ids and the worker-id counter would reset
    for side in state.glob("history.db-*"):
        side.unlink()
    before = _files(state)
    message = _refused(_serve(state))
    assert f"the run history {history} is empty (0 bytes)" in message, message
    assert "restore it from a backup, or move the state dir aside" in message, message
    assert _files(state) == before

    history.unlink()  # deleted, while the run dir remains
    before = _files(state)
    message = _refused(_serve(state))
    assert "has lost its run history: history.db is missing, yet 1 run dir under runs/ " \
        "remain" in message, message
    assert _files(state) == before


def test_an_active_runs_emptied_state_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    state = tmp_path / "state"
    run_id = _run_with_two_workers(state)
    database = state / "runs" / run_id / "coordinator.db"
    database.write_bytes(b"")  # the run would restart and forget workers 0 and 1
    for side in database.parent.glob("coordinator.db-*"):
        side.unlink()
    before = _files(state)
    message = _refused(_serve(state))
    assert f"the active run {run_id} has lost its state: {database} is empty (0 bytes)" in \
        message and "restore it from a backup" in message, message
    assert _files(state) == before


def test_a_new_dir_and_a_restarted_dir_start(tmp_path: Path) -> None:
    """The checks refuse nothing a coordinator left as it should: a restart resumes the
    run with its workers, and the next worker id goes on."""
    state = tmp_path / "state"
    _run_with_two_workers(state)
    with _coordinator(state) as server:
        client = CoordinatorClient(server.address)
        assert [w.worker_id for w in client.run_status().workers] == [0, 1]
        assert client.register("node2", 0, "cpu", 1).worker_id == 2
        client.close()


@contextlib.contextmanager
def _small_filesystem(path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at `path` (root only), unmounted after."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> Path:
    """A file that takes every free byte of `directory`'s filesystem."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    return filler


def test_a_registration_or_a_run_the_full_disk_cannot_store_is_refused_and_forgotten(
        tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem to fill needs root")
    with _small_filesystem(tmp_path / "disk") as disk, _coordinator(disk / "state") as server:
        client = CoordinatorClient(server.address, rpc_timeout_seconds=10)
        assert client.register("node0", 0, "cpu", 1).worker_id == 0
        filler = _fill(disk)
        with pytest.raises(CoordinatorCallError) as refused:
            client.register("node1", 0, "cpu", 1)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the disk of the coordinator's state dir is full" in str(refused.value)
        assert str(disk) not in str(refused.value)  # no server path for a client
        assert [w.worker_id for w in client.run_status().workers] == [0]  # not registered
        runs = [r.run_id for r in client.list_runs().runs]
        with pytest.raises(CoordinatorCallError) as refused:  # nor is a submission stored
            client.submit_run(json.dumps({"task": "digits", "num_workers": 2, "iterations": 5}))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the run was not stored" in str(refused.value)
        assert str(disk) not in str(refused.value)
        assert [r.run_id for r in client.list_runs().runs] == runs
        filler.unlink()  # the operator frees space: the same worker registers, id 1
        assert client.register("node1", 0, "cpu", 1).worker_id == 1
        assert [w.worker_id for w in client.run_status().workers] == [0, 1]
        client.close()


def test_a_host_name_too_long_for_a_file_name_is_kept_under_a_bounded_name(
        tmp_path: Path) -> None:
    host = "h" * 253  # DNS's longest name: with "__0.log" over a file name's 255 bytes
    with _coordinator(tmp_path / "state") as server:
        assert server.queue is not None and server.queue.active is not None
        run_id = server.queue.active.info.run_id
        client = CoordinatorClient(server.address)
        client.push_logs(pb.LogBatch(run_id=run_id, worker=f"{host}/0", lines=["hello"]))
        digest = hashlib.sha256(f"{host}/0".encode()).hexdigest()[:16]
        shown = f"{host[:168]}~{digest}/0"
        batches = list(client.logs(run_id, worker=f"{host}/0"))
        assert [(b.worker, list(b.lines)) for b in batches] == [(shown, ["hello"])]
        for bad in (f"{host}x/0", "../etc/0", "a/b/0"):  # a refusal is INVALID_ARGUMENT
            with pytest.raises(CoordinatorCallError) as refused:
                client.push_logs(pb.LogBatch(run_id=run_id, worker=bad, lines=["x"]))
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert str(tmp_path) not in str(refused.value)
        client.close()
        names = [p.name for p in (tmp_path / "state" / "runs" / run_id / "logs").iterdir()]
        assert names == [f"{host[:168]}~{digest}__0.log"]
