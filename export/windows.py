"""Documents longer than the model: split into windows, and map results back to the text.

QA (the BigBird paper's set-up, 4096-token windows with stride 2048): each window is
`[CLS] question [SEP] doc[a:b] [SEP]`; windows overlap by `window - stride` tokens, so an answer
cut by one window's edge lies whole inside the next. Spans are scored per window as
`start_logit + end_logit` over document tokens only, then merged across windows (the same
character span found by two windows keeps its best score) and mapped to character offsets of
the original text through the tokenizer's offsets.

Classification: `[CLS] doc[a:b] [SEP]` windows (no overlap by default); the document's logits
are the mean of its windows' logits, then softmax. Mean pooling weighs every window equally
(the last, shorter window included), which keeps a label present in one part of a long
document from being drowned by length alone less than max pooling would, but more than a
single truncated window would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from longdoc.model.tokenization import qa_room, summarize_window  # noqa: F401  (the one QA / summarize input, re-exported)


def window_spans(n_tokens: int, window: int, stride: int) -> list[tuple[int, int]]:
    """[a, b) token ranges of length <= window, starting every `stride` tokens, covering all
    n_tokens (the last window ends at n_tokens). One (0, 0) window for an empty input."""
    if window < 1 or stride < 1:
        raise ValueError("window and stride must be positive")
    stride = min(stride, window)  # a stride past the window would skip tokens
    spans = [(0, min(window, n_tokens))]
    while spans[-1][1] < n_tokens:
        a = spans[-1][0] + stride
        spans.append((a, min(a + window, n_tokens)))
    return spans


@dataclass(frozen=True)
class QAWindow:
    input_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...]
    doc_start: int  # first document token (index into the document's tokens) in this window
    doc_end: int  # one past the last
    offset: int  # position of document token doc_start in input_ids


def qa_windows(question_ids, doc_ids, max_length: int, stride: int | None, cls: int, sep: int) -> list[QAWindow]:
    """Windows of `[CLS] q [SEP] doc[a:b] [SEP]`, each at most max_length tokens."""
    room = qa_room(max_length, len(question_ids))
    if room < 1:
        raise ValueError(f"question of {len(question_ids)} tokens leaves no room in a {max_length}-token window")
    stride = stride or max(1, room // 2)
    head = (cls, *question_ids, sep)
    out = []
    for a, b in window_spans(len(doc_ids), room, stride):
        ids = (*head, *doc_ids[a:b], sep)
        types = (0,) * len(head) + (1,) * (b - a + 1)
        out.append(QAWindow(ids, types, a, b, len(head)))
    return out


@dataclass(frozen=True)
class Span:
    start: int  # character offsets into the document
    end: int
    score: float
    token_start: int  # document token indices, inclusive
    token_end: int


def best_spans(
    windows: list[QAWindow],
    start_logits: list[np.ndarray],  # per window, (len(input_ids),)
    end_logits: list[np.ndarray],
    offsets: list[tuple[int, int]],  # per document token: (char start, char end)
    top_k: int,
    max_answer_tokens: int,
) -> list[Span]:
    """The top_k best answer spans across all windows, at most max_answer_tokens long.

    Per window every valid span is scored (an (n, max_answer_tokens) matrix: start i, length
    j + 1), so the best span is exact, as transformers' QA pipeline's; pairing only the best 20
    starts with the best 20 ends (SQuAD's n-best) misses it whenever those lie further apart than
    max_answer_tokens, as they do in flat logits. A span among the global top_k is among the
    top_k of the window where it scores best, so keeping each window's top_k loses nothing."""
    best: dict[tuple[int, int], Span] = {}
    for w, s_log, e_log in zip(windows, start_logits, end_logits):
        n = w.doc_end - w.doc_start
        if n == 0:
            continue
        s = np.asarray(s_log[w.offset : w.offset + n], dtype=np.float64)  # document tokens only
        e = np.asarray(e_log[w.offset : w.offset + n], dtype=np.float64)
        length = min(max_answer_tokens, n)
        ends = np.arange(n)[:, None] + np.arange(length)[None, :]  # (n, length): end token of span (i, j)
        score = np.where(ends < n, s[:, None] + e[np.minimum(ends, n - 1)], -np.inf).ravel()  # (n * length,)
        keep = min(top_k, score.size)
        for flat in np.argpartition(-score, keep - 1)[:keep]:
            if not np.isfinite(score[flat]):
                continue
            i, j = divmod(int(flat), length)
            ti, tj = w.doc_start + i, w.doc_start + i + j
            span = Span(offsets[ti][0], offsets[tj][1], float(score[flat]), ti, tj)
            key = (span.start, span.end)
            if key not in best or best[key].score < span.score:
                best[key] = span
    ranked = sorted(best.values(), key=lambda sp: (-sp.score, sp.start))
    return ranked[:top_k]


def classify_windows(doc_ids, max_length: int, stride: int | None, cls: int, sep: int) -> list[tuple[int, ...]]:
    room = max_length - 2
    return [(cls, *doc_ids[a:b], sep) for a, b in window_spans(len(doc_ids), room, stride or room)]


def pool_logits(window_logits: list[np.ndarray]) -> np.ndarray:
    """Mean of the windows' logits (see the module docstring), then softmax: (num_labels,)."""
    mean = np.mean(np.stack([np.asarray(x, dtype=np.float64) for x in window_logits]), axis=0)
    z = np.exp(mean - mean.max())
    return z / z.sum()


# --- embeddings --------------------------------------------------------------------------------

def embed_windows(doc_ids, max_length: int, cls: int, sep: int, truncate: bool = False) -> list[tuple[int, ...]]:
    """`[CLS] doc[a:b] [SEP]` windows of at most max_length tokens, side by side (classification's);
    truncate: the first window only, what a server that truncates at the model's length embeds."""
    windows = classify_windows(doc_ids, max_length, None, cls, sep)
    return windows[:1] if truncate else windows


def pool_tokens(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """sentence-transformers' Pooling of hidden states (B, S, E) over the real tokens of mask (B, S):
    "mean" or "cls". (B, E) float32. The export computes it in the graph
    (`longdoc.export.lowering.pool_tokens`); this is its reference, for verify."""
    if pooling == "cls":
        return np.asarray(hidden[:, 0], np.float32)
    real = np.asarray(mask, np.float32)[:, :, None]  # (B, S, 1)
    return ((hidden * real).sum(axis=1) / np.maximum(real.sum(axis=1), 1e-9)).astype(np.float32)


def unit(v: np.ndarray) -> np.ndarray:
    """v scaled to unit length along its last axis (sentence-transformers' Normalize; zero stays zero)."""
    v = np.asarray(v, np.float32)
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def pool_window_embeddings(window_vectors: list[np.ndarray], normalize: bool) -> np.ndarray:
    """A text's vector from its windows' vectors: their mean, every window weighing the same (the
    last, shorter one too), then unit length when the model normalizes; one window's text gets its
    window's vector, what sentence-transformers gives it. Chosen by measurement (data/embed_retrieval.py,
    docs/models.md "The embedding model"): finding a manual page from a sentence deep inside it, this
    mean beats the mean of the windows' unit vectors, weighing windows by their tokens, the
    elementwise max and the first window alone. (E,) float32."""
    mean = np.mean(np.stack([np.asarray(v, np.float32) for v in window_vectors]), axis=0)
    return unit(mean) if normalize else mean
