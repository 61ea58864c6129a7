"""The worker processes of a local run (`ripples run`): what each is started with, and
which of them failed.

Worker k is process k, or with `--ranks-per-worker G` processes kG..kG+G-1: its ranks,
which form their process group at an address of their own on loopback (rank 0 serves it)
and shard the model with FSDP2 (worker/replica.py). Every rank of a worker shares its
host name, local rank and output files (only rank 0 writes them); on GPUs each rank
takes a GPU of its own, where there are enough (else with --share-gpus).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ripples.coordinator.config import RunSettings
from ripples.netshape import ShapedCluster
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.devices import nccl_environment
from ripples.worker.launch_env import CheckpointOptions, LaunchEnv
from ripples.worker.process_launcher import (
    WorkerProcesses,
    describe_exit,
    free_port,
    launch_environment,
    runner_argv,
    script_argv,
)


def spawn_workers(processes: WorkerProcesses, *, run: RunSettings, coordinator: str,
                  devices: list[str], output_dir: str, script: tuple[str, ...],
                  threads: int, slowdowns: dict[int, str], checkpoint: CheckpointOptions,
                  ranks_per_worker: int, quiet: bool,
                  network: ShapedCluster | None) -> None:
    """Start every worker's processes (see the module doc); `devices`: one per process,
    worker-major (a worker's ranks on GPUs of their own where there are enough)."""
    k, g = run.workers_per_node, ranks_per_worker
    tag = f"ripples-{os.getpid()}"
    for rank in range(run.num_workers):
        env = LaunchEnv(
            coordinator=coordinator, launcher="ripples", host=f"node{rank // k}",
            local_rank=rank % k, local_world_size=k, device=devices[rank * g],
            num_threads=threads, metrics_bind="127.0.0.1",
            save_model=os.path.join(output_dir, "workers", f"rank{rank}.pt"),
            save_record=os.path.join(output_dir, "workers", f"rank{rank}.json"),
            slowdown=slowdowns.get(rank, ""), checkpoint=checkpoint, ranks_per_worker=g,
            replica_address=f"127.0.0.1:{free_port()}" if g > 1 else "")
        argv = script_argv(script) or runner_argv(env, run.task, quiet=quiet)
        for shard in range(g):
            index = rank * g + shard  # the process's: its device is devices[index]
            child = launch_environment(env.replace(device=devices[index], replica_rank=shard),
                                       rank=rank, world_size=run.num_workers)
            if network is None:
                child.update(nccl_environment(devices, index, tag, loopback=True))
                command = argv
            else:  # its host's namespace, talking over its link
                child.update(nccl_environment(devices, index, tag, loopback=False))
                interface = network.hosts[rank].ifname
                child.update(GLOO_SOCKET_IFNAME=interface, NCCL_SOCKET_IFNAME=interface)
                command = network.argv(rank, *argv)
            processes.start(process_name(rank, shard, g), command, child)


def process_name(rank: int, shard: int, ranks_per_worker: int) -> str:
    """How the run's messages name a worker's process."""
    if ranks_per_worker == 1:
        return f"worker rank {rank}"
    return f"worker rank {rank} (its rank {shard} of {ranks_per_worker})"


def failed_workers(processes: WorkerProcesses, status: pb.RunStatus, *,
                   workers_per_node: int, ranks_per_worker: int,
                   will_restart: Callable[[object], bool]) -> list[str]:
    """A line for each worker process that ended with an error: its exit and the error
    its worker reported to the coordinator, if any."""
    k, g = workers_per_node, ranks_per_worker
    errors = {(w.host, w.local_rank): w.error for w in status.workers}
    failed = []
    for index, child in enumerate(processes.children):
        rank, shard = divmod(index, g)
        code = child.process.poll()
        if code in (None, 0) or will_restart(child):
            continue
        why = (errors.get((f"node{rank // k}", rank % k))
               or "it exited without reporting an error (see its log above)")
        failed.append(f"{process_name(rank, shard, g)} (pid {child.process.pid}) "
                      f"{describe_exit(code)}: {why}")
    return failed

