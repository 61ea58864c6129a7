"""Where a worker stands, from its launcher's environment (worker/launch_env.py)."""

from __future__ import annotations

import pytest

from ripples.worker.launch_env import LaunchEnv


def _env(**variables: str) -> LaunchEnv:
    return LaunchEnv.from_environ({"RIPPLES_HOST": "h", **variables})


def test_nothing_set_is_single_process_mode() -> None:
    env = _env()
    assert not env.distributed and env.launcher == "none"
    assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)


def test_torchrun_variables() -> None:
    env = _env(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
               RIPPLES_COORDINATOR="coord:29400")
    assert env.launcher == "torchrun" and env.distributed
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)


def test_slurm_variables_and_node_name() -> None:
    env = LaunchEnv.from_environ({
        "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
        "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURMD_NODENAME": "gpu17",
        "RIPPLES_COORDINATOR": "gpu01:29400"})
    assert env.launcher == "slurm" and env.host == "gpu17"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (6, 8, 2, 4)


def test_kubeflow_variables_without_torchrun() -> None:
    env = _env(PET_NODE_RANK="2", PET_NNODES="1:3", PET_NPROC_PER_NODE="2", LOCAL_RANK="1",
               RIPPLES_COORDINATOR="ripples-coordinator:29400")
    assert env.launcher == "kubeflow"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 6, 1, 2)


def test_torchrun_wins_over_an_outer_slurm_allocation() -> None:
    env = _env(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", SLURM_PROCID="0", SLURM_NTASKS="1",
               RIPPLES_COORDINATOR="c:1")
    assert env.launcher == "torchrun" and env.local_rank == 3


def test_ripples_own_launchers_ignore_the_outer_launcher() -> None:
    # `srun ripples worker run --nproc-per-node 4 -- ...`: each child has SLURM's rank of
    # the one srun task, and Ripples' LOCAL_RANK of its own.
    env = _env(RIPPLES_LAUNCHER="ripples", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4",
               SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", RIPPLES_COORDINATOR="c:1")
    assert env.launcher == "ripples" and env.local_rank == 2 and env.local_world_size == 4


def test_ripples_variables_set_the_worker() -> None:
    env = _env(RIPPLES_COORDINATOR="10.0.0.1:29400", RIPPLES_DEVICE="cpu",
               RIPPLES_NUM_THREADS="2", RIPPLES_METRICS_PORT="-1", RIPPLES_SLOWDOWN="5",
               RIPPLES_SAVE_MODEL="/out/r0.pt", RIPPLES_START_TIMEOUT_SECONDS="30")
    assert env.launcher == "ripples" and env.device == "cpu" and env.num_threads == 2
    assert env.metrics_port == -1 and env.slowdown == "5" and env.save_model == "/out/r0.pt"
    assert env.start_timeout_seconds == 30.0 and env.host == "h"


@pytest.mark.parametrize(("variables", "message"), [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "RIPPLES_COORDINATOR is not set"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not an integer"),
    ({"RIPPLES_COORDINATOR": "nohost"}, "HOST:PORT"),
    ({"RIPPLES_NUM_THREADS": "x"}, "RIPPLES_NUM_THREADS='x' is not an integer"),
    ({"RIPPLES_METRICS_PORT": "70000"}, "out of range"),
    ({"PET_NODE_RANK": "0", "PET_NNODES": "many"}, "PET_NNODES"),
])
def test_a_malformed_environment_names_the_variable(variables: dict[str, str],
                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _env(**variables)


def test_overrides_replace_the_environment_and_are_validated() -> None:
    env = _env(RIPPLES_COORDINATOR="c:1").replace(device="cpu", local_rank=None)
    assert env.device == "cpu" and env.local_rank == 0
    with pytest.raises(ValueError, match="must not be negative"):
        env.replace(local_rank=-1)


def test_a_host_daemon_under_srun_names_its_node_as_slurm_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`ripples worker run` inside srun: its workers' node is SLURM's node name, the one
    the other srun tasks on that node report too (not a possibly different host name)."""
    from ripples.worker.daemon import WorkerConfig

    monkeypatch.setenv("SLURMD_NODENAME", "gpu17")
    assert WorkerConfig(coordinator="c:1").launch_env().host == "gpu17"
    assert WorkerConfig(coordinator="c:1", host="mine").launch_env().host == "mine"


def test_a_worker_of_several_ranks_reads_its_rank_and_meeting_address() -> None:
    env = LaunchEnv.from_environ({"RIPPLES_COORDINATOR": "c:1", "RIPPLES_LAUNCHER": "ripples",
                                  "RIPPLES_RANKS_PER_WORKER": "2",
                                  "RIPPLES_REPLICA_RANK": "1",
                                  "RIPPLES_REPLICA_ADDRESS": "127.0.0.1:4000"})
    assert env.sharded and env.worker_rank == 1 and env.replica_address == "127.0.0.1:4000"


def test_under_torchrun_a_workers_ranks_are_consecutive_launch_ranks() -> None:
    env = LaunchEnv.from_environ({"RIPPLES_COORDINATOR": "c:1", "RANK": "5",
                                  "WORLD_SIZE": "8", "RIPPLES_RANKS_PER_WORKER": "2"})
    assert env.worker_rank == 1
    alone = LaunchEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2",
                                    "RIPPLES_RANKS_PER_WORKER": "2"})
    assert not alone.distributed and alone.worker_rank == 1  # one worker: plain FSDP2


@pytest.mark.parametrize(("variables", "says"), [
    ({"RIPPLES_RANKS_PER_WORKER": "0"}, "at least 1"),
    ({"RIPPLES_RANKS_PER_WORKER": "2", "RIPPLES_REPLICA_RANK": "2",
      "RIPPLES_REPLICA_ADDRESS": "h:1"}, "is not a rank of a worker of 2 ranks"),
    ({"RIPPLES_RANKS_PER_WORKER": "3", "RANK": "0", "WORLD_SIZE": "4"},
     "do not make workers of 3 ranks"),
    ({"RIPPLES_RANKS_PER_WORKER": "2", "RIPPLES_REPLICA_ADDRESS": "nowhere"},
     "RIPPLES_REPLICA_ADDRESS"),
    ({"RIPPLES_RANKS_PER_WORKER": "2", "RANK": "0", "WORLD_SIZE": "4"},
     "RIPPLES_COORDINATOR is not set"),
])
def test_malformed_workers_of_several_ranks_are_refused(variables: dict[str, str],
                                                        says: str) -> None:
    with pytest.raises(ValueError, match=says):
        LaunchEnv.from_environ(variables)
