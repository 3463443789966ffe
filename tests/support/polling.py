"""Waiting, in a test's own thread, for something another process does."""

from __future__ import annotations

import time
from collections.abc import Callable

INTERVAL_S = 0.05


def wait_until(condition: Callable[[], bool], within: float, what: str = "condition") -> float:
    """The seconds until ``condition`` held; an AssertionError naming ``what`` past ``within``."""
    start = time.monotonic()
    if not wait_until_or_not(condition, within):
        raise AssertionError(f"{what}: not within {within} s")
    return time.monotonic() - start


def wait_until_or_not(condition: Callable[[], bool], within: float) -> bool:
    """Whether ``condition`` held within ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(INTERVAL_S)
    return True
