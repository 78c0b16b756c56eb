"""The one restart loop (service/restarts.py), of a failed worker and of an exited front end: its
back-off doubles while attempts fail and resets once up, and shutdown interrupts a wait."""

import asyncio
import logging

import pytest

from longdoc.service.restarts import Backoff, NotUp, restart_until_up


def test_the_back_off_doubles_to_its_maximum_and_resets():
    b = Backoff(0.5, 3.0)
    assert [b.delay] + [b.failed() for _ in range(4)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.delay == 0.5
    zero = Backoff(0.0, 10.0)  # no pause at first, then from 0.1 s
    assert [zero.delay, zero.failed(), zero.failed()] == [0.0, 0.1, 0.2]
    assert Backoff(5.0, 1.0).delay == 1.0


def attempts(*outcomes):
    """A `start` that raises or returns each of `outcomes` in turn; `calls` counts them."""
    outcomes = list(outcomes)

    async def start():
        start.calls += 1
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    start.calls = 0
    return start


def test_each_failed_attempt_doubles_the_wait_and_being_up_resets_it(caplog):
    backoff, waits = Backoff(0.0, 0.2), []
    start = attempts(NotUp("front end 0 (pid 1) exited with 1"), RuntimeError("no memory"), "up",
                     RuntimeError("again"), "up again")

    async def twice():
        first = await restart_until_up(start, backoff, "worker 0 of qa", waiting=waits.append)
        assert backoff.delay == 0.0  # up: the next failure waits the first delay again
        return first, await restart_until_up(start, backoff, "worker 0 of qa", waiting=waits.append)

    with caplog.at_level(logging.ERROR, logger="longdoc.service"):
        assert asyncio.run(twice()) == ("up", "up again")
    assert waits == [0.0, 0.1, 0.2, 0.0, 0.1]
    assert start.calls == 5 and backoff.delay == 0.0
    records = [(r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert records == [
        ("front end 0 (pid 1) exited with 1; starting it again in 0.1 s", False),  # went down: no traceback
        ("restarting worker 0 of qa failed; retrying in 0.2 s", True),  # a failure: its traceback
        ("restarting worker 0 of qa failed; retrying in 0.1 s", True),
    ]


def test_stop_interrupts_the_wait_and_nothing_is_started():
    async def scenario():
        stop, waiting = asyncio.Event(), asyncio.Event()
        start = attempts("up")
        task = asyncio.create_task(restart_until_up(start, Backoff(600.0, 600.0), "front end 0", stop,
                                                    waiting=lambda delay: waiting.set()))
        await waiting.wait()  # in its 600 s wait
        stop.set()
        assert await asyncio.wait_for(task, 10) is None
        assert start.calls == 0

        waiting.clear()
        cancelled = asyncio.create_task(restart_until_up(start, Backoff(600.0, 600.0), "worker 0 of qa",
                                                         waiting=lambda delay: waiting.set()))
        await waiting.wait()
        cancelled.cancel()  # a worker's restart ends with its batcher's task
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(cancelled, 10)
        assert start.calls == 0

    asyncio.run(scenario())


def test_a_thing_that_goes_down_because_of_the_stop_is_not_started_again(caplog):
    stop = asyncio.Event()

    async def start():  # the front end exits because the engine forwarded SIGTERM
        start.calls += 1
        stop.set()
        raise NotUp("front end 0 (pid 1) exited with 0")

    start.calls = 0
    with caplog.at_level(logging.ERROR, logger="longdoc.service"):
        assert asyncio.run(restart_until_up(start, Backoff(0.0, 1.0), "front end 0", stop)) is None
    assert start.calls == 1 and caplog.records == []
