"""Greedy and beam search in NumPy over ONNX Runtime (no torch): a line-for-line port of
model/generation.py (engineer C's PyTorch reference, itself transformers' `generate` with
do_sample=False), so the exported path produces the same tokens.

Return value: one list of token ids per input row, starting with decoder_start_token_id (as
model.generation and transformers return it), without trailing fill tokens.

`should_stop` (optional, any search): called before every decoder step, from whatever thread
runs the search; when it returns true the search raises `GenerationStopped` (the service uses
it to stop a request past its deadline or whose client went away between decoder steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

NEG_INF = -np.inf
IMPOSSIBLE = np.float32(-1.0e9)


class GenerationStopped(Exception):
    """`should_stop` asked the search to stop between decoder steps; no result."""


def _check(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise GenerationStopped("generation stopped between decoder steps")


@dataclass(frozen=True)
class SearchSettings:
    max_length: int  # total decoder length, decoder_start included (= 1 + max_new_tokens)
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never"
    no_repeat_ngram_size: int = 0
    min_length: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    decoder_start_token_id: int = 0
    forced_eos_token_ids: tuple[int, ...] = ()


def banned_ngram_tokens(tokens: list[int], n: int) -> list[int]:
    cur_len = len(tokens)
    if n <= 0 or cur_len < n:
        return []
    prefix = tokens[cur_len - n + 1:]
    return [tokens[i + n - 1] for i in range(cur_len - n + 1) if tokens[i:i + n - 1] == prefix]


def process_scores(sequences: np.ndarray, scores: np.ndarray, s: SearchSettings) -> np.ndarray:
    """transformers' processor order: no-repeat-ngram, min-length, forced-eos."""
    scores = scores.copy()
    N, cur_len = sequences.shape
    V = scores.shape[-1]
    if s.no_repeat_ngram_size > 0:
        rows = sequences.tolist()
        for i in range(N):
            banned = [t for t in banned_ngram_tokens(rows[i], s.no_repeat_ngram_size) if t < V]
            if banned:
                scores[i, banned] = NEG_INF
    if s.min_length > 0 and s.eos_token_ids and cur_len < s.min_length:
        scores[:, list(s.eos_token_ids)] = NEG_INF
    if s.forced_eos_token_ids and cur_len == s.max_length - 1:
        scores[:] = NEG_INF
        scores[:, list(s.forced_eos_token_ids)] = 0.0
    return scores


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _ends_with_eos(tokens: np.ndarray, s: SearchSettings) -> np.ndarray:
    if not s.eos_token_ids:
        return np.zeros(tokens.shape, bool)
    return np.isin(tokens, s.eos_token_ids)


def greedy_search(next_logits: Callable[[np.ndarray], np.ndarray], batch_size: int, s: SearchSettings,
                  should_stop: Callable[[], bool] | None = None) -> np.ndarray:
    sequences = np.full((batch_size, 1), s.decoder_start_token_id, dtype=np.int64)
    unfinished = np.ones(batch_size, bool)
    pad = s.pad_token_id if s.pad_token_id is not None else (s.eos_token_ids[0] if s.eos_token_ids else None)
    while sequences.shape[1] < s.max_length:
        _check(should_stop)
        scores = process_scores(sequences, next_logits(sequences).astype(np.float32), s)
        next_tokens = np.argmax(scores, axis=-1)  # first maximum, as torch.argmax
        if s.eos_token_ids:
            next_tokens = np.where(unfinished, next_tokens, pad)
        sequences = np.concatenate([sequences, next_tokens[:, None]], axis=1)
        unfinished &= ~_ends_with_eos(next_tokens, s)
        if not unfinished.any():
            break
    return sequences


def _topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top-k, best first (stable: equal values keep index order)."""
    idx = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(x, idx, axis=-1), idx


def _gather(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """x: (B, K, ...), idx: (B, J) -> x[b, idx[b, j]]"""
    return np.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def beam_search(next_logits, reorder, batch_size: int, s: SearchSettings,
                should_stop: Callable[[], bool] | None = None) -> np.ndarray:
    """transformers' vectorised beam search; see model/generation.py for the state it keeps."""
    B, nb, L = batch_size, s.num_beams, s.max_length
    N = B * nb
    K = max(2, 1 + len(s.eos_token_ids)) * nb
    top_nb = np.arange(K) < nb
    fill = (s.pad_token_id if s.pad_token_id else s.eos_token_ids[0]) if s.eos_token_ids else -1
    running_seqs = np.full((B, nb, L), fill, dtype=np.int64)
    running_seqs[:, :, 0] = s.decoder_start_token_id
    finished_seqs = running_seqs.copy()
    running_scores = np.zeros((B, nb), np.float32)
    running_scores[:, 1:] = IMPOSSIBLE
    finished_scores = np.full((B, nb), IMPOSSIBLE, np.float32)
    finished = np.zeros((B, nb), bool)
    finished_len = np.ones((B, nb), np.int64)
    improvable = np.ones((B, 1), bool)
    row_offset = (np.arange(B) * nb)[:, None]
    cur_len = 1
    while True:
        _check(should_stop)
        flat = running_seqs[:, :, :cur_len].reshape(N, cur_len)
        log_probs = process_scores(flat, log_softmax(next_logits(flat)), s)  # (N, V)
        V = log_probs.shape[-1]
        cand = (log_probs.reshape(B, nb, V) + running_scores[:, :, None]).reshape(B, nb * V).astype(np.float32)
        cand_scores, cand_idx = _topk(cand, K)
        cand_beam, cand_token = cand_idx // V, cand_idx % V
        cand_seqs = _gather(running_seqs, cand_beam).copy()  # (B, K, L)
        cand_seqs[:, :, cur_len] = cand_token
        done = _ends_with_eos(cand_token, s) | (cur_len + 1 >= L)

        live_scores = (cand_scores + done.astype(np.float32) * IMPOSSIBLE).astype(np.float32)
        keep = _topk(live_scores, nb)[1]
        next_running_seqs = _gather(cand_seqs, keep)
        next_running_scores = _gather(live_scores, keep)
        source_rows = (_gather(cand_beam, keep) + row_offset).reshape(N)

        just_done = done & top_nb[None, :]
        new_scores = (cand_scores / np.float32(cur_len ** s.length_penalty)).astype(np.float32)
        row_full = finished.all(axis=-1, keepdims=True) & (s.early_stopping is True)
        new_scores = new_scores + row_full.astype(np.float32) * IMPOSSIBLE
        new_scores = new_scores + (~improvable).astype(np.float32) * IMPOSSIBLE
        new_scores = (new_scores + (~just_done).astype(np.float32) * IMPOSSIBLE).astype(np.float32)
        merged_scores = np.concatenate([finished_scores, new_scores], axis=1)
        best = _topk(merged_scores, nb)[1]
        finished_seqs = _gather(np.concatenate([finished_seqs, cand_seqs], axis=1), best)
        finished_scores = _gather(merged_scores, best)
        finished = _gather(np.concatenate([finished, just_done], axis=1), best)
        finished_len = _gather(np.concatenate([finished_len, np.full((B, K), cur_len + 1, np.int64)], axis=1), best)

        running_seqs, running_scores = next_running_seqs, next_running_scores
        reorder(source_rows)
        cur_len += 1

        best_len = L - 1 if (s.early_stopping == "never" and s.length_penalty > 0.0) else cur_len - 1
        best_possible = running_scores[:, :1] / np.float32(best_len ** s.length_penalty)
        worst_finished = np.where(finished, finished_scores.min(axis=1, keepdims=True), IMPOSSIBLE)
        improvable = improvable & (best_possible > worst_finished).any(axis=-1, keepdims=True)

        all_full = bool(finished.all()) and s.early_stopping is True
        if not improvable.any() or all_full or done.all():
            break
    width = int(finished_len[:, 0].max())
    return finished_seqs[:, 0, :width]


class _CachedDecoder:
    """One new token per row through the decoder graph with a growing KV cache."""

    def __init__(self, model, state):
        self.model, self.state = model, state
        self.past = None

    def next_logits(self, sequences: np.ndarray) -> np.ndarray:
        N, cur_len = sequences.shape
        if self.past is None:
            self.past = self.model.empty_past(N)
        logits, self.past = self.model.decoder_step(
            self.state, sequences[:, -1:], np.full((N, 1), cur_len - 1, np.int64),
            np.ones((N, cur_len), np.int64), self.past)
        return logits[:, -1]

    def reorder(self, rows: np.ndarray) -> None:
        self.past = [p[rows] for p in self.past]


def settings_for(manifest, max_new_tokens=None, num_beams=None, length_penalty=None, no_repeat_ngram_size=None,
                 early_stopping=None, min_length=None) -> SearchSettings:
    """Unset arguments come from the exported generation defaults (manifest.decoder["generation"])."""
    gen = (manifest.decoder or {}).get("generation", {})
    special = manifest.special_tokens

    def pick(given, key, default):
        if given is not None:
            return given
        return gen[key] if gen.get(key) is not None else default

    eos = special.get("eos")
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    forced = gen.get("forced_eos_token_id")
    forced_ids = () if forced is None else ((forced,) if isinstance(forced, int) else tuple(forced))
    max_length = 1 + max_new_tokens if max_new_tokens is not None else pick(None, "max_length", 20)
    return SearchSettings(
        max_length=max_length, num_beams=pick(num_beams, "num_beams", 1),
        length_penalty=pick(length_penalty, "length_penalty", 1.0),
        early_stopping=pick(early_stopping, "early_stopping", False),
        no_repeat_ngram_size=pick(no_repeat_ngram_size, "no_repeat_ngram_size", 0),
        min_length=pick(min_length, "min_length", 0), eos_token_ids=eos_ids, pad_token_id=special.get("pad"),
        decoder_start_token_id=pick(None, "decoder_start_token_id", special.get("decoder_start") or 0),
        forced_eos_token_ids=forced_ids)


def generate(model, input_ids, attention_mask=None, should_stop: Callable[[], bool] | None = None,
             **options) -> list[list[int]]:
    """Greedy (num_beams 1) or beam search with an export.runtime.OnnxModel."""
    s = settings_for(model.manifest, **options)
    input_ids = np.asarray(input_ids, dtype=np.int64)
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if attention_mask is None:  # transformers' rule: mask pads when pad occurs and is not eos
        attention_mask = np.ones_like(input_ids)
        pad = s.pad_token_id
        if pad is not None and (input_ids == pad).any() and pad not in s.eos_token_ids:
            attention_mask = (input_ids != pad).astype(np.int64)
    attention_mask = np.asarray(attention_mask, dtype=np.int64)
    if attention_mask.ndim == 1:
        attention_mask = attention_mask[None]
    B = input_ids.shape[0]
    _check(should_stop)
    state = model.encode_for_decoding(input_ids, attention_mask)
    if s.num_beams > 1:
        state = state.select(np.repeat(np.arange(B), s.num_beams))
    decoder = _CachedDecoder(model, state)
    if s.num_beams == 1:
        out = greedy_search(decoder.next_logits, B, s, should_stop)
    else:
        out = beam_search(decoder.next_logits, decoder.reorder, B, s, should_stop)
    return [_strip(row.tolist(), s) for row in out]


def _strip(row: list[int], s: SearchSettings) -> list[int]:
    """Cut after the first eos (what follows is fill)."""
    for i, tok in enumerate(row[1:], start=1):
        if tok in s.eos_token_ids:
            return row[: i + 1]
    return row
