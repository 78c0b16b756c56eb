"""The one restart loop: start a thing that went down again, with back-off, until it is up.

    went down -> wait `delay` -> start() -> up: back-off reset, done
                     ^             |
                     '-- doubled --'  raised (it did not come up)

Two things are restarted this way: a worker whose run raised, replaced from its factory
(service/batcher.py `WorkerSlot.restart`: up once the factory returns), and a front-end process that
exited, started again (service/frontends.py `FrontEnds`: up once it has run a minute; `start` raises
`NotUp` when it exits sooner). Shutdown interrupts a wait: `stop` set, or the task cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, TypeVar

log = logging.getLogger("longdoc.service")
T = TypeVar("T")


class Backoff:
    """The wait before each attempt: `delay` starts at `first_s` (at most `max_s`) and doubles, from
    at least 0.1 s, up to `max_s` with each attempt that fails; `reset` once up."""

    def __init__(self, first_s: float, max_s: float):
        self.first_s, self.max_s = first_s, max_s
        self.delay = min(first_s, max_s)

    def failed(self) -> float:
        """One more failed attempt: the delay before the next one."""
        self.delay = min(max(self.delay * 2, 0.1), self.max_s)
        return self.delay

    def reset(self) -> None:
        self.delay = min(self.first_s, self.max_s)


class NotUp(Exception):
    """`start` started the thing but it went down again before it counted as up (logged as its
    message, without a traceback: nothing in the supervisor failed)."""


async def restart_until_up(start: Callable[[], Awaitable[T]], backoff: Backoff, what: str,
                           stop: asyncio.Event | None = None,
                           waiting: Callable[[float], None] = lambda delay: None) -> T | None:
    """Wait `backoff.delay`, then `await start()`; each time it raises, wait the doubled delay and
    call it again. Returns what `start` returned once it did not raise (the back-off reset), or None
    if `stop` is set first. `waiting(delay)` is told each wait as it begins (a Retry-After)."""
    while True:
        waiting(backoff.delay)
        if await stopped_within(stop, backoff.delay):
            return None
        try:
            up = await start()
        except Exception as exc:
            if stop is not None and stop.is_set():
                return None  # it went down because everything is stopping
            delay = backoff.failed()
            if isinstance(exc, NotUp):
                log.error("%s; starting it again in %.1f s", exc, delay)
            else:
                log.exception("restarting %s failed; retrying in %.1f s", what, delay)
            continue
        backoff.reset()
        return up


async def stopped_within(stop: asyncio.Event | None, seconds: float) -> bool:
    """Wait `seconds`, or less if `stop` is set meanwhile: whether it was."""
    if stop is None:
        await asyncio.sleep(seconds)
        return False
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass
    return stop.is_set()
