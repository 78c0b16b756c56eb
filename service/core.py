"""What the routers share: the `Service` (models, engines, the host pool, readiness, and `serve`,
the wrapper every task request runs in), per-request `Timing`, the streamed response, the error
response. Routers find the app's Service at `request.app.state.service`; nothing here imports the
app (service/app.py) or a router."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from longdoc.service import host as H
from longdoc.service.batcher import DecodeScheduler, EncoderBatcher, RequestState, WorkerSlot
from longdoc.service.batching import BatchingPolicy
from longdoc.service.errors import InvalidRequest, ModelNotFound, ServiceError, ShuttingDown, error_body
from longdoc.service.metrics import Metrics, length_buckets, length_label
from longdoc.service.settings import Settings, choose_default_models
from longdoc.service.validation import ErrorResponse, Limits
from longdoc.service.workers import ModelInfo, Worker

log = logging.getLogger("longdoc.service")
TASKS = ("qa", "summarize", "classify", "embed")
# the metrics' endpoint label of each task route: the task, and OpenAI's /v1/embeddings beside TEI's /embed
ENDPOINTS = {"/v1/qa": "qa", "/v1/summarize": "summarize", "/v1/classify": "classify", "/v1/embeddings": "embeddings",
             "/embed": "embed"}
WorkerFactory = Callable[[str, Path, str, Settings], Worker]


@dataclass(eq=False)
class ServedModel:
    info: ModelInfo
    devices: list[str]
    engine: EncoderBatcher | DecodeScheduler
    length_bounds: tuple[int, ...]


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
    """What the app's lifespan owns: models, engines, the host pool, readiness."""

    def __init__(self, settings: Settings, worker_factory: WorkerFactory, host: bool = True,
                 engine: str | None = None):
        """`host`: run the host pool (not in an engine process: its front ends do that work);
        `engine`: a front end's, the engine process's socket (service/frontends.py): the models'
        engines are remote, the workers are the engine's."""
        self.settings = settings
        self.worker_factory = worker_factory
        self.with_host, self.engine_path, self.engine_client = host, engine, None
        # batch-token histogram up to the largest device budget, and at least 16384 so that a long
        # window that runs alone over a small (CPU) budget still lands in a finite bucket
        budget = max(settings.batch_tokens_for(d) for d in settings.devices)
        self.metrics = Metrics(max(budget, 16384), settings.max_batch_size)
        self.models: dict[str, ServedModel] = {}
        self.defaults: dict[str, str] = {}
        self.host: H.HostPool | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = False
        self.draining = False
        self.drain_deadline = float("inf")
        self.drain_expired = asyncio.Event()  # set when the grace is over: what is left is answered 503
        self.in_flight = 0  # requests being served (streams until their last event), as logged at shutdown
        self.limits = Limits(settings.max_document_bytes, settings.max_documents,
                             settings.request_timeout_s, settings.max_request_timeout_s)
        self.metrics.track_readiness(self.is_ready)  # longdoc_ready answers what /readyz answers

    async def start(self) -> None:
        s = self.settings
        self.loop = asyncio.get_running_loop()  # begin_drain() is called from a signal handler
        if self.engine_path is not None:  # a front end: the engine process's models, each behind a remote engine
            await self._connect_engine()
        else:
            await self._load_models()
        if self.with_host:
            self.host = H.HostPool({n: m.info for n, m in self.models.items()}, s.host_process_count(),
                                   s.tokenizer_threads)
            await asyncio.to_thread(self.host.start)
        self.defaults = choose_default_models(s.default_models, {n: m.info.task for n, m in self.models.items()})
        log.info("default models: %s", ", ".join(f"{task}={name}" for task, name in self.defaults.items()))
        self.ready = True
        self.metrics.refresh_ready()
        log.info("ready: %s", ", ".join(f"{n} ({m.info.task})" for n, m in self.models.items()))

    async def _load_models(self) -> None:
        s = self.settings
        for name, directory in s.models.items():
            slots = []
            for i, device in enumerate(s.devices):
                factory = lambda name=name, directory=directory, device=device: self._load(name, directory, device)  # noqa: E731
                worker = await asyncio.to_thread(factory)
                slots.append(WorkerSlot(factory, worker, i, s.worker_restart_backoff_s,
                                        s.worker_restart_max_backoff_s))
            info = slots[0].worker.info
            if info.task not in TASKS:
                raise ValueError(f"model {name}: task {info.task!r} is not served (serving {', '.join(TASKS)})")
            if info.task == "summarize":
                for extra in slots[1:]:  # one decoding loop per model (see docs/service.md)
                    extra.close()
                engine = DecodeScheduler(name, slots[0], self.metrics, s.max_decode_batch, s.max_queue_tokens,
                                         small_share=s.small_request_share, endpoint=info.task,
                                         max_queue_wait_s=s.max_queue_wait_s)
                devices = [s.devices[0]]
            else:
                policy = BatchingPolicy(
                    # each worker passes its own budget (batch_tokens_for its device); this is the fallback
                    max_batch_tokens=max(s.batch_tokens_for(d) for d in s.devices),
                    max_batch_size=s.max_batch_size if s.batching else 1,
                    max_wait_s=s.max_wait_ms / 1000.0 if s.batching else 0.0,
                    bucket_size=info.block_size,
                )
                engine = EncoderBatcher(name, slots, policy, self.metrics, s.max_queue_tokens,
                                        pad_id=int(info.special_tokens.get("pad") or 0),
                                        small_share=s.small_request_share, endpoint=info.task,
                                        max_queue_wait_s=s.max_queue_wait_s)
                devices = list(s.devices)
            engine.start()
            self.models[name] = ServedModel(info, devices, engine, length_buckets(info.max_length, info.block_size))

    async def _connect_engine(self) -> None:
        from longdoc.service.frontends import EngineClient, remote_engine

        self.engine_client, models = await EngineClient.connect(self.engine_path)
        self.engine_client.on_health = self.metrics.refresh_ready
        for name, (info, devices, bounds) in models.items():
            self.models[name] = ServedModel(info, devices, remote_engine(self.engine_client, name, info.task), bounds)

    def _load(self, name: str, directory: Path, device: str) -> Worker:
        worker = self.worker_factory(name, directory, device, self.settings)
        if self.settings.warmup:
            worker.warmup()
        return worker

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Shutdown begins (a signal; called from the signal handler): not ready, no new requests;
        the grace period (`shutdown_grace_s` unless given) starts now, and when it is over every
        request still running is answered 503 shutting_down by `serve` (streams get `event:
        error`). A later call with a shorter grace brings its end forward (a second Ctrl-C: 0)."""
        deadline = time.monotonic() + (self.settings.shutdown_grace_s if grace_s is None else grace_s)
        first = not self.draining
        if first or deadline < self.drain_deadline:
            self.draining = True
            self.drain_deadline = deadline
            self.metrics.refresh_ready()
            if self.loop is not None:  # logged and timed on the loop, not in the signal handler
                self.loop.call_soon_threadsafe(self._arm_drain_timer, first)

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
        if self.engine_client is not None:
            await self.engine_client.close()
        if self.host:
            self.host.shutdown()

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
        """fn(info, *args) (service/host.py) in the host pool, given up at the request's deadline."""
        return await self.host.call(deadline, what, fn, info, *args)

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
                if watcher not in done:  # the shutdown grace is over: answer before uvicorn gives up
                    m.failures.labels(endpoint, ShuttingDown.reason).inc()
                    return error_response(ShuttingDown(
                        f"server is shutting down; the request did not finish within the "
                        f"{self.settings.shutdown_grace_s:g} s grace period; retry"))
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
