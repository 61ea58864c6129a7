"""The coordinator as a service (docs/service.md): submitted runs queue, one is active,
finished runs stay in the history; host agents run them; `ripples submit / runs /
status / stop / logs`. Real coordinators (in-process and `ripples coordinator serve`),
real agents and worker processes, TLS with certificates made here and a token."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.rpc import CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import (
    REPO,
    UNBOUNDED_ITERATIONS,
    child_pids,
    ripples_cli,
    wait_for,
)
from tests.pki import TOKEN, Pki, make_pki

RIPPLES = [sys.executable, "-m", "ripples.cli"]


def _min_live_iteration(client: CoordinatorClient, run_id: str) -> int:
    """The least iteration among a run's workers still in it (0 before any)."""
    workers = [w for w in client.run_status(run_id).workers
               if w.state not in (pb.WORKER_STATE_EXPIRED, pb.WORKER_STATE_FAILED,
                                  pb.WORKER_STATE_LEFT)]
    return min((w.iteration for w in workers), default=0)


def _options(**changes: object) -> str:
    options: dict[str, object] = {"num_workers": 2, "task": "digits", "iterations": 50}
    options.update(changes)
    return json.dumps(options)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[CoordinatorServer]:
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                            state_dir=str(tmp_path / "state"))).start()
    try:
        yield server
    finally:
        server.stop()


_cli = functools.partial(ripples_cli, timeout=60.0)


# ---------------------------------------------------------------------------- no workers
def test_bad_submissions_are_refused_with_the_reason_and_change_nothing(
        service: CoordinatorServer) -> None:
    client = CoordinatorClient(service.address)
    try:
        for options, command, expected in [
            (_options(protocol="no-such"), [], "unknown protocol"),
            (_options(num_workers=1), [], "num_workers must be at least 2"),
            (_options(task=""), [], "give a task (--task) or a script"),
            (_options(), ["python", "train.py"], "not both"),
            (_options(nonsense=3), [], "unknown run option(s): nonsense"),
            ("[1, 2]", [], "JSON object"),
            (_options(run_id="../../etc"), [], "use 1-64 letters"),
        ]:
            with pytest.raises(CoordinatorCallError, match=expected.replace("(", r"\(")
                               .replace(")", r"\)")) as caught:
                client.submit_run(options, command=command)
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # Workers of several ranks: what they do not run, with the reason.
        script = ["python", "train.py"]
        for options, command, ranks, expected in [
            (_options(), [], 2, "give the script after --"),
            (_options(task="", protocol="adpsgd"), script, 2,
             "adpsgd does not run on workers of several ranks: its pairwise exchanges"),
            (_options(task="", overlap=True), script, 2, "--overlap does not run on workers"),
            (_options(task=""), script, 5000, "ranks_per_worker must be from 1 to 1024"),
        ]:
            with pytest.raises(CoordinatorCallError, match=expected) as caught:
                client.submit_run(options, command=command, ranks_per_worker=ranks)
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert not client.list_runs().runs
        with pytest.raises(CoordinatorCallError, match="no run 'nope'") as missing:
            client.run_status("nope")
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        client.stop_run("x")  # no run is active: nothing to stop (idempotent)
        assert not client.list_runs().runs
    finally:
        client.close()
    # The CLI checks the options before it calls, and says what is wrong.
    done = _cli("submit", "--coordinator", service.address, "--workers", "1")
    assert done.returncode == 2 and "num_workers must be at least 2" in done.stderr
    done = _cli("submit", "--coordinator", service.address, "--ranks-per-worker", "2",
                "--protocol", "allreduce", "--", "python", "train.py")
    assert done.returncode == 2 and "what FSDP2 with a replicate dimension" in done.stderr


def test_with_no_run_active_worker_calls_are_refused_by_what_they_name(
        service: CoordinatorServer) -> None:
    """The Worker service reaches the active run: with none, a worker's call (it names a
    worker id, or opens a group stream) gets NOT_FOUND, as a worker of an ended run does;
    a registration, and a consensus request, FAILED_PRECONDITION. The health check
    answers for every service all the same."""
    client = CoordinatorClient(service.address)
    try:
        for call in (lambda: client.heartbeat(7, pb.Progress()),
                     lambda: client.leave(7, pb.Progress()),
                     lambda: client.checkpoint(7, 0),
                     lambda: client.open_group_stream(7).request(1, 0.2)):
            with pytest.raises(CoordinatorCallError, match="no run is active") as refused:
                call()
            assert refused.value.code == grpc.StatusCode.NOT_FOUND
        for call in (lambda: client.register("h", 0, "cpu", os.getpid()),
                     lambda: client.consensus(5.0, lambda worker, model: None)):
            with pytest.raises(CoordinatorCallError, match="submit one") as refused:
                call()
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        client.close()
    health = _cli("coordinator", "health", "--coordinator", service.address)
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr


def test_runs_queue_one_active_at_a_time_and_stopping_cancels_or_ends_them(
        service: CoordinatorServer, tmp_path: Path) -> None:
    """Two runs: the first is active, the second queued; stopping the queued one cancels
    it, stopping the active one ends it (it had no workers), and the history keeps both
    with their reasons; a worker started for another run is refused."""
    client = CoordinatorClient(service.address)
    try:
        first = client.submit_run(_options(), name="first")
        second = client.submit_run(_options(protocol="allreduce"), name="second")
        assert first.state == pb.RUN_STATE_RUNNING
        assert second.state == pb.RUN_STATE_QUEUED and second.queue_position == 1
        with pytest.raises(CoordinatorCallError, match=f"started for run {second.run_id}"):
            client.register("h", 0, "cpu", os.getpid(), run_id=second.run_id)
        client.stop_run("not needed", second.run_id[:6])  # a unique id prefix will do
        client.stop_run("enough", "first")  # so will a unique name
        deadline = time.monotonic() + 30
        while client.run_status(first.run_id).run.state == pb.RUN_STATE_RUNNING:
            assert time.monotonic() < deadline, "the stopped run never ended"
            time.sleep(0.1)
        runs = {r.name: r for r in client.list_runs().runs}
        assert runs["second"].state == pb.RUN_STATE_CANCELLED
        assert runs["second"].stop_reason == "not needed"
        assert runs["first"].state == pb.RUN_STATE_STOPPED
        assert runs["first"].stop_reason == "enough"
        with pytest.raises(CoordinatorCallError, match="has ended already"):
            client.stop_run("again", first.run_id)
        status = client.run_status(second.run_id)  # a queued run's status: what was asked
        assert status.config.protocol == "allreduce" and status.stopped
    finally:
        client.close()
    shown = _cli("runs", "--coordinator", service.address)
    assert shown.returncode == 0, shown.stderr
    assert "cancelled" in shown.stdout and "stopped" in shown.stdout
    text = _cli("status", "first", "--coordinator", service.address).stdout
    assert f"run {first.run_id} (first): stopped" in text and "stop reason: enough" in text


def test_a_restarted_service_keeps_its_history_and_its_queue(tmp_path: Path) -> None:
    config = ServerConfig(host="127.0.0.1", port=0, run=None, state_dir=str(tmp_path))
    server = CoordinatorServer(config).start()
    client = CoordinatorClient(server.address)
    try:
        active = client.submit_run(_options(), name="active")
        queued = client.submit_run(_options(), name="queued")
    finally:
        client.close()
        server.stop()
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                            state_dir=str(tmp_path))).start()
    client = CoordinatorClient(server.address)
    try:
        runs = {r.run_id: r for r in client.list_runs().runs}
        assert runs[active.run_id].state == pb.RUN_STATE_RUNNING
        assert runs[queued.run_id].state == pb.RUN_STATE_QUEUED
        assert client.run_status().run.run_id == active.run_id
    finally:
        client.close()
        server.stop()


# ---------------------------------------------------------------------------- the whole flow
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _stop(process: subprocess.Popen[str], sig: int = signal.SIGTERM,
          timeout: float = 60.0) -> int:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


@pytest.mark.slow
def test_two_agents_run_two_submitted_runs_back_to_back_with_tls_and_a_token(
        pki: Pki, tmp_path: Path) -> None:
    """The service's acceptance run: one coordinator service (TLS, token, state dir), two host
    agents (node-a, node-b, two slots each) and two runs submitted at once: a built-in
    task and a user's script. They run one after the other on the same agents; `ripples
    runs`, `status` and `logs` show them from the history after their workers are gone;
    a wrong token is refused; SIGTERM drains the agents."""
    secure = ["--tls-ca", str(pki.ca), "--token-file", str(pki.token)]
    coordinator = subprocess.Popen(
        [*RIPPLES, "coordinator", "serve", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--state-dir", str(tmp_path / "state"),
         "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
         "--token-file", str(pki.token), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    agents: list[subprocess.Popen[str]] = []
    try:
        assert coordinator.stdout is not None
        first_line = coordinator.stdout.readline()
        assert "no run yet" in first_line, first_line
        address = first_line.split("listening on ")[1].split()[0]
        where = ["--coordinator", address, *secure]
        for host in ("node-a", "node-b"):
            (tmp_path / host).mkdir()
            with (tmp_path / f"{host}.log").open("w") as log:
                agents.append(subprocess.Popen(
                    [*RIPPLES, "worker", "run", "--agent", "--host", host, "--nproc-per-node",
                     "2", "--metrics-port", "-1", "--output-dir", str(tmp_path / host),
                     "--quiet", *where], stdout=subprocess.DEVNULL, stderr=log, text=True,
                    cwd=REPO))
        task = _cli("submit", *where, "--workers", "4", "--task", "digits", "--iterations",
                    "120", "--name", "task-run", "--json")
        assert task.returncode == 0, task.stderr
        task_run = json.loads(task.stdout)["run_id"]
        script = _cli("submit", *where, "--workers", "4", "--protocol", "allreduce",
                      "--iterations", "60", "--name", "script-run", "--", "python",
                      "examples/ripples_digits.py", "--epochs", "1")
        assert script.returncode == 0, script.stderr
        assert "queued at place 1" in script.stdout
        waited = _cli("submit", *where, "--workers", "4", "--task", "digits", "--iterations",
                      "40", "--name", "waited", "--wait", timeout=300)
        assert waited.returncode == 0, waited.stdout + waited.stderr
        assert "finished" in waited.stdout

        # The agents report each run's model once its processes ended (after its end).
        deadline = time.monotonic() + 60
        while True:
            listing = json.loads(_cli("runs", *where, "--json").stdout)
            runs = {r["name"]: r for r in listing["runs"]}
            if all(r["model_path"] for r in runs.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert [runs[n]["state"] for n in ("task-run", "script-run", "waited")] == [
            "finished"] * 3, runs
        # One after the other, in the order submitted.
        order = sorted(runs.values(), key=lambda r: r["started_at"])
        assert [r["name"] for r in order] == ["task-run", "script-run", "waited"]
        for a, b in zip(order, order[1:], strict=False):
            assert a["ended_at"] <= b["started_at"]
        for r in runs.values():
            host, _, path = r["model_path"].partition(":")
            assert host in ("node-a", "node-b") and Path(path).is_file(), r
        assert {a["host"] for a in listing["agents"]} == {"node-a", "node-b"}

        # The first run's status and logs come from the history.
        status = _cli("status", "task-run", *where)
        assert status.returncode == 0, status.stderr
        text = status.stdout
        assert f"run {task_run} (task-run): finished" in text
        for worker in ("node-a/0", "node-a/1", "node-b/0", "node-b/1"):
            assert worker in text
        assert "iteration budget reached" in text
        logs = _cli("logs", "script-run", *where, "--worker", "node-a/0")  # rank 0 prints
        assert logs.returncode == 0, logs.stderr
        assert "epoch 0: loss" in logs.stdout, logs.stdout
        everyone = _cli("logs", task_run[:8], *where, "--tail", "2")
        assert {line.split("]")[0] + "]" for line in everyone.stdout.splitlines()} == {
            "[node-a/0]", "[node-a/1]", "[node-b/0]", "[node-b/1]"}

        # A wrong token: refused, with the reason, and nothing changes.
        wrong = tmp_path / "wrong-token"
        wrong.write_text("0" * len(TOKEN))
        refused = _cli("runs", "--coordinator", address, "--tls-ca", str(pki.ca),
                       "--token-file", str(wrong))
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        refused = _cli("submit", "--coordinator", address, "--tls-ca", str(pki.ca),
                       "--token-file", str(wrong), "--workers", "2")
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        assert len(json.loads(_cli("runs", *where, "--json").stdout)["runs"]) == 3

        for agent, host in zip(agents, ("node-a", "node-b"), strict=True):
            assert _stop(agent) == 0
            assert "drained" in (tmp_path / f"{host}.log").read_text()
    finally:
        for agent in agents:
            if agent.poll() is None:
                _stop(agent, signal.SIGKILL)
        _stop(coordinator)


# ---------------------------------------------------------------------------- agents' faults
def _worker_pid(agent: subprocess.Popen[str], local_rank: int) -> int | None:
    """The pid of the built-in runner worker `agent` started for `local_rank` (among its
    own children: another test's processes are never looked at)."""
    for child in child_pids(agent.pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if ("--agent" not in words and "run" in words and "--local-rank" in words
                and words[words.index("--local-rank") + 1] == str(local_rank)):
            return child
    return None


def _agent(address: str, host: str, output: Path) -> subprocess.Popen[str]:
    """An agent whose output (its workers' too) goes to OUTPUT.log: a pipe nobody reads
    would fill up and stall them all."""
    output.mkdir(parents=True, exist_ok=True)
    with (output.parent / f"{output.name}.log").open("w") as log:
        return subprocess.Popen(
            [*RIPPLES, "worker", "run", "--agent", "--host", host, "--nproc-per-node", "2",
             "--metrics-port", "-1", "--output-dir", str(output), "--coordinator", address],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, text=True)


def _agent_log(output: Path) -> str:
    return (output.parent / f"{output.name}.log").read_text()


@pytest.mark.slow
def test_agents_restart_a_killed_worker_and_drain_on_sigterm(tmp_path: Path) -> None:
    """An elastic run on two agents: a worker SIGKILLed is started again by its agent and
    takes its rank back; then one agent is SIGTERMed: its workers leave gracefully, it
    exits 0, and the run finishes on the other agent's two workers."""
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                            state_dir=str(tmp_path / "state"))).start()
    client = CoordinatorClient(server.address)
    agents = {h: _agent(server.address, h, tmp_path / h) for h in ("node-a", "node-b")}
    try:
        run = client.submit_run(_options(num_workers=4, iterations=UNBOUNDED_ITERATIONS,
                                         lease_seconds=3.0, heartbeat_interval_seconds=0.5))

        def training() -> bool:
            status = client.run_status(run.run_id)
            return status.started and min(w.iteration for w in status.workers) > 20

        wait_for(training, "training", 120)
        victim = _worker_pid(agents["node-a"], 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:
            workers = client.run_status(run.run_id).workers
            back = [w for w in workers if (w.host, w.local_rank) == ("node-a", 1)
                    and w.state != pb.WORKER_STATE_EXPIRED and w.state != pb.WORKER_STATE_FAILED]
            return len(workers) == 5 and bool(back) and back[0].iteration > 0

        wait_for(replaced, "the replacement training", 120)
        assert _stop(agents["node-b"]) == 0
        assert "drained" in _agent_log(tmp_path / "node-b")
        # The run goes on with node-a's two workers: then it is stopped.
        drained_at = _min_live_iteration(client, run.run_id)
        wait_for(lambda: _min_live_iteration(client, run.run_id) > drained_at + 10,
                 "node-a's workers to train on", 120)
        client.stop_run("trained on after the drain", run.run_id)
        wait_for(lambda: client.run_status(run.run_id).run.state != pb.RUN_STATE_RUNNING,
                 "the run's end", 180)
        status = client.run_status(run.run_id)
        assert status.run.state == pb.RUN_STATE_STOPPED, status.run.stop_reason
        assert server.service is not None  # the run's records, all five of them
        ended = {(w.host, w.local_rank, w.state.value) for w in
                 server.service.core.workers.values()}
        assert {("node-b", 0, "left"), ("node-b", 1, "left")} <= ended  # not expired
        assert ("node-a", 1, "expired") in ended  # the killed one; its replacement left
        # The agent reports the model once its processes ended (after the run's end).
        wait_for(lambda: client.run_status(run.run_id).run.model_path, "the model's path", 60)
        assert client.run_status(run.run_id).run.model_path.startswith("node-a:")
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                _stop(agent, signal.SIGKILL)
        client.close()
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("command", "code", "said"), [
    (["python", "-c", "import sys; print('giving up'); sys.exit(3)"], 3, "giving up"),
    (["/no/such/train.sh"], 127, "cannot start '/no/such/train.sh' on node-a"),
])
def test_a_run_whose_processes_all_fail_is_failed_with_their_exit_codes(
        tmp_path: Path, command: list[str], code: int, said: str) -> None:
    """The agent starts them again up to max_restarts; then the run fails, naming each
    process's exit code, and its logs say why (a command missing on the host too)."""
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None)).start()
    client = CoordinatorClient(server.address)
    agent = _agent(server.address, "node-a", tmp_path / "a")
    try:
        run = client.submit_run(json.dumps({"num_workers": 2, "task": "", "max_restarts": 1,
                                            "protocol": "ripples-random"}), command=command)
        wait_for(lambda: client.run_status(run.run_id).run.state != pb.RUN_STATE_RUNNING,
                 "the run's end", 120)
        info = client.run_status(run.run_id).run
        assert info.state == pb.RUN_STATE_FAILED
        assert f"node-a/0 exit code {code}" in info.stop_reason
        assert "ripples logs" in info.stop_reason
        lines = [line for batch in client.logs(run.run_id, worker="node-a/1")
                 for line in batch.lines]
        assert lines.count(said) == 2 or any(said in line for line in lines), lines
        assert agent.poll() is None  # the agent serves on
    finally:
        _stop(agent)
        client.close()
        server.stop()


@pytest.mark.slow
def test_a_coordinator_killed_and_restarted_keeps_its_runs_agents_and_workers(
        tmp_path: Path) -> None:
    """SIGKILL the service mid-run and start it again on the same port and state dir: the
    agent and its workers ride over the outage (no process restarts, no replacement), the
    queued run is still queued, and both runs finish."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    command = [*RIPPLES, "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--metrics-port", "0", "--state-dir", str(tmp_path / "state"), "--quiet"]
    coordinator = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)
    agent = _agent(address, "node-a", tmp_path / "a")
    client = CoordinatorClient(address)
    try:
        client.wait_until_reachable(60)
        first = client.submit_run(_options(iterations=UNBOUNDED_ITERATIONS), name="first")
        client.submit_run(_options(iterations=50), name="second")

        def training() -> bool:
            status = client.run_status(first.run_id)
            return status.started and min(w.iteration for w in status.workers) > 20

        wait_for(training, "training", 120)
        coordinator.kill()
        coordinator.wait()
        time.sleep(1.0)
        coordinator = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)
        client.wait_until_reachable(60)
        listing = client.list_runs()
        states = {r.name: r.state for r in listing.runs}
        assert states == {"first": pb.RUN_STATE_RUNNING, "second": pb.RUN_STATE_QUEUED}
        # The first run trains on after the restart (its workers rode over the outage),
        # then is stopped; the second runs to its budget.
        resumed_at = _min_live_iteration(client, first.run_id)
        wait_for(lambda: _min_live_iteration(client, first.run_id) > resumed_at + 10,
                 "the first run to train on after the restart", 120)
        client.stop_run("trained on after the restart", first.run_id)
        wait_for(lambda: all(r.state != pb.RUN_STATE_RUNNING and r.state != pb.RUN_STATE_QUEUED
                             for r in client.list_runs().runs), "both runs' end", 240)
        runs = {r.name: r for r in client.list_runs().runs}
        assert runs["first"].state == pb.RUN_STATE_STOPPED, runs["first"].stop_reason
        assert runs["second"].state == pb.RUN_STATE_FINISHED, runs["second"].stop_reason
        workers = client.run_status(first.run_id).workers
        assert len(workers) == 2 and all(w.state == pb.WORKER_STATE_LEFT for w in workers)
        assert agent.poll() is None  # the agent never stopped
    finally:
        client.close()
        _stop(agent)
        _stop(coordinator)
