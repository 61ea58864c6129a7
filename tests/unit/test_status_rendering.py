"""`ripples status` as text: every worker of a small run, a bounded page of a big one."""

from __future__ import annotations

from ripples.cli.run_views import STATUS_MAX_WORKER_ROWS, render_status
from ripples.v1 import coordinator_pb2 as pb


def _status(n: int, failed: tuple[int, ...] = ()) -> pb.RunStatus:
    return pb.RunStatus(
        run=pb.RunInfo(run_id="r1", name="big", state=pb.RUN_STATE_RUNNING),
        config=pb.RunConfig(run_id="r1", protocol="ripples-smart", num_workers=n),
        started=True, elapsed_seconds=12.0,
        workers=[pb.WorkerStatus(worker_id=w, rank=w, host=f"h{w // 8}", local_rank=w % 8,
                                 iteration=50 + w % 5, loss=1.5,
                                 state=pb.WORKER_STATE_FAILED if w in failed
                                 else pb.WORKER_STATE_COMPUTING,
                                 error="worker died" if w in failed else "")
                 for w in range(n)])


def test_a_small_run_lists_every_worker_by_rank() -> None:
    text = render_status(_status(4))
    rows = [line.split() for line in text.splitlines()
            if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert "listed:" not in text


def test_a_run_of_a_thousand_workers_lists_a_page_failed_first() -> None:
    text = render_status(_status(1000, failed=(321, 654)))
    assert "  workers: 998 computing, 2 failed" in text
    assert f"listed: {STATUS_MAX_WORKER_ROWS} of 1000" in text
    table = text.split("RANK", 1)[1].splitlines()[1:]
    rows = [line for line in table if line.strip() and not line.strip().startswith("loss")]
    assert len(rows) == STATUS_MAX_WORKER_ROWS
    assert rows[0].split()[0] == "321" and rows[1].split()[0] == "654"
    assert "worker died" in rows[0]
    # Then the furthest behind: iteration 50 (every fifth worker).
    assert all(line.split()[4] == "50" for line in rows[2:])
