"""POST /v1/qa: extractive question answering. Tokenization into overlapping windows (the host
pool), the windows through the encoder batcher, then each document's best spans (the host pool)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from longdoc.service import host as H
from longdoc.service.batcher import RequestState
from longdoc.service.core import ERROR_RESPONSES, Service, Timing, arrived
from longdoc.service.validation import QARequest, QAResponse, validate_qa

router = APIRouter()


@router.post("/v1/qa", response_model=QAResponse, responses=ERROR_RESPONSES, tags=["tasks"])
async def qa(body: QARequest, request: Request):
    """Answer a question from each document; long documents are read in overlapping windows."""
    service: Service = request.app.state.service
    job = validate_qa(body, request.headers.get("x-request-timeout"), service.limits, arrived(request))
    model = service.model_for("qa", job.common.model)

    async def work(state: RequestState, timing: Timing):
        state.deadline = job.common.deadline
        t = time.monotonic()
        prepared = await service.host_work(job.common.deadline, "tokenization", H.prepare_qa, model.info, job,
                                           service.settings.qa_stride, service.settings.max_document_tokens)
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

    return await service.serve(request, "qa", work)
