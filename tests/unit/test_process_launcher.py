"""The launcher's watcher over real child processes: which failure it reports, and how."""

from __future__ import annotations

import os
import signal

from ripples.worker.process_launcher import WorkerProcesses, describe_exit


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
