"""What the routers share: the `Service` (models and their engines, the host threads, readiness,
and `serve`, the wrapper every task request runs in), per-request `Timing`, the streamed response, the error
response. Routers find the app's Service at `request.app.state.service`; nothing here imports the
app (service/app.py) or a router."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from longdoc.service.batcher import RequestState
from longdoc.service.engine import ModelSource, ServedModel
from longdoc.service.errors import (
    DeadlineExceeded, InvalidRequest, ModelNotFound, ServiceError, ShuttingDown, Unavailable, error_body,
)
from longdoc.service.metrics import Metrics, length_label
from longdoc.service.settings import Settings, choose_default_models
from longdoc.service.validation import ErrorResponse, Limits
from longdoc.service.workers import ModelInfo

log = logging.getLogger("longdoc.service")


def _read_outcome(task: asyncio.Future) -> None:
    """Reads a finished task nobody awaits, so that its error is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


def arrived(request: Request) -> float:
    """When the request's first byte was handled (the body-limit middleware's stamp), monotonic."""
    return getattr(request.state, "arrived", None) or time.monotonic()


@dataclass
class Timing:
    """Per-stage seconds, returned as x-*-time headers (milliseconds, as TEI does)."""

    start: float = field(default_factory=time.monotonic)
    tokenize: float = 0.0
    queue: float = 0.0
    inference: float = 0.0

    def headers(self) -> dict[str, str]:
        total = time.monotonic() - self.start
        ms = lambda s: f"{s * 1000:.2f}"  # noqa: E731
        return {"x-total-time": ms(total), "x-tokenization-time": ms(self.tokenize),
                "x-queue-time": ms(self.queue), "x-inference-time": ms(self.inference)}


class Service:
    """What the app's lifespan owns: the models and their engines (from `source`: this process's
    workers and batchers, or an engine process's), the host threads, readiness."""

    def __init__(self, settings: Settings, source: ModelSource):
        self.settings = settings
        self.source = source
        # batch-token histogram up to the largest device budget, and at least 16384 so that a long
        # window that runs alone over a small (CPU) budget still lands in a finite bucket
        budget = max(settings.batch_tokens_for(d) for d in settings.devices)
        self.metrics = Metrics(max(budget, 16384), settings.max_batch_size)
        self.models: dict[str, ServedModel] = {}
        self.defaults: dict[str, str] = {}
        self.host: ThreadPoolExecutor | None = None  # tokenization, windows, answer shaping (service/host.py)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = False
        self.draining = False
        self.drain_deadline = float("inf")
        self.drain_started, self.drain_cut_after = 0.0, None  # seconds into the grace of a second signal
        self.drain_expired = asyncio.Event()  # set when the grace is over: what is left is answered 503
        self.in_flight = 0  # requests being served (streams until their last event), as logged at shutdown
        self.limits = Limits(settings.max_document_bytes, settings.max_documents,
                             settings.request_timeout_s, settings.max_request_timeout_s)
        self.metrics.track_readiness(self.is_ready)  # longdoc_ready answers what /readyz answers

    async def start(self) -> None:
        s = self.settings
        self.loop = asyncio.get_running_loop()  # begin_drain() is called from a signal handler
        self.models = await self.source.open(self.metrics)
        self.host = ThreadPoolExecutor(max_workers=s.tokenizer_threads, thread_name_prefix="tokenize")
        self.defaults = choose_default_models(s.default_models, {n: m.info.task for n, m in self.models.items()})
        log.info("default models: %s", ", ".join(f"{task}={name}" for task, name in self.defaults.items()))
        self.ready = True
        self.metrics.refresh_ready()
        log.info("ready: %s", ", ".join(f"{n} ({m.info.task})" for n, m in self.models.items()))

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Shutdown begins (a signal; called from the signal handler): not ready, no new requests;
        the grace period (`shutdown_grace_s` unless given) starts now, and when it is over every
        request still running is answered 503 shutting_down by `serve` (streams get `event:
        error`). A later call with a shorter grace brings its end forward (a second Ctrl-C: 0)."""
        now = time.monotonic()
        deadline = now + (self.settings.shutdown_grace_s if grace_s is None else grace_s)
        first = not self.draining
        if first or deadline < self.drain_deadline:
            if first:
                self.drain_started = now
            else:  # the grace cut short, `shutdown_message` says when
                self.drain_cut_after = now - self.drain_started
            self.draining = True
            self.drain_deadline = deadline
            self.metrics.refresh_ready()
            if self.loop is not None:  # logged and timed on the loop, not in the signal handler
                self.loop.call_soon_threadsafe(self._arm_drain_timer, first)

    def shutdown_message(self, what: str) -> str:
        """The 503 shutting_down of a request (`what`: "request", "stream") still running when the
        grace is over: the grace ran out, or a second signal ended it early."""
        grace = self.settings.shutdown_grace_s
        if self.drain_cut_after is None:
            return f"server is shutting down; the {what} did not finish within the {grace:g} s grace period; retry"
        return (f"server is shutting down: a second signal ended the {grace:g} s grace period after "
                f"{self.drain_cut_after:.1f} s, before the {what} finished; retry")

    def _arm_drain_timer(self, first: bool) -> None:
        left = max(0.0, self.drain_deadline - time.monotonic())
        if first:
            log.log(logging.WARNING if self.in_flight else logging.INFO,
                    "shutting down: draining %d requests for up to %.0f s (signal again to answer them 503 now)",
                    self.in_flight, left)
        else:
            log.warning("shutting down now: %d requests answered 503 shutting_down", self.in_flight)
        self.loop.call_later(left, self.drain_expired.set)

    async def stop(self) -> None:
        self.begin_drain()
        self.ready = False
        self.metrics.refresh_ready()
        for m in self.models.values():  # whatever is still queued, within what is left of the grace
            await m.engine.drain(max(0.0, self.drain_deadline - time.monotonic()))
        for m in self.models.values():
            await m.engine.close()
        await self.source.close()
        if self.host is not None:
            self.host.shutdown(wait=False, cancel_futures=True)

    def is_ready(self) -> bool:
        return self.ready and not self.draining and all(m.engine.healthy() for m in self.models.values())

    def model_for(self, task: str, name: str | None) -> ServedModel:
        if name is None:
            if task not in self.defaults:
                raise ModelNotFound(f"no {task} model is loaded")
            name = self.defaults[task]
        m = self.models.get(name)
        if m is None:
            raise ModelNotFound(f"unknown model {name!r}; loaded: {', '.join(self.models) or 'none'}")
        if m.info.task != task:
            raise InvalidRequest(f"model {name!r} is a {m.info.task} model, not {task}")
        return m

    async def host_work(self, deadline: float, what: str, fn, info: ModelInfo, *args):
        """fn(info, *args) (service/host.py) in the host threads, given up at the request's
        deadline (504; the call finishes unseen)."""
        if self.host is None:
            raise Unavailable("server is not started")
        future = asyncio.get_running_loop().run_in_executor(self.host, fn, info, *args)
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(f"deadline exceeded during {what}") from None

    async def serve(self, request: Request, endpoint: str, work: Callable[[RequestState, Timing], Any]) -> Response:
        """Run one request's `work(state, timing)`, which returns (response, model, tokens): the
        in-flight gauge, the disconnect watch (499), the shutdown grace (503 shutting_down when it
        runs out), error mapping, request metrics and the x-*-time headers."""
        timing = Timing(arrived(request))
        m = self.metrics
        if self.draining:
            m.failures.labels(endpoint, ShuttingDown.reason).inc()
            return error_response(ShuttingDown("server is shutting down"))
        m.in_flight.labels(endpoint).inc()
        self.in_flight += 1
        streaming = False  # a stream leaves in_flight when its last event is sent
        state = RequestState(deadline=float("inf"), started=timing.start)
        task = asyncio.ensure_future(work(state, timing))
        grace_over = asyncio.ensure_future(self.drain_expired.wait())

        async def watch_disconnect():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            done, _ = await asyncio.wait({task, watcher, grace_over}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:  # its queued/running work stops
                state.cancelled = True
                task.cancel()
                # its work may still end in an error of its own (the engine's Cancelled can win the
                # race with the cancellation): nobody awaits it any more, so it is read here
                task.add_done_callback(_read_outcome)
                if watcher not in done:  # the shutdown grace is over: answer before uvicorn gives up
                    m.failures.labels(endpoint, ShuttingDown.reason).inc()
                    return error_response(ShuttingDown(self.shutdown_message("request")))
                m.failures.labels(endpoint, "cancelled").inc()  # the client went away
                return Response(status_code=499)
            try:
                response, model, n_tokens = task.result()
            except ServiceError as exc:
                state.cancelled = True  # whatever of this request is still queued is dropped
                m.failures.labels(endpoint, exc.reason).inc()
                response = error_response(exc)
                model, n_tokens = None, 0
            except Exception:
                state.cancelled = True
                log.exception("%s failed", endpoint)
                m.failures.labels(endpoint, "internal").inc()
                return error_response(ServiceError("internal error"))
            if model is not None:
                label = (model.info.name, endpoint, length_label(n_tokens, model.length_bounds))

                def record() -> None:
                    m.request_seconds.labels(*label).observe(time.monotonic() - timing.start)
                    m.tokenize_seconds.labels(*label).observe(timing.tokenize)
                    m.queue_seconds.labels(*label).observe(timing.queue)
                    m.inference_seconds.labels(*label).observe(timing.inference)

                if isinstance(response, MeasuredStream):  # measured to its last event, not to here
                    first_event = time.monotonic()

                    def stream_ended() -> None:
                        timing.inference = time.monotonic() - first_event
                        record()
                        m.in_flight.labels(endpoint).dec()
                        self.in_flight -= 1

                    response.on_end, streaming = stream_ended, True
                else:
                    record()
            response.headers.update(timing.headers())
            return response
        finally:
            watcher.cancel()
            grace_over.cancel()
            if not streaming:
                m.in_flight.labels(endpoint).dec()
                self.in_flight -= 1


class MeasuredStream(StreamingResponse):
    """A streamed answer whose request ends with its last event: `on_end()` runs once the stream
    is over (done, failed or its client gone), not when the route returns the response object."""

    on_end: Callable[[], None] | None = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_end is not None:
                self.on_end()


def error_response(exc: ServiceError) -> JSONResponse:
    return JSONResponse(error_body(exc), exc.status, headers=exc.headers)


# the error responses every task route documents
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (401, 404, 413, 415, 422, 429, 503, 504)}
