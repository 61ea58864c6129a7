"""Repeated log records summed up (ripples/log_repeats.py), on a real logging handler
with a clock the test moves."""

from __future__ import annotations

import io
import logging

import pytest

from ripples.log_repeats import RepeatFilter


def test_a_flood_of_one_record_is_written_once_then_counted() -> None:
    now = [0.0]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RepeatFilter(window_seconds=10.0, clock=lambda: now[0]))
    logger = logging.getLogger("test_log_repeats")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for fd in range(4211):  # the same template, other arguments: one kind
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logger.exception("socket.accept() out of system resource (fd %d)", fd)
        logger.warning("something else")  # another kind: written at once
        lines = stream.getvalue().splitlines()
        assert sum("out of system resource" in line for line in lines) == 1
        assert lines[-1] == "something else"
        now[0] = 10.5  # the window is over: the next one says how many were left out
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            logger.exception("socket.accept() out of system resource (fd %d)", 7)
        assert ("socket.accept() out of system resource (fd 7) (repeated 4,210 times in "
                "the last 10 s)\nTraceback") in stream.getvalue()
        assert len(stream.getvalue()) < 2000
    finally:
        logger.removeHandler(handler)


def test_lines_that_differ_are_all_written_and_a_lone_count_is_written_after_its_window(
) -> None:
    now = [0.0]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    repeats = RepeatFilter(window_seconds=10.0, clock=lambda: now[0])
    repeats.handler = handler
    handler.addFilter(repeats)
    logger = logging.getLogger("test_log_repeats_lone")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for worker in range(5):  # one template, five different lines: all written
            logger.warning("registered worker %d", worker)
        for _ in range(30):  # one identical line: written once, the rest counted
            logger.warning("the store is slow")
        assert stream.getvalue().splitlines() == [
            *(f"registered worker {w}" for w in range(5)), "the store is slow"]
        now[0] = 11.0  # the flood stopped: its count is written on its own
        repeats.flush()
        assert stream.getvalue().splitlines()[-1] == (
            "the store is slow: repeated 29 more times in the last 11 s")
    finally:
        logger.removeHandler(handler)


def test_a_command_run_in_process_leaves_the_hosts_logging_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    """A command's logging set-up filters its own handler only: a program (or a test)
    that runs a command in-process keeps every record of its own handlers. (Before, the
    filter went on every root handler, and pytest's capture handler then folded repeated
    tracebacks of later tests.)"""
    from ripples.cli.arguments import setup_logging

    root = logging.getLogger()
    before = {handler: list(handler.filters) for handler in root.handlers}
    setup_logging(verbose=False)
    assert {handler: list(handler.filters) for handler in root.handlers} == before
    logger = logging.getLogger("test_log_repeats_host")
    for _ in range(3):
        try:
            raise RuntimeError("again")
        except RuntimeError:
            logger.exception("the same failure")
    assert caplog.text.count("the same failure") == 3
