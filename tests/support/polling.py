"""Waiting for a state another task, thread or process brings about: the one place tests poll.

A test asserts the state it waits for, with a bound, and fails naming what it saw; it never
sleeps a fixed time and hopes (``tests/test_house.py`` forbids that). ``wait_until`` is for a
test's own thread, ``until`` for a coroutine on the event loop, which keeps running the tasks
the test waits on between checks.

The pause between checks starts short and doubles up to ``INTERVAL_S``: a state that comes at
once is seen at once, and one that takes a while costs few checks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

INTERVAL_S = 0.05
FIRST_INTERVAL_S = 0.002


def wait_until(
    condition: Callable[[], object],
    within: float,
    what: str | Callable[[], str] = "condition",
) -> float:
    """The seconds until ``condition`` held; an AssertionError naming ``what`` past ``within``.

    ``what`` may be a callable, called only on failure, to say what was seen instead.
    """
    start = time.monotonic()
    if not wait_until_or_not(condition, within):
        raise AssertionError(f"{_said(what)}: not within {within} s")
    return time.monotonic() - start


def wait_until_or_not(condition: Callable[[], object], within: float) -> bool:
    """Whether ``condition`` held within ``within`` seconds."""
    deadline = time.monotonic() + within
    pauses = _pauses()
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(next(pauses))
    return True


async def until(
    condition: Callable[[], object],
    within: float,
    what: str | Callable[[], str] = "condition",
) -> float:
    """The seconds until ``condition`` held, checked between turns of the running loop."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + within
    pauses = _pauses()
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"{_said(what)}: not within {within} s")
        await asyncio.sleep(next(pauses))
    return loop.time() - start


def _pauses() -> Iterator[float]:
    pause = FIRST_INTERVAL_S
    while True:
        yield pause
        pause = min(pause * 2, INTERVAL_S)


def _said(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()
