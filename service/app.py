"""The FastAPI app: routes -> validation -> tokenization (host pool) -> batcher -> answer shaping
(host pool) -> response.

`create_app(settings, worker_factory=None)` builds an app whose lifespan loads every model on
every device (workers), warms each up at the maximum length, starts one batcher task per
model and the host pool (service/host.py: tokenization, windows and answer shaping in processes
beside the event loop), and tears all of it down after. The routes never touch a worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from longdoc import __version__
from longdoc.export import windows as W
from longdoc.model.search import resolve_settings
from longdoc.model.tokenization import SummaryStream, summary_text
from longdoc.service import host as H
from longdoc.service.access import AccessControl, AccessMiddleware
from longdoc.service.batcher import DecodeScheduler, EncoderBatcher, RequestState, WorkerSlot
from longdoc.service.batching import BatchingPolicy
from longdoc.service.errors import (
    InvalidRequest, ModelNotFound, RequestTimeout, ServiceError, ShuttingDown, TooLarge,
    Unavailable, UnsupportedMediaType, error_body,
)
from longdoc.service.metrics import Metrics, length_buckets, length_label
from longdoc.service.settings import Settings, choose_default_models
from longdoc.service.validation import (
    ClassifyJob, ClassifyRequest, ClassifyResponse, ErrorResponse, Limits, ModelsResponse, QAJob, QARequest,
    QAResponse, SSE_EVENT_SCHEMA, SummarizeJob, SummarizeRequest, SummarizeResponse, scan_json_tokens,
    validate_classify, validate_qa, validate_summarize,
)
from longdoc.service.workers import ModelInfo, Worker, onnx_worker_factory

log = logging.getLogger("longdoc.service")
TASKS = ("qa", "summarize", "classify")
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

    def __init__(self, settings: Settings, worker_factory: WorkerFactory):
        self.settings = settings
        self.worker_factory = worker_factory
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
        self.host = H.HostPool({n: m.info for n, m in self.models.items()}, s.host_process_count(),
                               s.tokenizer_threads)
        await asyncio.to_thread(self.host.start)
        self.defaults = choose_default_models(s.default_models, {n: m.info.task for n, m in self.models.items()})
        log.info("default models: %s", ", ".join(f"{task}={name}" for task, name in self.defaults.items()))
        self.ready = True
        self.metrics.refresh_ready()
        log.info("ready: %s", ", ".join(f"{n} ({m.info.task})" for n, m in self.models.items()))

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


# ---------------------------------------------------------------------------------------------
# the app


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


def _error(exc: ServiceError) -> JSONResponse:
    return JSONResponse(error_body(exc), exc.status, headers=exc.headers)


_ERRORS = {code: {"model": ErrorResponse} for code in (401, 404, 413, 415, 422, 429, 503, 504)}
_JSON_POSTS = ("/v1/qa", "/v1/summarize", "/v1/classify")  # the routes BodyLimitMiddleware guards


def _body_parse_error(cause: BaseException | None) -> InvalidRequest:
    """Why a UTF-8 body failed to parse as JSON, where FastAPI only answers 400 "error parsing"."""
    if isinstance(cause, RecursionError):
        return InvalidRequest("body is not valid JSON: nested too deeply")
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return InvalidRequest(f"body is not valid JSON: an integer over {sys.get_int_max_str_digits()} digits")
    return InvalidRequest("body is not valid JSON")


class BodyLimitMiddleware:
    """Before any parsing: POST bodies to the task routes must be JSON and at most `max_bytes`
    (413 otherwise). Other paths and methods pass untouched, to be answered 404 or 405.

    A body must arrive whole within `timeout_s` (408: a client that sends part and goes quiet
    holds nothing for long), and all bodies buffered by requests not yet answered stay within
    `max_bytes_in_flight` (503 with Retry-After over it, before the rest of that body is read).
    Bodies with more JSON strings and separators than `max_json_tokens` are refused (413) before
    any parse (`scan_json_tokens`)."""

    def __init__(self, app, max_bytes: int, max_json_tokens: int, timeout_s: float, max_bytes_in_flight: int):
        self.app = app
        self.max_bytes = max_bytes
        self.max_json_tokens = max_json_tokens
        self.timeout_s = timeout_s
        self.max_bytes_in_flight = max_bytes_in_flight
        self.bytes_in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":  # a request's deadline counts from here (request.state.arrived)
            scope.setdefault("state", {})["arrived"] = time.monotonic()
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _JSON_POSTS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            return await _error(UnsupportedMediaType(
                f"content type {ctype.decode('latin-1') or 'missing'}: send application/json"))(scope, receive, send)
        length = headers.get(b"content-length")
        too_large = TooLarge(f"request body over {self.max_bytes} bytes")
        busy = Unavailable("too many request bytes in flight; retry later", {"Retry-After": "1"})
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                return await _error(too_large)(scope, receive, send)
            if int(length) > self.max_bytes_in_flight - self.bytes_in_flight:
                return await _error(busy)(scope, receive, send)
        held = 0  # this request's share of bytes_in_flight, until it is answered
        try:
            # read the whole (bounded) body first: size and UTF-8 are checked before any parsing
            chunks, seen = [], 0
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    late = RequestTimeout(f"request body not received within {self.timeout_s:g} s")
                    return await _error(late)(scope, receive, send)
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                seen += len(chunk)
                if seen > self.max_bytes:
                    return await _error(too_large)(scope, receive, send)
                if self.bytes_in_flight + len(chunk) > self.max_bytes_in_flight:
                    return await _error(busy)(scope, receive, send)
                self.bytes_in_flight += len(chunk)
                held += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            del chunks  # the body is held once while the request runs, as bytes_in_flight counts it
            await self._forward(body, scope, receive, send)
        finally:
            self.bytes_in_flight -= held

    async def _forward(self, body: bytes, scope, receive, send):
        """The UTF-8 check, then the app, which reads the buffered body."""
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return await _error(InvalidRequest(f"body is not valid UTF-8 (byte {exc.start})"))(scope, receive, send)
        try:  # before any parse, in chunks: the event loop runs between them
            for _ in scan_json_tokens(body, self.max_json_tokens):
                await asyncio.sleep(0)
        except ServiceError as exc:
            return await _error(exc)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def create_app(settings: Settings | None = None, worker_factory: WorkerFactory | None = None) -> FastAPI:
    settings = settings or Settings()
    service = Service(settings, worker_factory or onnx_worker_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await service.start()
        except BaseException:
            await service.stop()
            raise
        yield
        await service.stop()

    # /docs and /redoc load their scripts from this package, not a CDN: a machine without internet
    # access (many clusters) shows them too
    app = FastAPIOffline(title="longdoc", version=__version__, lifespan=lifespan,
                         description="Question answering, summarization and classification over long documents.")
    app.state.service = service
    body_limit = settings.max_document_bytes * settings.max_documents + 65536
    # a request's strings and separators: its fields (a dozen keys and values) and documents
    app.add_middleware(BodyLimitMiddleware, max_bytes=body_limit, max_json_tokens=64 + 4 * settings.max_documents,
                       timeout_s=settings.body_timeout_s, max_bytes_in_flight=settings.max_body_bytes_in_flight)
    access = AccessControl(settings.all_api_keys(), settings.rate_limit_per_s, settings.rate_limit_burst,
                           settings.auth_failures_per_s, settings.auth_failure_burst)
    if not access.enabled and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without API keys: anyone who can reach it may call it "
                    "(set LONGDOC_API_KEYS or LONGDOC_API_KEY_FILE, docs/deploy.md)", settings.host)

    def count_failure(path: str, exc: ServiceError) -> None:
        endpoint = path.rsplit("/", 1)[-1]
        if endpoint in TASKS:
            service.metrics.failures.labels(endpoint, exc.reason).inc()

    # added last, so outermost: a caller without a key gets no further (not even its body read)
    app.add_middleware(AccessMiddleware, access=access, open_paths=settings.open_paths,
                       on_refused=count_failure, error_response=_error)
    base_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's schema plus this server's own limits, so that clients generated from it
        agree with validation (sizes are in bytes of UTF-8 on the server, characters here)."""
        if app.openapi_schema is None:
            bodies = base_openapi()["components"]["schemas"]
            for name in ("QARequest", "SummarizeRequest", "ClassifyRequest"):
                props = bodies[name]["properties"]
                props["documents"]["maxItems"] = settings.max_documents
                for text in (props["document"], props["documents"]["items"], props.get("question", {})):
                    text["maxLength"] = settings.max_document_bytes
                for option in props["timeout"]["anyOf"]:
                    if option["type"] == "number":
                        option["maximum"] = settings.max_request_timeout_s
            if access.enabled:  # every operation but the open paths needs the bearer key
                bearer = {"type": "http", "scheme": "bearer"}
                app.openapi_schema["components"]["securitySchemes"] = {"apiKey": bearer}
                for path, operations in app.openapi_schema["paths"].items():
                    if path not in settings.open_paths:
                        for operation in operations.values():
                            operation["security"] = [{"apiKey": []}]
            caps = [m.info.max_new_tokens for m in service.models.values() if m.info.task == "summarize"]
            if caps:  # the largest loaded model's (a model with a smaller cap answers 422 over it)
                for option in bodies["SummarizeRequest"]["properties"]["max_new_tokens"]["anyOf"]:
                    if option["type"] == "integer":
                        option["maximum"] = min(option["maximum"], max(caps))
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):  # raised before serve() runs
        count_failure(request.url.path, exc)
        return _error(exc)

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception):  # Starlette's would be plain text
        return _error(ServiceError("internal error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            if e.get("type") == "json_invalid":  # loc is ("body", character offset)
                error = (e.get("ctx") or {}).get("error", "not valid JSON")
                parts.append(f"body is not valid JSON: {error} at character {e['loc'][-1]}")
                continue
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            msg = e.get("msg", "invalid")
            if e.get("type") == "json_invalid":
                msg = "body is not valid JSON (or not valid UTF-8)"
            elif e.get("type") == "value_error":  # our validators' own sentences, which name the field
                msg = str(e.get("ctx", {}).get("error", msg))
                where = "" if where == "body" else where
            parts.append(f"{where}: {msg}" if where else msg)
        return await _service_error(request, InvalidRequest("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's "error parsing the body"
            return await _service_error(request, _body_parse_error(exc.__cause__))
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": {"type": kind, "message": str(exc.detail)}}, exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def serve(request: Request, endpoint: str, work: Callable[[RequestState, Timing], Any]) -> Response:
        """Run one request: in-flight gauge, disconnect watch, error mapping, request metrics."""
        timing = Timing(arrived(request))
        m = service.metrics
        if service.draining:
            m.failures.labels(endpoint, ShuttingDown.reason).inc()
            return _error(ShuttingDown("server is shutting down"))
        m.in_flight.labels(endpoint).inc()
        service.in_flight += 1
        streaming = False  # a stream leaves in_flight when its last event is sent
        state = RequestState(deadline=float("inf"), started=timing.start)
        task = asyncio.ensure_future(work(state, timing))
        grace_over = asyncio.ensure_future(service.drain_expired.wait())

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
                    return _error(ShuttingDown(
                        f"server is shutting down; the request did not finish within the "
                        f"{settings.shutdown_grace_s:g} s grace period; retry"))
                m.failures.labels(endpoint, "cancelled").inc()  # the client went away
                return Response(status_code=499)
            try:
                response, model, n_tokens = task.result()
            except ServiceError as exc:
                state.cancelled = True  # whatever of this request is still queued is dropped
                m.failures.labels(endpoint, exc.reason).inc()
                response = _error(exc)
                model, n_tokens = None, 0
            except Exception:
                state.cancelled = True
                log.exception("%s failed", endpoint)
                m.failures.labels(endpoint, "internal").inc()
                return _error(ServiceError("internal error"))
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
                        service.in_flight -= 1

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
                service.in_flight -= 1

    # ---- QA
    @app.post("/v1/qa", response_model=QAResponse, responses=_ERRORS, tags=["tasks"])
    async def qa(body: QARequest, request: Request):
        """Answer a question from each document; long documents are read in overlapping windows."""
        job = validate_qa(body, request.headers.get("x-request-timeout"), service.limits, arrived(request))
        model = service.model_for("qa", job.common.model)

        async def work(state: RequestState, timing: Timing):
            state.deadline = job.common.deadline
            t = time.monotonic()
            prepared = await service.host_work(job.common.deadline, "tokenization", H.prepare_qa, model.info, job,
                                               settings.qa_stride, settings.max_document_tokens)
            timing.tokenize = time.monotonic() - t
            seqs = [pair for p in prepared for pair in zip(p.input_ids, p.token_type_ids)]
            results = await model.engine.submit(seqs, state)
            timing.queue = results[0].queue_s
            timing.inference = results[0].inference_s
            starts, ends, i = [], [], 0
            for p in prepared:
                rs = results[i : i + len(p.windows)]
                i += len(p.windows)
                starts.append([r.outputs["start_logits"] for r in rs])
                ends.append([r.outputs["end_logits"] for r in rs])
            spans = await service.host_work(job.common.deadline, "answer shaping", H.qa_spans, model.info,
                                            [(p.windows, p.offsets) for p in prepared], starts, ends, job.top_k,
                                            job.max_answer_tokens)
            out = []
            for doc, p, doc_spans in zip(job.common.documents, prepared, spans):
                service.metrics.windows.labels(model.info.name, "qa").observe(len(p.windows))
                out.append({
                    "answers": [{"text": doc[a:b], "start": a, "end": b, "score": score} for a, b, score in doc_spans],
                    "usage": {"tokens": p.n_tokens, "windows": len(p.windows), "truncated": False},
                })
            total = sum(p.n_tokens for p in prepared)
            return JSONResponse({"model": model.info.name, "results": out}), model, total

        return await serve(request, "qa", work)

    # ---- classification
    @app.post("/v1/classify", response_model=ClassifyResponse, responses=_ERRORS, tags=["tasks"])
    async def classify(body: ClassifyRequest, request: Request):
        """Label each document; long documents: mean of the windows' logits, then softmax."""
        job = validate_classify(body, request.headers.get("x-request-timeout"), service.limits, arrived(request))
        model = service.model_for("classify", job.common.model)

        async def work(state: RequestState, timing: Timing):
            state.deadline = job.common.deadline
            t = time.monotonic()
            prepared = await service.host_work(job.common.deadline, "tokenization", H.prepare_classify, model.info,
                                               job, settings.classify_stride, settings.max_document_tokens)
            timing.tokenize = time.monotonic() - t
            seqs = [(w, None) for windows, _ in prepared for w in windows]
            results = await model.engine.submit(seqs, state)
            timing.queue, timing.inference = results[0].queue_s, results[0].inference_s
            labels = model.info.labels or tuple(f"LABEL_{i}" for i in range(results[0].outputs["logits"].shape[-1]))
            out, i = [], 0
            for windows, n_tokens in prepared:
                rs = results[i : i + len(windows)]
                i += len(windows)
                probs = W.pool_logits([r.outputs["logits"].reshape(-1) for r in rs])
                order = sorted(range(len(probs)), key=lambda k: -probs[k])[: job.top_k or len(probs)]
                service.metrics.windows.labels(model.info.name, "classify").observe(len(windows))
                out.append({"labels": [{"label": labels[k], "score": float(probs[k])} for k in order],
                            "usage": {"tokens": n_tokens, "windows": len(windows), "truncated": False}})
            return JSONResponse({"model": model.info.name, "results": out}), model, sum(p[1] for p in prepared)

        return await serve(request, "classify", work)

    # ---- summarization
    @app.post("/v1/summarize", response_model=SummarizeResponse, tags=["tasks"], responses={
        **_ERRORS, 200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                         "description": "JSON; with `stream: true`, server-sent events"}})
    async def summarize(body: SummarizeRequest, request: Request):
        """Summarize each document (truncated at the encoder's maximum; `usage.truncated` says so).
        With `stream: true`, server-sent events: `token` events `{"id", "text"}`, then `done`
        with the whole result, or `error` with the error shape."""
        job = validate_summarize(body, request.headers.get("x-request-timeout"), service.limits, arrived(request))
        model = service.model_for("summarize", job.common.model)
        max_new = job.max_new_tokens or min(128, model.info.max_new_tokens)
        if max_new > model.info.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens {max_new} exceeds this model's {model.info.max_new_tokens}")
        # the request's settings over the model's generation defaults: what OnnxModel.generate uses
        search = resolve_settings(model.info.generation, max_new_tokens=max_new, num_beams=job.num_beams,
                                  length_penalty=job.length_penalty, no_repeat_ngram_size=job.no_repeat_ngram_size)
        tok = model.info.tokenizer

        async def work(state: RequestState, timing: Timing):
            state.deadline = job.common.deadline
            t = time.monotonic()
            prepared = await service.host_work(job.common.deadline, "tokenization", H.prepare_summarize, model.info,
                                               job, settings.max_document_tokens)
            timing.tokenize = time.monotonic() - t
            t = time.monotonic()
            streams = [await model.engine.submit(ids, search, state) for ids, _, _ in prepared]
            n_tokens = sum(p[1] for p in prepared)
            if job.stream:
                it = streams[0].__aiter__()
                head = []
                # greedy: the first token is one step away, and an error before it keeps its HTTP status
                if search.num_beams == 1:
                    first = await anext(it, None)
                    head = [] if first is None else [first]
                # beam search yields only when all beams are done: headers now, keep-alives meanwhile
                timing.queue = time.monotonic() - t
                ids, n, truncated = prepared[0]
                return MeasuredStream(
                    _sse(it, head, tok, {"tokens": n, "windows": 1, "truncated": truncated}, service, model),
                    media_type="text/event-stream", headers={"cache-control": "no-store"},
                ), model, n_tokens
            generated = await asyncio.gather(*(_collect(s) for s in streams))
            timing.inference = time.monotonic() - t
            out = [{"summary": summary_text(tok, g), "generated_tokens": len(g),
                    "usage": {"tokens": n, "windows": 1, "truncated": trunc}}
                   for g, (_, n, trunc) in zip(generated, prepared)]
            return JSONResponse({"model": model.info.name, "results": out}), model, n_tokens

        return await serve(request, "summarize", work)

    # ---- operations
    @app.get("/v1/models", response_model=ModelsResponse, tags=["operations"])
    async def models():
        return {"models": [
            {"name": n, "task": m.info.task, "default": service.defaults.get(m.info.task) == n,
             "max_length": m.info.max_length, "block_size": m.info.block_size, "plan": m.info.plan,
             "dtype": m.info.dtype, "labels": list(m.info.labels) if m.info.labels else None, "devices": m.devices}
            for n, m in service.models.items()
        ]}

    @app.get("/livez", tags=["operations"])
    async def livez():
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], responses={503: {"model": ErrorResponse}})
    async def readyz():
        if service.is_ready():
            return {"status": "ready"}
        why = "shutting down" if service.draining else "models loading or a worker restarting"
        return _error(Unavailable(f"not ready: {why}"))

    @app.get("/metrics", tags=["operations"], response_class=Response)
    async def metrics():
        body, ctype = service.metrics.render()
        return Response(body, media_type=ctype)

    return app


async def _collect(stream) -> list[int]:
    return [t async for t in stream]


async def _sse(it, head: list[int], tokenizer, usage: dict, service: Service, model: ServedModel):
    """Server-sent events: `token` per token (`head` were already taken from `it`), then `done`;
    `error` on failure or when the shutdown grace runs out; a `: keep-alive` comment after every
    `stream_keepalive_s` without a token (a beam search sends nothing until it ends), which also
    finds a client that went away (the write fails) so that the search stops."""
    ids: list[int] = []
    text = SummaryStream(tokenizer)
    grace_over = asyncio.ensure_future(service.drain_expired.wait())
    pending = None  # the next item of `it`, being awaited
    try:
        items = iter(head)
        while True:
            item = next(items, None)
            if item is None:
                pending = pending or asyncio.ensure_future(anext(it, None))
                done, _ = await asyncio.wait({pending, grace_over}, timeout=service.settings.stream_keepalive_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if pending in done:
                    item, pending = pending.result(), None
                    if item is None:
                        break
                elif grace_over in done:
                    raise ShuttingDown("server is shutting down; the stream did not finish within the "
                                       f"{service.settings.shutdown_grace_s:g} s grace period")
                else:
                    yield ": keep-alive\n\n"
                    continue
            ids.append(item)
            yield f"event: token\ndata: {json.dumps({'id': item, 'text': text.add(item)})}\n\n"
        result = {"summary": summary_text(tokenizer, ids), "generated_tokens": len(ids), "usage": usage}
        yield f"event: done\ndata: {json.dumps({'model': model.info.name, 'results': [result]})}\n\n"
    except ServiceError as exc:
        service.metrics.failures.labels("summarize", exc.reason).inc()
        yield f"event: error\ndata: {json.dumps({'error': {'type': exc.type, 'message': exc.message}})}\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream
        service.metrics.failures.labels("summarize", "cancelled").inc()
        raise
    finally:
        grace_over.cancel()
        if pending is not None:  # let it finish being cancelled before closing the generator under it
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await it.aclose()  # leaves the decoding batch at the next step
