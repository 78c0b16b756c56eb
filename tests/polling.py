"""Waiting for a condition that another thread, task or process brings about: poll it until it
holds, and fail saying what did not happen once a deadline passes. The tests' way to order events
they do not control (no sleep of a guessed length for ordering)."""

from __future__ import annotations

import asyncio
import inspect
import time


def until(condition, what: str, timeout_s: float = 30.0, every_s: float = 0.01):
    """Call `condition()` until it returns something true (returned); after `timeout_s`, fail with
    `what` (what should have happened)."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"after {timeout_s} s, still not: {what}"
        time.sleep(every_s)
    return result


async def until_async(condition, what: str, timeout_s: float = 30.0, every_s: float = 0.01):
    """`until` on the event loop: `condition()` may be a coroutine function; waits with asyncio.sleep
    (the app under test runs on the same loop)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        assert time.monotonic() < deadline, f"after {timeout_s} s, still not: {what}"
        await asyncio.sleep(every_s)
