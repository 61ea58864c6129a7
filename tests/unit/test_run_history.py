"""The service's run history (coordinator/history.py) on a real SQLite file, and how a run
is named and found."""

from __future__ import annotations

from pathlib import Path

import pytest

from ripples.coordinator.history import RunHistory, state_name, summary
from ripples.coordinator.run_queue import default_name
from ripples.v1 import coordinator_pb2 as pb


def _info(run_id: str, name: str, state: int = pb.RUN_STATE_QUEUED) -> pb.RunInfo:
    return pb.RunInfo(run_id=run_id, name=name, state=state, protocol="ripples-smart",
                      num_workers=2, task="digits")


def test_runs_are_kept_found_by_id_prefix_or_name_and_survive_a_reopen(tmp_path: Path) -> None:
    history = RunHistory(tmp_path)
    history.add(_info("aaaa11112222", "first"), {"num_workers": 2})
    history.add(_info("aaaa33334444", "second"), {"num_workers": 3})
    with pytest.raises(ValueError, match="exists already"):
        history.add(_info("aaaa11112222", "again"), {})
    assert history.get("aaaa1").name == "first"  # type: ignore[union-attr]
    assert history.get("second").run_id == "aaaa33334444"  # type: ignore[union-attr]
    assert history.get("aaaa") is None  # ambiguous: two ids start so
    assert history.get("a%") is None and history.get("zzz") is None
    done = _info("aaaa11112222", "first", pb.RUN_STATE_FINISHED)
    done.stop_reason = "iteration budget reached"
    history.update(done, pb.RunStatus(stopped=True, stop_reason=done.stop_reason,
                                      loss_curve=[pb.LossPoint(seconds=1.0, loss=0.5)]))
    history.set_meta("next_worker_id", 7)
    history.close()

    again = RunHistory(tmp_path)
    assert [r.name for r in again.runs()] == ["first", "second"]
    assert [r.run_id for r in again.queued()] == ["aaaa33334444"]
    final = again.final_status("aaaa11112222")
    assert final is not None and final.loss_curve[0].loss == 0.5
    assert again.final_status("aaaa33334444") is None
    assert again.options("aaaa33334444") == {"num_workers": 3}
    assert again.meta("next_worker_id") == 7 and again.meta("incarnation") == 0
    row = summary(again.get("first"))  # type: ignore[arg-type]
    assert row["state"] == "finished" and row["stop_reason"] == "iteration budget reached"
    assert state_name(pb.RUN_STATE_CANCELLED) == "cancelled"
    again.close()


def test_without_a_state_dir_the_history_lives_in_memory() -> None:
    history = RunHistory(None)
    history.add(_info("bbbb", "x"), {})
    assert history.path is None and len(history.runs()) == 1


@pytest.mark.parametrize(("options", "command", "name"), [
    ({"protocol": "hop", "task": "digits"}, [], "hop-digits"),
    ({"protocol": "hop"}, ["python", "examples/ripples_digits.py", "--epochs", "2"],
     "hop-ripples_digits"),
    ({"protocol": "hop"}, ["python", "-m", "ripples.examples.transformer_lm", "--steps", "30"],
     "hop-transformer_lm"),
    ({"protocol": "allreduce"}, ["./train.sh"], "allreduce-train.sh"),
])
def test_a_run_is_named_after_its_protocol_and_what_it_trains(
        options: dict[str, object], command: list[str], name: str) -> None:
    assert default_name(options, command) == name
