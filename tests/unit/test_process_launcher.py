"""The launcher's watcher over real child processes: which failure it reports, and how."""

from __future__ import annotations

import os
import signal

from ripples.worker.process_launcher import RESTART_EXIT_CODE, WorkerProcesses, describe_exit


def test_the_first_child_to_fail_in_time_gives_the_exit_code() -> None:
    """Rank 0 fails late with code 3; rank 1 is killed by SIGABRT at once (as gloo does
    on mismatched collectives): the launcher reports 128 + 6, and names both."""
    processes = WorkerProcesses()
    env = dict(os.environ)
    processes.start("rank 0", ["sh", "-c", "sleep 1; exit 3"], env)
    processes.start("rank 1", ["sh", "-c", "kill -ABRT $$"], env)
    processes.start("rank 2", ["true"], env)
    assert processes.wait_all() == 128 + signal.SIGABRT
    failures = processes.failures()
    assert failures[0].startswith("rank 0") and failures[0].endswith("exited with code 3")
    assert failures[1].endswith("was killed by SIGABRT (signal 6)")
    assert len(failures) == 2


def test_exits_are_described_in_words() -> None:
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-9) == "was killed by SIGKILL (signal 9)"


def test_a_child_that_exits_for_a_restart_round_is_started_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Exit code 75 (a lock-step run's restart round) is no failure: the launcher starts
    the same command again, which this time succeeds."""
    processes = WorkerProcesses()
    marker = tmp_path / "ran-once"
    processes.start("rank 0", ["sh", "-c", f"test -e {marker} && exit 0; touch {marker}; "
                               f"exit {RESTART_EXIT_CODE}"], dict(os.environ))
    processes.start("rank 1", ["true"], dict(os.environ))
    assert processes.wait_all() == 0
    assert processes.children[0].restarts == 1 and not processes.failures()


def test_a_worker_of_several_ranks_is_started_again_whole_at_a_new_address(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 of a worker fails; rank 0 hangs on: it is killed after UNIT_EXIT_SECONDS and
    both start again, together, meeting at a new address; another worker's process is
    left alone. The second time both succeed."""
    from ripples.worker import process_launcher

    monkeypatch.setattr(process_launcher, "UNIT_EXIT_SECONDS", 0.5)
    processes = WorkerProcesses(max_failure_restarts=1)
    env = {**os.environ, "RIPPLES_REPLICA_ADDRESS": "127.0.0.1:1"}
    seen, once = tmp_path / "addresses", tmp_path / "failed-once"
    processes.start("w0 rank 0", ["sh", "-c", f"echo $RIPPLES_REPLICA_ADDRESS >> {seen}; "
                                  f"test -e {once} && exit 0; exec sleep 600"], env, unit=0)
    processes.start("w0 rank 1", ["sh", "-c", f"test -e {once} && exit 0; sleep 0.3; "
                                  f"touch {once}; exit 5"], env, unit=0)
    processes.start("w1", ["true"], dict(os.environ))
    assert processes.wait_all() == 0
    assert [c.restarts for c in processes.children] == [1, 1, 0]
    assert not processes.failures()
    first, second = seen.read_text().split()
    assert first == "127.0.0.1:1" and second != first and second.startswith("127.0.0.1:")
    assert processes.children[1].env["RIPPLES_REPLICA_ADDRESS"] == second


def test_a_worker_whose_rank_fails_past_its_restarts_ends_with_that_failure() -> None:
    """No restarts left: the failed rank's exit is the worker's; its other rank ends by
    itself and is not started again."""
    processes = WorkerProcesses(max_failure_restarts=0)
    env = dict(os.environ)
    processes.start("w0 rank 0", ["sh", "-c", "sleep 0.5; exit 1"], env, unit=0)
    processes.start("w0 rank 1", ["sh", "-c", "exit 4"], env, unit=0)
    assert processes.wait_all() == 4
    assert [c.restarts for c in processes.children] == [0, 0]
    assert len(processes.failures()) == 2


def test_a_child_of_one_rank_inherits_no_ranks_from_its_launcher(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A launcher started with a worker's rank variables (an sbatch's environment, a
    launcher that is itself a rank) gives its children their own: a run of one rank per
    worker stays unsharded, and a sharded child meets where its launcher says."""
    from ripples.worker.launch_env import LaunchEnv
    from ripples.worker.process_launcher import launch_environment

    monkeypatch.setenv("RIPPLES_RANKS_PER_WORKER", "2")
    monkeypatch.setenv("RIPPLES_REPLICA_ADDRESS", "10.0.0.1:5")
    monkeypatch.setenv("RIPPLES_REPLICA_RANK", "1")
    child = launch_environment(LaunchEnv(host="h"), rank=None, world_size=None)
    assert child["RIPPLES_RANKS_PER_WORKER"] == "1"
    assert "RIPPLES_REPLICA_ADDRESS" not in child and "RIPPLES_REPLICA_RANK" not in child
    sharded = launch_environment(LaunchEnv(host="h", ranks_per_worker=4,
                                           replica_address="127.0.0.1:7"),
                                 rank=None, world_size=None)
    assert (sharded["RIPPLES_RANKS_PER_WORKER"], sharded["RIPPLES_REPLICA_ADDRESS"]) == (
        "4", "127.0.0.1:7")
    assert "RIPPLES_REPLICA_RANK" not in sharded  # the launcher's rank says it (torchrun)
    ranked = launch_environment(LaunchEnv(host="h", ranks_per_worker=4, replica_rank=2,
                                          replica_address="127.0.0.1:7"),
                                rank=None, world_size=None)
    assert ranked["RIPPLES_REPLICA_RANK"] == "2"
