"""Guarded background loops: errors are logged, reported and retried after a back-off."""

from __future__ import annotations

import asyncio

import pytest

from ripples import guarded
from ripples.guarded import MAX_BACKOFF_SECONDS, backoff_seconds, guarded_loop


def test_the_back_off_doubles_per_failure_and_is_capped() -> None:
    assert [backoff_seconds(0.5, n) for n in range(3)] == [0.5, 1.0, 2.0]
    assert backoff_seconds(0.5, 60) == MAX_BACKOFF_SECONDS
    # A loop slower than the cap never runs more often than its own interval.
    assert backoff_seconds(60.0, 3) == 60.0


def test_a_failing_body_is_retried_with_back_off_until_cancelled(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    waits: list[float] = []
    runs: list[int] = []
    errors: list[None] = []
    outcomes = [RuntimeError("first"), RuntimeError("second"), None, RuntimeError("third"),
                None]
    real_sleep = asyncio.sleep

    async def recorded_sleep(seconds: float) -> None:  # records the wait, waits for nothing
        waits.append(seconds)
        await real_sleep(0)

    async def body() -> None:
        runs.append(len(runs))
        outcome = outcomes[len(runs) - 1] if len(runs) <= len(outcomes) else None
        if outcome is not None:
            raise outcome

    async def scenario() -> asyncio.Task[None]:
        task = asyncio.create_task(guarded_loop("test-loop", body, 1.0,
                                                on_error=lambda: errors.append(None)))
        while len(runs) < len(outcomes) + 1:
            await real_sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task

    monkeypatch.setattr(guarded.asyncio, "sleep", recorded_sleep)
    task = asyncio.run(scenario())
    assert task.cancelled()
    assert len(errors) == 3
    # Waits before each run: the interval, doubled after each failure in a row, reset by a
    # success.
    assert waits[:6] == [1.0, 2.0, 4.0, 1.0, 2.0, 1.0]
    assert caplog.text.count("background task test-loop failed") == 3
    assert "RuntimeError: second" in caplog.text
