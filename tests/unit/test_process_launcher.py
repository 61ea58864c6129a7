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
