"""Polling with tenacity: `poll_until`, the one poll-until loop of the project.

Retries of failed calls use tenacity directly where they happen (the trajectory buffer's Redis
calls, the rollout service's ScoreBatch); a wait for a condition (a server SERVING, a policy
version served, a process ready) calls `poll_until`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryError,
    Retrying,
    retry_if_result,
    stop_after_delay,
    stop_never,
    wait_exponential,
    wait_fixed,
)

T = TypeVar("T")


def poll_until(check: Callable[[], T], timeout_s: float | None, every_s: float = 0.5,
               max_every_s: float | None = None) -> T:
    """Calls `check` until it returns a truthy value, waiting `every_s` seconds between calls (doubling
    up to `max_every_s` when given), for at most `timeout_s` seconds (None: no limit).

    Returns:
        the first truthy value, or the last (falsy) one when `timeout_s` passed.

    Raises:
        whatever `check` raises (not retried).
    """
    wait = wait_fixed(every_s) if max_every_s is None else wait_exponential(multiplier=every_s, min=every_s, max=max_every_s)
    stop = stop_never if timeout_s is None else stop_after_delay(max(0.0, timeout_s))
    try:
        return Retrying(stop=stop, wait=wait, retry=retry_if_result(lambda r: not r), reraise=True)(check)
    except RetryError as err:
        return err.last_attempt.result()
