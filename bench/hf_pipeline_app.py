"""The QA server a user writes today: FastAPI around transformers on torch CPU (issue 16, item 2).

The other side of bench/head_to_head.py. transformers' `pipeline("question-answering")` is what
such a user reaches for, but the installed transformers (5.x) removed that task (`pipeline()`
raises "Use the `text-generation` pipeline with a chat model instead."), so this app does what
that pipeline (transformers 4.x `QuestionAnsweringPipeline`) did, step by step, on transformers'
own tokenizer and model:

- windows: the fast tokenizer with `truncation="only_second"`, `max_length=max_seq_len`,
  `stride=doc_stride` (the overlap in tokens), `return_overflowing_tokens=True`; no padding;
- one `BigBirdForQuestionAnswering` forward per window (the pipeline's batch size 1),
  block-sparse attention in eval mode, torch on CPU;
- per window: logits outside the context (question, [SEP]) set to -10000 ([CLS] kept), softmax
  over the window, [CLS] zeroed, span score = p_start * p_end over spans of at most
  `max_answer_len` tokens, the window's best span kept;
- the answer: the best span over all windows by that score.

Two settings are chosen so both systems read the same windows and return comparable spans:
`doc_stride` is half the window's context room (our service's default window start step is the
other half, so the windows are identical; the BigBird paper's 4096/2048), and the answer is the
characters of its tokens (the pipeline's `align_to_words=False`; our service does not widen
spans to whole words). One forward at a time: torch already uses --threads cores, and concurrent
forwards would only oversubscribe them and multiply the activation memory.

    python bench/hf_pipeline_app.py --checkpoint DIR --port 8001 --threads 2

POST /qa {"question": str, "document": str, "max_answer_len": int = 30}
  -> {"answer": {"text", "start", "end", "score"}, "windows": int}
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import numpy as np
import torch
import transformers
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

MASKED_LOGIT = -10000.0  # the pipeline's value for tokens that cannot be in the answer


class QABody(BaseModel):
    question: str = Field(min_length=1)
    document: str = Field(min_length=1)
    max_answer_len: int = Field(30, ge=1, le=512)


def load_tokenizer(checkpoint: Path) -> transformers.PreTrainedTokenizerFast:
    """The checkpoint's BERT WordPiece tokenizer.json as a transformers fast tokenizer. BigBird
    reads token_type_ids (question 0, context 1), so they are model inputs, as in BERT's tokenizer."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(checkpoint / "tokenizer.json"), cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        unk_token="[UNK]", mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def windows(tokenizer, question: str, document: str, max_seq_len: int):
    """The pipeline's windows `[CLS] q [SEP] context [SEP]` (one BatchEncoding row each), with an
    overlap (`doc_stride`) of half the context room: the windows our service reads."""
    room = max_seq_len - len(tokenizer(question, add_special_tokens=False)["input_ids"]) - 3
    if room < 1:
        raise ValueError(f"the question leaves no room for the document in a {max_seq_len}-token window")
    return tokenizer(question, document, truncation="only_second", max_length=max_seq_len, stride=room - room // 2,
                     return_overflowing_tokens=True, return_offsets_mapping=True, return_token_type_ids=True)


def best_window_span(start_logits: np.ndarray, end_logits: np.ndarray, context: np.ndarray, cls_index: int,
                     max_answer_len: int) -> tuple[int, int, float] | None:
    """The pipeline's span choice in one window: (start token, end token, p_start * p_end), or None
    when the best-scoring span is not inside the context. context: (S,) bool, True = context token."""
    allowed = context.copy()
    allowed[cls_index] = True  # [CLS] stays in the softmax ("some models use it for no answer")
    probs = []
    for logits in (start_logits, end_logits):
        x = np.where(allowed, logits.astype(np.float64), MASKED_LOGIT)
        x = np.exp(x - x.max())
        x /= x.sum()
        x[cls_index] = 0.0
        probs.append(x)
    outer = np.outer(*probs)  # (S, S): score of span (start, end)
    candidates = np.tril(np.triu(outer), max_answer_len - 1)  # start <= end < start + max_answer_len
    s, e = np.unravel_index(int(np.argmax(candidates)), candidates.shape)
    if not (context[s] and context[e]):
        return None
    return int(s), int(e), float(candidates[s, e])


def create_app(checkpoint: Path, max_seq_len: int) -> FastAPI:
    tokenizer = load_tokenizer(checkpoint)
    model = transformers.BigBirdForQuestionAnswering.from_pretrained(str(checkpoint)).eval()
    one_forward = threading.Lock()
    app = FastAPI()

    @app.get("/readyz")
    def readyz():
        return {"status": "ready"}

    @app.post("/qa")
    def qa(body: QABody):  # a sync route: FastAPI runs it in its thread pool
        try:
            enc = windows(tokenizer, body.question, body.document, max_seq_len)
        except ValueError as exc:
            return JSONResponse({"error": {"type": "invalid_request", "message": str(exc)}}, 422)
        best = None
        for w in range(len(enc["input_ids"])):
            inputs = {k: torch.tensor([enc[k][w]]) for k in ("input_ids", "token_type_ids", "attention_mask")}
            with one_forward, torch.no_grad():
                out = model(**inputs)
            context = np.array([sid == 1 for sid in enc.sequence_ids(w)])
            span = best_window_span(out.start_logits[0].numpy(), out.end_logits[0].numpy(), context, 0,
                                    body.max_answer_len)
            if span is not None and (best is None or span[2] > best[2]):
                offsets = enc["offset_mapping"][w]
                best = (offsets[span[0]][0], offsets[span[1]][1], span[2])
        answer = None if best is None else {"text": body.document[best[0]:best[1]], "start": best[0],
                                            "end": best[1], "score": best[2]}
        return {"answer": answer, "windows": len(enc["input_ids"])}

    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="BigBird QA checkpoint directory with tokenizer.json (required)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="port (default: 8001)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: 2)")
    p.add_argument("--max-seq-len", type=int, default=4096, help="window length in tokens (default: 4096)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    uvicorn.run(create_app(args.checkpoint, args.max_seq_len), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
