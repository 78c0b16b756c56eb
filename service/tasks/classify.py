"""POST /v1/classify: sequence classification. Tokenization into windows (the host pool), the
windows through the encoder batcher, then per document the mean of its windows' logits, softmax."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from longdoc.export import windows as W
from longdoc.service import host as H
from longdoc.service.batcher import RequestState
from longdoc.service.core import ERROR_RESPONSES, Service, Timing, arrived
from longdoc.service.validation import ClassifyRequest, ClassifyResponse, validate_classify

router = APIRouter()


@router.post("/v1/classify", response_model=ClassifyResponse, responses=ERROR_RESPONSES, tags=["tasks"])
async def classify(body: ClassifyRequest, request: Request):
    """Label each document; long documents: mean of the windows' logits, then softmax."""
    service: Service = request.app.state.service
    job = validate_classify(body, request.headers.get("x-request-timeout"), service.limits, arrived(request))
    model = service.model_for("classify", job.common.model)

    async def work(state: RequestState, timing: Timing):
        state.deadline = job.common.deadline
        t = time.monotonic()
        prepared = await service.host_work(job.common.deadline, "tokenization", H.prepare_classify, model.info,
                                           job, service.settings.classify_stride, service.settings.max_document_tokens)
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

    return await service.serve(request, "classify", work)
