"""Bad input and failing workers: a clear message and a non-zero exit, never a hang."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from helpers import REPO, ripples_cli, running_coordinator, start_worker

from ripples.cli import main as cli
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--protocol", "gossip"], "unknown protocol 'gossip'"),
        (["--task", "no-such-task"], "unknown task"),
        (["--task", "no_such_module:fn"], "no_such_module"),
        (["--workers", "1"], "at least 2"),
        (["--slowdown", "fast"], "malformed --slowdown"),
        (["--slowdown", "9:5"], "rank 9 does not exist"),
        (["--slowdown", "0:0.5"], "at least 1"),
        (["--group-size", "1"], "group_size"),
        (["--protocol", "hop", "--hop-mode", "lazy"], "unknown hop mode 'lazy'"),
        (["--protocol", "hop", "--max-jump", "2"], "needs backup workers or bounded staleness"),
        (["--protocol", "hop", "--hop-mode", "backup", "--max-jump", "9"], "may not exceed"),
        (["--protocol", "lpp-sgd", "--updaters", "0"], "updaters must be in 1..64"),
        (["--protocol", "lap-sgd", "--lpp-averaging", "gossip"], "unknown lpp_averaging"),
        (["--protocol", "lpp-sgd", "--epochs", "0", "--target-loss", "1"],
         "needs a budget of iterations or epochs"),
        (["--link-mbit", "fast"], "the rate must be a number of Mbit/s"),
        (["--link-mbit", "0"], "the rate must be above 0"),
        (["--link-mbit", "7:10"], "'7' is not a host of this run (0 to 3)"),
    ],
)
def test_run_rejects_bad_input(args: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: the same entry point as the console script, without ~3 s of
    # interpreter start-up per case (the test below runs one case as its own process).
    try:
        code = cli.main(["run", "--workers", "4", *args])
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err


def test_run_exits_2_naming_bad_input_as_its_own_process() -> None:
    proc = ripples_cli("run", "--workers", "4", "--protocol", "gossip", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "unknown protocol 'gossip'" in proc.stderr


def test_serve_reports_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = ripples_cli("coordinator", "serve", "--host", "127.0.0.1", "--port", str(port),
                           timeout=60)
    assert proc.returncode == 2
    assert "port in use" in proc.stderr


def test_run_reports_a_dashboard_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = ripples_cli("run", "--workers", "2", "--dashboard", "--dashboard-port",
                           str(port), "--output", str(tmp_path / "run"), "--quiet",
                           timeout=120)
    assert proc.returncode == 1
    assert f"cannot listen for the dashboard on 127.0.0.1:{port}" in proc.stderr
    assert "--dashboard-port" in proc.stderr


def test_dashboard_rejects_a_malformed_coordinator_address() -> None:
    proc = ripples_cli("dashboard", "serve", "--coordinator", "nohost", timeout=60)
    assert proc.returncode == 2
    assert "ripples dashboard serve: error:" in proc.stderr


def test_worker_reports_an_unreachable_coordinator() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    proc = ripples_cli("worker", "run", "--coordinator", f"127.0.0.1:{port}",
                       "--connect-timeout-seconds", "2", timeout=60)
    assert proc.returncode == 1
    assert "unreachable" in proc.stderr
    assert time.monotonic() - t0 < 30


def test_worker_rejects_a_malformed_address() -> None:
    proc = ripples_cli("worker", "run", "--coordinator", "localhost", timeout=60)
    assert proc.returncode == 2
    assert "HOST:PORT" in proc.stderr


def _crash_env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO / "tests" / "integration"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path}


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["ripples-smart", "allreduce", "hop", "lpp-sgd"])
def test_a_crashed_worker_is_named_and_nobody_hangs(protocol: str) -> None:
    with running_coordinator(num_workers=3, protocol=protocol, iterations=200,
                             collective_timeout_seconds=20, group_size=2) as server:
        good = [start_worker(server.address, "--host", "node0", "--local-rank", str(i), "--quiet")
                for i in range(2)]
        bad = start_worker(server.address, "--host", "node0", "--local-rank", "2",
                           "--task", "crashing_task:crash_after_a_while", env=_crash_env())
        try:
            bad_out, _ = bad.communicate(timeout=180)
            outs = [p.communicate(timeout=180)[0] for p in good]
        finally:
            for p in [*good, bad]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert bad.returncode == 1, bad_out[-3000:]
        assert "simulated device failure" in bad_out
        status = CoordinatorClient(server.address).run_status()
        failed = [w for w in status.workers if w.state == pb.WORKER_STATE_FAILED]
        assert any("simulated device failure" in w.error for w in failed)
        if protocol in ("allreduce", "hop", "lpp-sgd"):
            # Lock-step, hop and lpp-sgd peers cannot continue (they would wait for its
            # updates; lpp-sgd's crash is in an updater process of the worker):
            # the run stops and names the failed worker.
            assert status.stopped and "failed" in status.stop_reason
            assert all(p.returncode in (0, 1) for p in good), outs
        else:
            # Group protocols carry on without it and finish the budget.
            assert [p.returncode for p in good] == [0, 0], outs
            assert status.stop_reason.startswith("iteration budget")


@pytest.mark.slow
def test_sigterm_makes_a_worker_leave_cleanly_and_the_others_finish() -> None:
    with running_coordinator(num_workers=3, protocol="ripples-smart", iterations=100_000,
                             group_size=2) as server:
        procs = [start_worker(server.address, "--host", "node0", "--local-rank", str(i),
                              "--quiet") for i in range(3)]
        client = CoordinatorClient(server.address)
        try:
            deadline = time.monotonic() + 120
            while not all(w.iteration >= 5 for w in client.run_status().workers
                          ) or len(client.run_status().workers) < 3:
                assert time.monotonic() < deadline, "workers never got going"
                assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
                time.sleep(0.2)
            leaver = next(w for w in client.run_status().workers if w.local_rank == 0)
            procs[0].send_signal(signal.SIGTERM)
            out0, _ = procs[0].communicate(timeout=60)
            assert procs[0].returncode == 0, out0
            status = client.run_status()
            gone = next(w for w in status.workers if w.worker_id == leaver.worker_id)
            assert gone.state == pb.WORKER_STATE_LEFT and not gone.error
            # The other two keep training with each other, then are stopped on request.
            before = {w.worker_id: w.iteration for w in status.workers}
            time.sleep(2.0)
            after = client.run_status()
            assert all(w.iteration > before[w.worker_id] for w in after.workers
                       if w.worker_id != leaver.worker_id)
            client.stop_run("test over")
            outs = [p.communicate(timeout=60)[0] for p in procs[1:]]
            assert [p.returncode for p in procs[1:]] == [0, 0], outs
        finally:
            client.close()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _updater_pids(worker_pid: int) -> list[int]:
    """The spawned children of a worker process (its updaters; not the resource tracker)."""
    try:
        children = open(f"/proc/{worker_pid}/task/{worker_pid}/children").read().split()
    except OSError:
        return []
    pids = []
    for child in map(int, children):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.append(child)
        except OSError:
            pass
    return pids


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's new parent may not reap it at once)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_updaters_stop_when_their_worker_is_killed() -> None:
    """lpp-sgd: a worker killed with SIGKILL cannot stop its updater processes; they see
    their parent gone and exit instead of training on (or waiting) forever."""
    with running_coordinator(num_workers=2, protocol="lpp-sgd", iterations=1_000_000,
                             collective_timeout_seconds=10) as server:
        workers = [start_worker(server.address, "--host", "node0", "--local-rank", str(i),
                                "--quiet") for i in range(2)]
        updaters: list[int] = []
        try:
            client = CoordinatorClient(server.address)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                updaters = _updater_pids(workers[0].pid)
                status = client.run_status()
                if len(updaters) == 2 and any(w.progress.iteration > 0 for w in status.workers):
                    break
                time.sleep(0.2)
            assert len(updaters) == 2, "the worker never started its two updaters"
            assert any(w.progress.iteration > 0 for w in client.run_status().workers)
            os.kill(workers[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while any(_running(pid) for pid in updaters) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(_running(pid) for pid in updaters), "orphaned updaters kept running"
        finally:
            for p in workers:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for pid in updaters:
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
