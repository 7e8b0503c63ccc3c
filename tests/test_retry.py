"""`sinkflex.retry.poll_until`: the project's one poll-until loop (tenacity)."""

from __future__ import annotations

import time

import pytest

from sinkflex.retry import poll_until


def test_poll_until_returns_the_first_truthy_value():
    calls = []

    def check():
        calls.append(time.monotonic())
        return len(calls) >= 3 and f"ready after {len(calls)}"

    assert poll_until(check, 5.0, every_s=0.01) == "ready after 3"
    assert len(calls) == 3


def test_poll_until_gives_the_last_value_when_time_is_up():
    t0 = time.monotonic()
    assert poll_until(lambda: None, 0.2, every_s=0.02) is None
    assert 0.2 <= time.monotonic() - t0 < 2.0


def test_poll_until_raises_what_the_check_raises():
    def check():
        raise RuntimeError("exited before it was ready")

    with pytest.raises(RuntimeError, match="exited"):
        poll_until(check, 5.0)


def test_poll_until_backs_off_up_to_its_cap():
    calls = []
    poll_until(lambda: calls.append(time.monotonic()) or len(calls) >= 5, 10.0, every_s=0.02, max_every_s=0.08)
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert gaps[0] < gaps[-1] and max(gaps) < 0.5
