"""The host path's CPU work: tokenization, windows and answer shaping, as pure functions of a
model's `ModelInfo` and a validated job, run in the Service's host threads (`tokenizer_threads`;
tokenizers' `encode_batch` releases the GIL, the rest holds it):

    event loop: HTTP, body checks, validation, batchers, responses
        -> Service.host_work(fn, info, ...) -> prepare_qa / prepare_classify / prepare_summarize / prepare_embed
                                                / qa_spans

This is most of a request's CPU in front of the device (what a document costs, and how it scales
with cores: docs/benchmarks.md, "The host path (null engine)", from docs/host_path.json). More
cores are used by more processes: `longdoc serve --front-ends N` (service/frontends.py) runs N
processes that each do this work for their own connections, in front of one engine process.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from longdoc.export import windows as W
from longdoc.model.tokenization import encode_within
from longdoc.service.errors import InvalidRequest, TooLarge


# ---------------------------------------------------------------------------------------------
# the work: pure functions of (ModelInfo, job, ...)


def encode(info, text: str, limit: int, what: str = "document"):
    # tokenized in chunks until the limit is passed (model/tokenization.py encode_within): a 2 MB
    # document over the limit costs about its first `limit` tokens, not the whole text. Through
    # encode_batch, which releases the GIL while it runs (encode holds it: 2.2 s for a 2 MB
    # document, and every thread, the event loop and the request's deadline included, waits)
    ids, offsets, read = encode_within(info.tokenizer, text, limit)
    if len(ids) > limit:
        counted = f"{len(ids)} tokens" if read == len(text) else \
            f"over {limit} tokens ({len(ids)} in its first {read} of {len(text)} characters)"
        raise TooLarge(f"{what} has {counted}; the limit is {limit} tokens", "max_document_tokens")
    if not ids:  # e.g. only characters this tokenizer's normalizer drops: nothing to answer from
        raise InvalidRequest(f"{what} has no tokens (only characters the model's tokenizer drops)")
    return ids, offsets


@dataclass(frozen=True)
class QADocument:
    """A QA document's windows as arrays."""

    input_ids: list[np.ndarray]  # per window (S,) int32: [CLS] question [SEP] doc[a:b] [SEP]
    token_type_ids: list[np.ndarray]  # per window (S,) int32
    windows: np.ndarray  # (n_windows, 3) int64: doc_start, doc_end, offset (export/windows.py QAWindow)
    offsets: np.ndarray  # (n_tokens, 2) int32 (int64 past 2**31 characters): each document token's character span
    n_tokens: int


def _array(ints, n: int = -1, dtype=np.int32) -> np.ndarray:
    """(n,) int32 from an iterable of ints (np.fromiter: a third of np.asarray's time on tuples).
    int32 halves what crosses the engine socket with `--front-ends` (token ids and types; the batcher widens
    them to int64 as it copies them into the batch, at no extra pass)."""
    return np.fromiter(ints, dtype, n if n >= 0 else len(ints))


def prepare_qa(info, job, stride: int | None, limit: int) -> list[QADocument]:
    q, _ = encode(info, job.question, limit, "question")
    room, min_room = W.qa_room(info.max_length, len(q)), max(1, info.max_length // 4)
    if room < min_room:  # the document needs room in each window
        raise InvalidRequest(
            f"question has {len(q)} tokens; at most {len(q) - (min_room - room)} "
            f"fit with a {info.max_length}-token window"
        )
    sp = info.special_tokens
    out = []
    for doc in job.common.documents:
        ids, offsets = encode(info, doc, limit)
        windows = W.qa_windows(q, ids, info.max_length, stride, int(sp["cls"]), int(sp["sep"]))
        out.append(QADocument(
            [_array(w.input_ids) for w in windows],
            [_array(w.token_type_ids) for w in windows],
            np.asarray([(w.doc_start, w.doc_end, w.offset) for w in windows], np.int64).reshape(-1, 3),
            _array(itertools.chain.from_iterable(offsets), 2 * len(offsets),
                   np.int32 if len(doc) < 2**31 else np.int64).reshape(-1, 2),
            len(ids),
        ))
    return out


def qa_spans(info, documents: list[tuple[np.ndarray, np.ndarray]], start_logits: list[list[np.ndarray]],
             end_logits: list[list[np.ndarray]], top_k: int, max_answer_tokens: int) -> list[list[tuple]]:
    """Per document ((windows, offsets) of its QADocument, its windows' logits): the best spans
    (export/windows.py best_spans) as (char start, char end, score)."""
    out = []
    for (windows, offsets), starts, ends in zip(documents, start_logits, end_logits):
        spans = W.best_spans([W.QAWindow((), (), int(a), int(b), int(o)) for a, b, o in windows],
                             starts, ends, offsets, top_k, max_answer_tokens)
        out.append([(int(s.start), int(s.end), s.score) for s in spans])
    return out


def prepare_classify(info, job, stride: int | None, limit: int) -> list[tuple[list[np.ndarray], int]]:
    """Per document: its windows, (S,) int64 each, and its token count."""
    sp = info.special_tokens
    out = []
    for doc in job.common.documents:
        ids, _ = encode(info, doc, limit)
        windows = W.classify_windows(ids, info.max_length, stride, int(sp["cls"]), int(sp["sep"]))
        out.append(([_array(w) for w in windows], len(ids)))
    return out


def prepare_embed(info, job, limit: int) -> list[tuple[list[np.ndarray], int]]:
    """Per text: its windows (`export/windows.py` embed_windows; the first only when the job
    truncates), (S,) int32 each, and the text tokens they hold (usage)."""
    sp = info.special_tokens
    out = []
    for doc in job.common.documents:
        ids, _ = encode(info, doc, limit)
        windows = W.embed_windows(ids, info.max_length, int(sp["cls"]), int(sp["sep"]), job.truncate)
        out.append(([_array(w) for w in windows], sum(len(w) - 2 for w in windows)))
    return out


def prepare_summarize(info, job, limit: int) -> list[tuple[list[int], int, bool]]:
    """Per document: the encoder input, its token count, whether it was truncated."""
    out = []
    for doc in job.common.documents:
        ids, _ = encode(info, doc, limit)
        window, truncated = W.summarize_window(ids, info.max_length, info.special_tokens, info.summarize_input)
        out.append((window, len(ids), truncated))
    return out
