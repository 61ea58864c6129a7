"""Structured events (ripples/events.py): appended whole by concurrent processes, nothing
without the variable, never an exception, read back line by line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ripples import events

WRITER = """
import sys
from ripples import events
name, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(count):
    events.emit("test_line", writer=name, seq=i, pad=name[-1] * size)
"""


def test_lines_stay_whole_under_concurrent_writers_from_several_processes(
        tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    env = {**os.environ, events.ENV_EVENTS_FILE: str(path)}
    # Lines of ~5 KB: longer than a pipe's atomic write, as the worst case for O_APPEND.
    writers, count, size = 4, 200, 5000
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, f"w{n}", str(count), str(size)],
                              env=env) for n in range(writers)]
    assert [p.wait(120) for p in procs] == [0] * writers
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # every line ends with its newline
    seen: dict[str, list[int]] = {}
    for line in lines[:-1]:
        event = json.loads(line)  # a torn or interleaved line would not parse
        assert event["event"] == "test_line"
        assert event["pad"] == event["writer"][-1] * size
        seen.setdefault(event["writer"], []).append(event["seq"])
    assert seen == {f"w{n}": list(range(count)) for n in range(writers)}
    read, offset = events.read(path)
    assert len(read) == writers * count and offset == path.stat().st_size
    assert {e["pid"] for e in read} == {p.pid for p in procs}


def test_threads_of_one_process_append_whole_lines(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.ENV_EVENTS_FILE, str(path))

    def write(name: str) -> None:
        for i in range(100):
            events.emit("test_line", writer=name, seq=i)

    threads = [threading.Thread(target=write, args=(f"t{n}",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read, _ = events.read(path)
    assert sorted((e["writer"], e["seq"]) for e in read) == sorted(
        (f"t{n}", i) for n in range(4) for i in range(100))


def test_an_unset_or_empty_variable_writes_nothing(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(events.ENV_EVENTS_FILE, raising=False)
    events.emit(events.WORKER_FINISHED, worker_id=1, reason="done")
    monkeypatch.setenv(events.ENV_EVENTS_FILE, "")
    events.emit(events.WORKER_FINISHED, worker_id=1, reason="done")
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_path_raises_nothing_and_warns_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(events, "_warned", threading.Event())
    caplog.set_level(logging.WARNING, logger=events.__name__)
    for path in (tmp_path / "no" / "such" / "folder" / "events.jsonl", tmp_path):  # a folder
        monkeypatch.setenv(events.ENV_EVENTS_FILE, str(path))
        events.emit(events.WORKER_HEALED, donor=1, seconds=0.5, asked_seconds=1.0)
        events.emit(events.WORKER_HEALED, donor=1, seconds=0.5, asked_seconds=1.0)
    warnings = [r for r in caplog.records if r.name == events.__name__]
    assert len(warnings) == 1 and "cannot write events" in warnings[0].getMessage()
    assert not (tmp_path / "no").exists()


def test_an_event_carries_its_kind_time_pid_and_fields(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.ENV_EVENTS_FILE, str(path))
    events.emit(events.CHECKPOINT_RESTORED, step=250, path=tmp_path / "step-250.pt",
                pid=-1, event="not this")  # reserved keys stay the emitter's
    (event,), _ = events.read(path)
    assert event["event"] == "checkpoint_restored" and event["pid"] == os.getpid()
    assert event["step"] == 250 and event["path"] == str(tmp_path / "step-250.pt")
    assert isinstance(event["time"], float)


def test_reading_leaves_a_partial_last_line_and_skips_garbage(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert events.read(path) == ([], 0)  # no file yet: no events
    first = json.dumps({"event": "a", "time": 1.0, "pid": 1}) + "\n"
    path.write_text(first + "not json\n" + '["a list"]\n' + '{"event": "b", "ti')
    read, offset = events.read(path)
    assert [e["event"] for e in read] == ["a"]
    assert offset == len(first) + len("not json\n") + len('["a list"]\n')
    with path.open("a") as f:
        f.write('me": 2.0, "pid": 1}\n')
    more, end = events.read(path, offset)
    assert [e["event"] for e in more] == ["b"] and end == path.stat().st_size
