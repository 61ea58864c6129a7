"""Workers of several ranks under the coordinator service: `ripples submit
--ranks-per-worker 2 -- python script` on a host agent of four slots (two workers of two
ranks each), a rank killed mid-run (its worker is started again whole, as a replacement
that heals shard by shard), the run's model whole. A real coordinator service, a real
agent and its worker processes on gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, UNBOUNDED_ITERATIONS, child_pids, ripples_cli, wait_for

from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient

SCRIPTS = REPO / "tests" / "integration" / "scripts"
sys.path.insert(0, str(SCRIPTS))
import sharded_train  # noqa: E402 (the script's model)


def _rank_pid(agent: subprocess.Popen[str], local_rank: int, rank: int) -> int | None:
    """The pid of rank `rank` of worker `local_rank` among `agent`'s own children (read
    from their environment: every rank runs the same command)."""
    for child in child_pids(agent.pid):
        try:
            raw = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(v.decode(errors="replace").partition("=")[::2] for v in raw if b"=" in v)
        if (env.get("LOCAL_RANK"), env.get("RIPPLES_REPLICA_RANK")) == (str(local_rank),
                                                                         str(rank)):
            return child
    return None


@pytest.mark.slow
def test_an_agent_runs_a_submitted_run_of_workers_of_two_ranks_and_restarts_one_whole(
        tmp_path: Path) -> None:
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                            state_dir=str(tmp_path / "state"))).start()
    client = CoordinatorClient(server.address)
    log = tmp_path / "agent.log"
    with log.open("w") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "ripples.cli", "worker", "run", "--agent", "--host",
             "node-a", "--nproc-per-node", "4", "--metrics-port", "-1", "--output-dir",
             str(tmp_path / "out"), "--coordinator", server.address],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=out, text=True)
    try:
        where = ["--coordinator", server.address]
        submitted = ripples_cli(
            "submit", *where, "--workers", "2", "--protocol", "ripples-smart",
            "--ranks-per-worker", "2", "--iterations", str(UNBOUNDED_ITERATIONS),
            "--min-workers", "1", "--lease-seconds", "2", "--name", "sharded", "--", "python",
            str(SCRIPTS / "sharded_train.py"), "-", str(UNBOUNDED_ITERATIONS), timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        assert "2 workers of 2 ranks" in submitted.stdout
        run_id = submitted.stdout.split()[2]
        assert server.service is not None
        core = server.service.core

        def training() -> bool:
            status = client.run_status(run_id)
            return status.started and min(w.iteration for w in status.workers) > 20

        wait_for(training, "the run to train", 180)
        listing = json.loads(ripples_cli("runs", *where, "--json", timeout=60).stdout)
        assert listing["runs"][0]["ranks_per_worker"] == 2
        assert "2x2" in ripples_cli("runs", *where, timeout=60).stdout
        assert listing["agents"][0]["processes"] == 4
        status = client.run_status(run_id)
        assert sorted(f"{w.host}/{w.local_rank}" for w in status.workers) == [
            "node-a/0", "node-a/1"]

        victim = _rank_pid(agent, local_rank=1, rank=1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)  # rank 1 of worker node-a/1
        wait_for(lambda: any(w.replacement and w.healed for w in core.workers.values())
                 or core.stopped, "the worker started again to heal", 240)
        assert not core.stopped, core.stop_reason
        joiner = next(w for w in core.workers.values() if w.replacement)
        assert (joiner.host, joiner.local_rank) == ("node-a", 1)
        at = joiner.progress.iteration
        wait_for(lambda: joiner.progress.iteration > at + 20
                 and any(joiner.worker_id in g.members and g.heal_donor is None
                         for g in core.recent_groups),
                 "the replacement to train and average in a group", 180)
        assert "starting its worker's 2 ranks again" in log.read_text()
        # One log per worker: its ranks' lines, those of rank 1 marked, and the error.
        lines = [line for batch in client.logs(run_id, worker="node-a/1")
                 for line in batch.lines]
        assert "worker 1: its rank 0 of 2, from step 0" in lines, lines[-20:]
        assert "[rank 1] worker 1: its rank 1 of 2, from step 0" in lines, lines[-20:]
        assert any("RuntimeError" in line for line in lines), lines[-20:]  # rank 0's end

        client.stop_run("the replacement averaged", run_id)
        wait_for(lambda: client.run_status(run_id).run.model_path, "the run's model", 180)
        info = client.run_status(run_id).run
        assert info.state == pb.RUN_STATE_STOPPED, info.stop_reason
        host, _, path = info.model_path.partition(":")
        assert host == "node-a"
        state = torch.load(path)  # whole: gathered from the shards by the worker's rank 0
        sharded_train.build_model().load_state_dict(state)
        assert all(torch.isfinite(t).all() for t in state.values())
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        client.close()
        server.stop()
