"""POST /v1/embeddings (OpenAI's shape) and POST /embed (text-embeddings-inference's): one vector
per text. Tokenization into windows (the host pool), the windows through the encoder batcher (the
graph pools each window's tokens as the model's sentence-transformers config says), then per text
its windows' vectors pooled into one (`longdoc.export.windows.pool_window_embeddings`) and scaled
to unit length where the model normalizes. A text longer than the model's window is embedded
whole, every window of it; `truncate: true` embeds its first window only, as a server that
truncates at the model's length does."""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from longdoc.export import windows as W
from longdoc.service import host as H
from longdoc.service.batcher import RequestState
from longdoc.service.core import ERROR_RESPONSES, Service, Timing, arrived
from longdoc.service.engine import ServedModel
from longdoc.service.errors import InvalidRequest
from longdoc.service.validation import (EmbeddingsRequest, EmbeddingsResponse, EmbedJob, EmbedRequest,
                                        validate_embed, validate_embeddings)

router = APIRouter()


async def embed_texts(service: Service, model: ServedModel, job: EmbedJob, endpoint: str, state: RequestState,
                      timing: Timing) -> tuple[list[np.ndarray], int]:
    """Each text's vector (E,) float32 and the tokens embedded, all texts together."""
    state.deadline = job.common.deadline
    if job.dimensions is not None and job.dimensions != model.info.hidden_size:
        raise InvalidRequest(f"dimensions {job.dimensions}: model {model.info.name!r} gives "
                             f"{model.info.hidden_size}-dimensional vectors (they are not cut)")
    t = time.monotonic()
    prepared = await service.host_work(job.common.deadline, "tokenization", H.prepare_embed, model.info, job,
                                       service.settings.max_document_tokens)
    timing.tokenize = time.monotonic() - t
    results = await model.engine.submit([(w, None) for windows, _ in prepared for w in windows], state)
    timing.queue, timing.inference = results[0].queue_s, results[0].inference_s
    normalize = model.info.embedding["normalize"] if job.normalize is None else job.normalize
    vectors, i = [], 0
    for windows, _ in prepared:
        rs = results[i : i + len(windows)]
        i += len(windows)
        vectors.append(W.pool_window_embeddings([r.outputs["embedding"].reshape(-1) for r in rs], normalize))
        service.metrics.windows.labels(model.info.name, endpoint).observe(len(windows))
    return vectors, sum(n for _, n in prepared)


def openai_item(index: int, vector: np.ndarray, base64_encoded: bool) -> dict:
    """One `data` entry of OpenAI's embeddings response (base64: the float32 little-endian bytes)."""
    value = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if base64_encoded
             else vector.astype(np.float32).tolist())
    return {"object": "embedding", "index": index, "embedding": value}


@router.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=ERROR_RESPONSES, tags=["tasks"])
async def embeddings(body: EmbeddingsRequest, request: Request):
    """OpenAI's embeddings API: a vector per input text, each text embedded whole (its windows pooled)."""
    service: Service = request.app.state.service
    job = validate_embeddings(body, request.headers.get("x-request-timeout"), service.limits, arrived(request))
    model = service.model_for("embed", job.common.model)

    async def work(state: RequestState, timing: Timing):
        vectors, tokens = await embed_texts(service, model, job, "embeddings", state, timing)
        return JSONResponse({"object": "list", "data": [openai_item(i, v, job.base64) for i, v in enumerate(vectors)],
                             "model": model.info.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}), \
            model, tokens

    return await service.serve(request, "embeddings", work)


@router.post("/embed", response_model=list[list[float]], responses=ERROR_RESPONSES, tags=["tasks"])
async def embed(body: EmbedRequest, request: Request):
    """text-embeddings-inference's embed API: a list of vectors, one per input text, each text
    embedded whole (its windows pooled; `truncate: true` for the first window only)."""
    service: Service = request.app.state.service
    job = validate_embed(body, request.headers.get("x-request-timeout"), service.limits, arrived(request))
    model = service.model_for("embed", job.common.model)

    async def work(state: RequestState, timing: Timing):
        vectors, tokens = await embed_texts(service, model, job, "embed", state, timing)
        return JSONResponse([v.astype(np.float32).tolist() for v in vectors]), model, tokens

    return await service.serve(request, "embed", work)
