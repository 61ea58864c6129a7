"""The dashboard's sign-in parts with a fake clock: sessions expire, are bounded and end
on sign-out; the attempt limit refills with time; a bad option is named."""

from __future__ import annotations

import pytest

from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.sign_in import AttemptLimiter, Sessions, retry_after


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sessions_expire_are_bounded_and_close() -> None:
    clock = Clock()
    sessions = Sessions(10.0, limit=3, clock=clock)
    first = sessions.open()
    assert sessions.valid(first) and not sessions.valid("") and not sessions.valid("forged")
    clock.now = 10.0
    assert not sessions.valid(first) and len(sessions) == 0  # expired, and forgotten
    ids = [sessions.open() for _ in range(4)]
    assert len(sessions) == 3 and not sessions.valid(ids[0])  # the oldest made room
    assert len(set(ids)) == 4 and all(len(i) >= 40 for i in ids)
    sessions.close(ids[1])
    assert not sessions.valid(ids[1]) and sessions.valid(ids[2])


def test_attempts_refill_with_time_per_address() -> None:
    clock = Clock()
    limiter = AttemptLimiter(3, 60.0, clock=clock)
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(20.0)  # one attempt back per 20 s
    assert limiter.take("b") == 0.0
    clock.now = 19.0
    assert limiter.take("a") == pytest.approx(1.0)  # a refused try costs nothing
    clock.now = 20.0
    assert limiter.take("a") == 0.0 and limiter.take("a") > 0
    clock.now = 1000.0  # a long pause: back to 3, no more
    assert [limiter.take("a") == 0.0 for _ in range(4)] == [True, True, True, False]
    assert retry_after(0.2) == "1" and retry_after(20.0) == "20" and retry_after(20.1) == "21"


def test_addresses_past_the_limit_share_one_count() -> None:
    clock = Clock()
    limiter = AttemptLimiter(1, 60.0, max_clients=2, clock=clock)
    assert limiter.take("a") == 0.0 and limiter.take("b") == 0.0
    assert limiter.take("c") == 0.0 and limiter.take("d") > 0  # c and d share one
    clock.now = 60.0  # a and b refilled: forgotten, room for a newcomer of its own
    assert limiter.take("e") == 0.0 and limiter.take("f") == 0.0


@pytest.mark.parametrize(("options", "message"), [
    ({"sign_in_attempts": 0}, "--sign-in-attempts 0 is out of range 1-1000"),
    ({"sign_in_window_seconds": float("nan")}, "--sign-in-window-seconds nan is out of range"),
    ({"session_hours": -1.0}, "--session-hours -1.0 is out of range"),
    ({"allowed_hosts": "ok.example,a b"}, "--allowed-hosts: 'a b' is not a host name"),
])
def test_a_bad_sign_in_option_is_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DashboardConfig(coordinator="127.0.0.1:1", **options)  # type: ignore[arg-type]
