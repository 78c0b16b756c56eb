"""The FastAPI app: routes -> validation -> tokenization (host threads) -> engine -> answer
shaping (host threads) -> response.

`create_app(settings, worker_factory=None, models=None)` builds an app whose lifespan opens its
models (service/engine.py: by default this process's workers, warmed up at the maximum length,
with one batcher task per model; a front end's are the engine process's) and the host threads
(service/host.py: tokenization, windows and answer shaping beside the event loop), and tears all
of it down after. The routes never touch a worker.

The app is assembled here: middlewares (body limits, access), the OpenAPI patch, the exception
handlers, and the routers: one module per task (service/tasks/qa.py, classify.py, summarize.py, embed.py:
its route, pre- and post-processing) and the operations routes (service/operations.py). What they
share, the `Service` and its per-request wrapper `Service.serve`, is in service/core.py.
"""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from longdoc import __version__
from longdoc.service import operations
from longdoc.service.access import AccessControl, AccessMiddleware
from longdoc.service.core import Service, error_response, log
from longdoc.service.engine import LocalModels, ModelSource, WorkerFactory
from longdoc.service.errors import (
    InvalidRequest, RequestTimeout, ServiceError, TooLarge, Unavailable, UnsupportedMediaType,
)
from longdoc.service.settings import Settings
from longdoc.service.tasks import classify, embed, qa, summarize
from longdoc.service.validation import scan_json_tokens
from longdoc.service.workers import onnx_worker_factory

# the task routes (BodyLimitMiddleware guards them) and their metrics' endpoint label: the task, and
# OpenAI's /v1/embeddings beside TEI's /embed
ENDPOINTS = {"/v1/qa": "qa", "/v1/summarize": "summarize", "/v1/classify": "classify", "/v1/embeddings": "embeddings",
             "/embed": "embed"}
_JSON_POSTS = tuple(ENDPOINTS)


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
            return await error_response(UnsupportedMediaType(
                f"content type {ctype.decode('latin-1') or 'missing'}: send application/json"))(scope, receive, send)
        length = headers.get(b"content-length")
        # max_bytes: max_document_bytes x max_documents, and 64 KiB for the other fields (create_app)
        too_large = TooLarge(f"request body over {self.max_bytes} bytes", "max_document_bytes", "max_documents")
        busy = Unavailable("too many request bytes in flight; retry later", {"Retry-After": "1"})
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                return await error_response(too_large)(scope, receive, send)
            if int(length) > self.max_bytes_in_flight - self.bytes_in_flight:
                return await error_response(busy)(scope, receive, send)
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
                    return await error_response(late)(scope, receive, send)
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                seen += len(chunk)
                if seen > self.max_bytes:
                    return await error_response(too_large)(scope, receive, send)
                if self.bytes_in_flight + len(chunk) > self.max_bytes_in_flight:
                    return await error_response(busy)(scope, receive, send)
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
            return await error_response(InvalidRequest(f"body is not valid UTF-8 (byte {exc.start})"))(scope, receive, send)
        try:  # before any parse, in chunks: the event loop runs between them
            for _ in scan_json_tokens(body, self.max_json_tokens):
                await asyncio.sleep(0)
        except ServiceError as exc:
            return await error_response(exc)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def create_app(settings: Settings | None = None, worker_factory: WorkerFactory | None = None,
               models: ModelSource | None = None) -> FastAPI:
    """The app; its models are `models`' (a front end's: service/frontends.py `RemoteModels`), by
    default this process's (`LocalModels`: workers from `worker_factory`, ONNX Runtime's unless given)."""
    settings = settings or Settings()
    service = Service(settings, models or LocalModels(settings, worker_factory or onnx_worker_factory))

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
                         description="Question answering, summarization, classification and embeddings of long documents.")
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
        if path in ENDPOINTS:
            service.metrics.failures.labels(ENDPOINTS[path], exc.reason).inc()

    # added last, so outermost: a caller without a key gets no further (not even its body read)
    app.add_middleware(AccessMiddleware, access=access, open_paths=settings.open_paths,
                       on_refused=count_failure, error_response=error_response)
    app.openapi = _openapi_with_limits(app, settings, service, access.enabled)
    _add_error_handlers(app, count_failure)
    for router in (qa.router, classify.router, summarize.router, embed.router, operations.router):  # the OpenAPI order
        app.include_router(router)
    return app


def _openapi_with_limits(app: FastAPI, settings: Settings, service: Service, keyed: bool):
    """FastAPI's schema plus this server's own limits, so that clients generated from it agree
    with validation (sizes are in bytes of UTF-8 on the server, characters here)."""
    base_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            bodies = base_openapi()["components"]["schemas"]
            for name in ("QARequest", "SummarizeRequest", "ClassifyRequest"):
                props = bodies[name]["properties"]
                props["documents"]["maxItems"] = settings.max_documents
                for text in (props["document"], props["documents"]["items"], props.get("question", {})):
                    text["maxLength"] = settings.max_document_bytes
            for name, field in (("EmbeddingsRequest", "input"), ("EmbedRequest", "inputs")):  # a text or a list
                for option in bodies[name]["properties"][field]["anyOf"]:
                    if option.get("type") == "array":
                        option["maxItems"] = settings.max_documents
                        option["items"]["maxLength"] = settings.max_document_bytes
                    else:
                        option["maxLength"] = settings.max_document_bytes
            for name in ("QARequest", "SummarizeRequest", "ClassifyRequest", "EmbeddingsRequest", "EmbedRequest"):
                for option in bodies[name]["properties"]["timeout"]["anyOf"]:
                    if option["type"] == "number":
                        option["maximum"] = settings.max_request_timeout_s
            if keyed:  # every operation but the open paths needs the bearer key
                bearer = {"type": "http", "scheme": "bearer"}
                app.openapi_schema["components"]["securitySchemes"] = {"apiKey": bearer}
                for path, path_operations in app.openapi_schema["paths"].items():
                    if path not in settings.open_paths:
                        for operation in path_operations.values():
                            operation["security"] = [{"apiKey": []}]
            for name, task in (("QARequest", "qa"), ("SummarizeRequest", "summarize"), ("ClassifyRequest", "classify"),
                               ("EmbeddingsRequest", "embed"), ("EmbedRequest", "embed")):
                names = sorted(n for n, m in service.models.items() if m.info.task == task)
                for option in bodies[name]["properties"]["model"]["anyOf"]:
                    if option["type"] == "string" and names:  # the loaded models of the task (another's: 422)
                        option["enum"] = names
            dims = sorted({m.info.hidden_size for m in service.models.values() if m.info.task == "embed"})
            for option in bodies["EmbeddingsRequest"]["properties"]["dimensions"]["anyOf"]:
                if option["type"] == "integer" and dims:  # a loaded embed model's (vectors are not cut)
                    option["enum"] = dims
            caps = [m.info.max_new_tokens for m in service.models.values() if m.info.task == "summarize"]
            if caps:  # the largest loaded model's (a model with a smaller cap answers 422 over it)
                for option in bodies["SummarizeRequest"]["properties"]["max_new_tokens"]["anyOf"]:
                    if option["type"] == "integer":
                        option["maximum"] = min(option["maximum"], max(caps))
        return app.openapi_schema

    return openapi


def _add_error_handlers(app: FastAPI, count_failure) -> None:
    """Every error in the one error shape (service/errors.py), FastAPI's and Starlette's included."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):  # raised before Service.serve runs
        count_failure(request.url.path, exc)
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception):  # Starlette's would be plain text
        return error_response(ServiceError("internal error"))

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
            if e.get("type") == "value_error":  # our validators' own sentences, which name the field
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
