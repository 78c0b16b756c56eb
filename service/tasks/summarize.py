"""POST /v1/summarize: abstractive summarization. Tokenization (the host pool, truncated at the
encoder's maximum), each document through the decode scheduler, then the summary text: one JSON
answer, or with `stream: true` server-sent events as tokens come (`_sse`)."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from longdoc.model.tokenization import SummaryStream, summary_text
from longdoc.service import host as H
from longdoc.service.batcher import RequestState
from longdoc.service.core import ERROR_RESPONSES, MeasuredStream, Service, Timing, arrived
from longdoc.service.engine import ServedModel
from longdoc.service.errors import ServiceError, ShuttingDown
from longdoc.service.metrics import length_label
from longdoc.service.validation import (
    SSE_EVENT_SCHEMA, SummarizeRequest, SummarizeResponse, summarize_search, validate_summarize,
)

router = APIRouter()


@router.post("/v1/summarize", response_model=SummarizeResponse, tags=["tasks"], responses={
    **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                             "description": "JSON; with `stream: true`, server-sent events"}})
async def summarize(body: SummarizeRequest, request: Request):
    """Summarize each document (truncated at the encoder's maximum; `usage.truncated` says so).
    With `stream: true`, server-sent events: `token` events `{"ids", "text"}` (the text never
    empty), then `done` with the whole result, or `error` with the error shape."""
    service: Service = request.app.state.service
    job = validate_summarize(body, request.headers.get("x-request-timeout"), service.limits, arrived(request))
    model = service.model_for("summarize", job.common.model)
    search = summarize_search(job, model.info)
    tok = model.info.tokenizer

    async def work(state: RequestState, timing: Timing):
        state.deadline = job.common.deadline
        t = time.monotonic()
        prepared = await service.host_work(job.common.deadline, "tokenization", H.prepare_summarize, model.info,
                                           job, service.settings.max_document_tokens)
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
                _sse(it, head, tok, {"tokens": n, "windows": 1, "truncated": truncated}, service, model, timing.start),
                media_type="text/event-stream", headers={"cache-control": "no-store"},
            ), model, n_tokens
        generated = await asyncio.gather(*(_collect(s) for s in streams))
        timing.inference = time.monotonic() - t
        out = [{"summary": summary_text(tok, g), "generated_tokens": len(g),
                "usage": {"tokens": n, "windows": 1, "truncated": trunc}}
               for g, (_, n, trunc) in zip(generated, prepared)]
        return JSONResponse({"model": model.info.name, "results": out}), model, n_tokens

    return await service.serve(request, "summarize", work)


async def _collect(stream) -> list[int]:
    return [t async for t in stream]


async def _sse(it, head: list[int], tokenizer, usage: dict, service: Service, model: ServedModel,
               started: float):
    """Server-sent events: `token` per piece of text with its tokens' ids (`head` were already
    taken from `it`; a token whose text the decoding holds back, a "-" that may become a hyphen,
    rides with the next piece, and a dangling one at the end, dropped from the summary, with none), then `done`;
    `error` on failure or when the shutdown grace runs out; a `: keep-alive` comment after every
    `stream_keepalive_s` without a token (a beam search sends nothing until it ends), which also
    finds a client that went away (the write fails) so that the search stops."""
    ids: list[int] = []
    held: list[int] = []  # tokens not yet sent: their text is not settled (SummaryStream)
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
                    raise ShuttingDown(service.shutdown_message("stream"))
                else:
                    yield ": keep-alive\n\n"
                    continue
            ids.append(item)
            held.append(item)
            if piece := text.add(item):  # a token whose text is held back rides with the next piece
                if len(held) == len(ids):  # the first token event: the client's time to first token
                    service.metrics.time_to_first_token_seconds.labels(
                        model.info.name, length_label(usage["tokens"], model.length_bounds)).observe(
                        time.monotonic() - started)
                yield f"event: token\ndata: {json.dumps({'ids': held, 'text': piece})}\n\n"
                held = []
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
