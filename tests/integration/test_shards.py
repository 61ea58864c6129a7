"""A sharded job on loopback (docs/scale.md): a root coordinator, two shard coordinators
whose runs name it (`root`), and real worker processes with gloo. The heads average across
shards at the root; an operator's stop at the root stops every shard; a root that dies
or never was leaves the shards training to their own budgets."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch

from ripples.coordinator.server import CoordinatorServer
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import (
    REPO,
    doc_block,
    explained_on_failure,
    finish,
    free_port,
    run_block,
    running_coordinator,
    start_worker,
    wait_for,
)

pytestmark = pytest.mark.slow

SHARD = dict(protocol="ripples-smart", num_workers=2, group_size=2, task="digits")
ROOT = dict(protocol="ripples-smart", num_workers=2, min_workers=1, group_size=2)


@contextmanager
def shards(root: str, iterations: int, **extra: object) -> Iterator[list[CoordinatorServer]]:
    """Two shard coordinators (different seeds: different initial models)."""
    settings = {**SHARD, "iterations": iterations, **extra}
    if root:
        settings |= {"root": root, "inter_period": 2}
    with ExitStack() as stack:
        yield [stack.enter_context(running_coordinator(seed=seed, **settings))
               for seed in (1, 2)]


def start_workers(servers: list[CoordinatorServer], out: Path | None = None
                  ) -> list[subprocess.Popen[str]]:
    procs = []
    for name, server in zip("ab", servers, strict=True):
        for r in range(2):
            save = ["--save-model", str(out / f"{name}{r}.pt")] if out else []
            procs.append(start_worker(server.address, "--host", f"{name}{r}",
                                      "--metrics-port", "-1", *save))
    return procs


def all_exit_cleanly(procs: list[subprocess.Popen[str]], timeout: float = 180) -> list[str]:
    outputs = finish(procs, timeout)
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outputs


def shard_distance(out: Path) -> float:
    """||model of shard a - model of shard b|| / ||model of shard a||."""
    a, b = torch.load(out / "a0.pt"), torch.load(out / "b0.pt")
    floats = [k for k in a if a[k].is_floating_point()]
    diff = sum(float(((a[k] - b[k]) ** 2).sum()) for k in floats)
    norm = sum(float((a[k] ** 2).sum()) for k in floats)
    return (diff / norm) ** 0.5


def test_heads_average_across_shards_at_the_root(tmp_path: Path) -> None:
    sharded, alone = tmp_path / "sharded", tmp_path / "alone"
    sharded.mkdir()
    alone.mkdir()
    with running_coordinator(**ROOT) as root, shards(root.address, 60) as servers:
        all_exit_cleanly(start_workers(servers, sharded))
        client = CoordinatorClient(root.address)
        status = client.run_status()
        client.close()
        shard_status = [CoordinatorClient(s.address).run_status() for s in servers]
    # The root's members were the two heads, one per shard, named after it; they
    # P-Reduced there, and left when their shards' budgets ended.
    assert sorted(w.host.split("@")[1] for w in status.workers) == sorted(
        s.config.run_id for s in shard_status)
    assert all(w.state == pb.WORKER_STATE_LEFT for w in status.workers)
    assert status.num_groups_formed >= 5, status.num_groups_formed
    assert all("iteration budget reached" in s.stop_reason for s in shard_status)
    # The same two shards without a root keep apart what their seeds made apart.
    with shards("", 60) as servers:
        all_exit_cleanly(start_workers(servers, alone))
    mixed, apart = shard_distance(sharded), shard_distance(alone)
    assert mixed < 0.3 * apart, (mixed, apart)


def test_stopping_the_root_stops_every_shard() -> None:
    with running_coordinator(**ROOT) as root, shards(root.address, 100_000) as servers:
        client = CoordinatorClient(root.address)
        procs = start_workers(servers)
        with explained_on_failure(procs, root.service.core if root.service else None):
            wait_for(lambda: client.run_status().num_groups_formed >= 4,
                     "the heads' groups at the root", timeout=120)
            client.stop_run("the operator ends the job")
            all_exit_cleanly(procs, timeout=90)
        for server in servers:
            shard = CoordinatorClient(server.address)
            status = shard.run_status()
            assert "the root's run" in status.stop_reason, status.stop_reason
            assert "the operator ends the job" in status.stop_reason, status.stop_reason
            # An operator's stop, at the root: the shard's run ends as stopped.
            wait_for(lambda shard=shard: shard.run_status().run.state == pb.RUN_STATE_STOPPED,
                     "the shard's run to end as stopped", timeout=60)
            shard.close()
        client.close()


def test_shards_train_on_when_the_root_dies_or_never_was() -> None:
    port = free_port()
    root = subprocess.Popen(
        [sys.executable, "-m", "ripples.cli", "coordinator", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--metrics-port", "0", "--workers", "2", "--min-workers", "1",
         "--protocol", "ripples-smart", "--group-size", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ})
    address = f"127.0.0.1:{port}"
    try:
        client = CoordinatorClient(address)
        client.wait_until_reachable(60)
        with shards(address, 400) as servers:
            procs = start_workers(servers)
            with explained_on_failure(procs, None):
                wait_for(lambda: client.run_status().num_groups_formed >= 4,
                         "the heads' groups at the root", timeout=120)
                root.send_signal(signal.SIGKILL)
                outputs = all_exit_cleanly(procs, timeout=120)
            for server in servers:  # each shard ended at its own budget
                status = CoordinatorClient(server.address).run_status()
                assert "iteration budget reached" in status.stop_reason, status.stop_reason
        assert any("the coordinator is unreachable" in out for out in outputs), outputs[0]
        client.close()
    finally:
        root.kill()
        root.communicate()
    # A root that is not there at all: the heads train in their shards alone.
    with shards(f"127.0.0.1:{free_port()}", 40) as servers:
        outputs = all_exit_cleanly(start_workers(servers))
    heads = [out for out in outputs if "could not join the root" in out]
    assert len(heads) == 2, outputs[0][-3000:]


def test_a_head_that_dies_is_replaced_and_its_replacement_joins_the_root() -> None:
    with running_coordinator(**ROOT) as root, shards(root.address, 800,
                                                     num_workers=3) as servers:
        client, shard = CoordinatorClient(root.address), CoordinatorClient(servers[0].address)
        procs = {f"{name}{r}": start_worker(server.address, "--host", f"{name}{r}",
                                            "--metrics-port", "-1")
                 for name, server in zip("ab", servers, strict=True) for r in range(3)}
        started = list(procs.values())  # every process, killed at the end if still alive
        with explained_on_failure(started, None):
            wait_for(lambda: client.run_status().num_groups_formed >= 4,
                     "the heads' groups at the root", timeout=120)
            head = next(w for w in shard.run_status().workers if w.rank == 0)

            def at_root() -> set[int]:  # the root's members from the head's host
                return {w.worker_id for w in client.run_status().workers
                        if w.host.startswith(f"{head.host}@")}

            first = at_root()
            procs.pop(head.host).send_signal(signal.SIGKILL)
            procs["replacement"] = start_worker(servers[0].address, "--host", head.host,
                                                "--metrics-port", "-1")
            started.append(procs["replacement"])
            # The dead head's lease expires at the root; its replacement joins it there.
            wait_for(lambda: at_root() - first, "the replacement head at the root",
                     timeout=120)
            outputs = all_exit_cleanly(list(procs.values()))
        assert "replaces rank 0" in outputs[-1] and "head of shard" in outputs[-1], (
            outputs[-1][-3000:])
        client.close()
        shard.close()


def test_the_docs_sharded_job_runs_as_written(tmp_path: Path) -> None:
    code, output = run_block(doc_block("docs/scale.md", "## A sharded job in the service"),
                             tmp_path, timeout=300)
    assert code == 0, output[-4000:]
    # Each shard stops at its budget, 4 workers x 66 iterations. The sum is checked as
    # progress arrives, and a head's shard-side count can step by 2 (its root round is
    # asked of the root), so a shard may stop one past it.
    ended = re.findall(r"finished: iteration budget reached \((\d+) iterations\)", output)
    assert len(ended) >= 2 and all(264 <= int(n) <= 266 for n in ended), output[-4000:]
    rows = output[output.index("RANK  WORKER"):]  # the root's status: one head per shard
    assert "shard1-a@" in rows and "shard2-a@" in rows and " left " in rows, rows
    assert re.search(r"groups: [1-9]\d* formed", output), output[-4000:]
