"""Greedy and beam search for the encoder-decoder in NumPy (no torch), token-for-token identical to
transformers' `generate(do_sample=False)` (transformers 5.x: `GenerationMixin._sample` /
`_beam_search`). The one implementation of the search: model/generation.py runs it over the
PyTorch model, export/generation.py over ONNX Runtime.

The search is written against two callables:

    next_logits(sequences) -> (N, V) float32 ndarray   # logits for the next token of each row;
                                                      # sequences: (N, cur_len) int64 tokens so far
    reorder(rows)                                       # the cache now follows rows[i] into row i;
                                                      # rows: (N,) int64

Everything else is elementwise float32 arithmetic, argmax / top-k and gathers on small
(batch, beam) arrays. Scores are float32 throughout, as in transformers, and the elementwise steps
round exactly as torch's do (same operations, same order, IEEE float32; a Python-float divisor is
rounded to float32 first, as torch does for a scalar operand). Two primitives do not: NumPy's
log-softmax differs from torch's in the last bit on about half the entries (exp implementation,
summation order), and torch.topk orders equal values in an unspecified, non-stable order. Both
are parameters of `beam_search` (`log_softmax`, `topk`; NumPy by default, ties to the lower
index); the PyTorch driver passes torch's so that it stays bit-identical to transformers. Greedy
needs neither: np.argmax and torch.argmax both return the first maximum.

`should_stop` (optional, any search): called before every decoder step, from whatever thread runs
the search; when it returns true the search raises `GenerationStopped` (the service uses it to
stop a request past its deadline or whose client went away between decoder steps).

Returned token ids: an int64 array (B, L), one row per input row, starting with
decoder_start_token_id, as transformers returns it. Greedy pads finished rows with pad_token_id;
beam search fills the tail of shorter hypotheses with `pad_token_id or eos_token_id`
(transformers' expression: pad id 0 counts as unset, so Pegasus' beam outputs end in eos ids).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

NEG_INF = -np.inf
IMPOSSIBLE = np.float32(-1.0e9)  # the score transformers gives candidates that must not be chosen

NextLogits = Callable[[np.ndarray], np.ndarray]
Reorder = Callable[[np.ndarray], None]
TopK = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


class GenerationStopped(Exception):
    """`should_stop` asked the search to stop between decoder steps; no result."""


def check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise GenerationStopped("generation stopped between decoder steps")


@dataclass(frozen=True)
class SearchSettings:
    max_length: int  # total decoder length, decoder_start included (= 1 + max_new_tokens)
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never"
    no_repeat_ngram_size: int = 0
    min_length: int = 0  # total decoder length below which eos is forbidden
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    decoder_start_token_id: int = 0
    forced_eos_token_ids: tuple[int, ...] = ()  # forced at the last position when set
    forced_bos_token_id: int | None = None  # forced as the first generated token when set (BART / LED)


# a model's generation fields under transformers' names (config.json, generation_config.json)
GENERATION_FIELDS = ("max_length", "num_beams", "length_penalty", "early_stopping", "no_repeat_ngram_size",
                     "min_length", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_eos_token_id",
                     "forced_bos_token_id")
GENERATION_CONFIG_NAME = "generation_config.json"


def checkpoint_generation_defaults(directory, config: Mapping[str, Any]) -> dict[str, Any]:
    """The generation defaults of a checkpoint directory: its generation_config.json (transformers
    writes them there today; a key it names wins, null = unset) over its `config` (config.json,
    older checkpoints). Only GENERATION_FIELDS, unset ones left out. The exporter (into the
    manifest) and the PyTorch reference (`longdoc.model.load_pretrained`) both read them here."""
    import json
    from pathlib import Path

    path = Path(directory) / GENERATION_CONFIG_NAME
    generation = {}
    if path.is_file():
        try:
            generation = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(generation, dict):
            raise ValueError(f"{path}: not a JSON object")
    merged = {**config, **generation}
    return {key: merged[key] for key in GENERATION_FIELDS if merged.get(key) is not None}


def _ids(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return (int(x),) if isinstance(x, (int, np.integer)) else tuple(int(i) for i in x)


def resolve_settings(defaults: Mapping[str, Any], *, max_new_tokens: int | None = None,
                     num_beams: int | None = None, length_penalty: float | None = None,
                     no_repeat_ngram_size: int | None = None, early_stopping: bool | str | None = None,
                     min_length: int | None = None, eos_token_id: int | list[int] | None = None,
                     pad_token_id: int | None = None, decoder_start_token_id: int | None = None,
                     forced_eos_token_id: int | list[int] | None = None,
                     forced_bos_token_id: int | None = None) -> SearchSettings:
    """Arguments given win, then `defaults` (a model's generation fields under transformers' names:
    max_length, num_beams, ..., eos_token_id; missing or None = unset), then transformers' defaults
    (num_beams 1, length_penalty 1.0, no_repeat_ngram_size 0, early_stopping False, min_length 0,
    max_length 20 in total). max_new_tokens counts generated tokens after decoder_start."""

    def pick(given, key, default):
        if given is not None:
            return given
        return defaults[key] if defaults.get(key) is not None else default

    return SearchSettings(
        max_length=1 + max_new_tokens if max_new_tokens is not None else pick(None, "max_length", 20),
        num_beams=pick(num_beams, "num_beams", 1),
        length_penalty=pick(length_penalty, "length_penalty", 1.0),
        early_stopping=pick(early_stopping, "early_stopping", False),
        no_repeat_ngram_size=pick(no_repeat_ngram_size, "no_repeat_ngram_size", 0),
        min_length=pick(min_length, "min_length", 0),
        eos_token_ids=_ids(pick(eos_token_id, "eos_token_id", None)),
        pad_token_id=pick(pad_token_id, "pad_token_id", None),
        decoder_start_token_id=pick(decoder_start_token_id, "decoder_start_token_id", 0),
        forced_eos_token_ids=_ids(pick(forced_eos_token_id, "forced_eos_token_id", None)),
        forced_bos_token_id=pick(forced_bos_token_id, "forced_bos_token_id", None),
    )


# ----------------------------------------------------------------------------------------------
# logits processors (transformers' order: no-repeat-ngram, min-length, forced-bos, forced-eos)


def banned_ngram_tokens(tokens: list[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram already in `tokens` (the decoder row, start token
    included): every earlier occurrence of the last n-1 tokens bans the token that followed it."""
    cur_len = len(tokens)
    if n <= 0 or cur_len < n:
        return []
    prefix = tokens[cur_len - n + 1:]  # the last n-1 tokens ([] for n = 1: ban every seen token)
    return [tokens[i + n - 1] for i in range(cur_len - n + 1) if tokens[i:i + n - 1] == prefix]


@dataclass(frozen=True)
class StepConstraints:
    """What the logits processors do to one row's scores at one step: `banned` tokens go to -inf;
    when `forced` is not empty every other token goes to -inf and these to 0 (the last forcing
    processor's tokens: forced-eos over forced-bos). `process_scores` applies them with NumPy; the
    service's fixed-shape decoder applies them on the device (service/regroup.py `step_tail_graph`)."""

    banned: tuple[int, ...] = ()
    forced: tuple[int, ...] = ()


def step_constraints(row: list[int], s: SearchSettings) -> StepConstraints:
    """The logits processors of one decoder row (start token included), in transformers' order.
    A banned id past the vocabulary bans nothing (the appliers skip it)."""
    cur_len = len(row)
    banned = banned_ngram_tokens(row, s.no_repeat_ngram_size) if s.no_repeat_ngram_size > 0 else []
    if s.min_length > 0 and s.eos_token_ids and cur_len < s.min_length:
        banned += s.eos_token_ids
    forced: tuple[int, ...] = ()
    if s.forced_bos_token_id is not None and cur_len == 1:
        forced = (s.forced_bos_token_id,)
    if s.forced_eos_token_ids and cur_len == s.max_length - 1:
        forced = s.forced_eos_token_ids
    return StepConstraints(tuple(banned), forced)


def process_scores(sequences: np.ndarray, scores: np.ndarray, s: SearchSettings) -> np.ndarray:
    """The one per-step logits processing, in transformers' order (no-repeat-ngram, min-length,
    forced-bos, forced-eos; `step_constraints`). sequences: (N, cur_len) int64, the decoder rows so far
    (start token included); scores: (N, V) float32 (logits for greedy, log-probs for beam). Returns
    new scores with forbidden tokens at -inf. Rows that differ in length or settings (the service's
    decoding batch) call it one row at a time: sequences (1, own cur_len), with their own settings."""
    scores = scores.copy()
    V = scores.shape[-1]
    for i, row in enumerate(sequences.tolist()):
        c = step_constraints(row, s)
        banned = [t for t in c.banned if t < V]
        if banned:
            scores[i, banned] = NEG_INF
        if c.forced:
            scores[i] = NEG_INF
            scores[i, list(c.forced)] = 0.0
    return scores


def greedy_tokens(sequences: np.ndarray, logits: np.ndarray, s: SearchSettings) -> np.ndarray:
    """The greedy choice for each row: the first maximum (as torch.argmax) of the processed
    float32 logits. sequences (N, cur_len) int64, logits (N, V) -> (N,) int64."""
    return np.argmax(process_scores(sequences, np.asarray(logits, dtype=np.float32), s), axis=-1)


def constrained_argmax(logits: np.ndarray, c: StepConstraints) -> int:
    """`greedy_tokens` of one row from its constraints: the first maximum of (V,) float32 logits
    processed by `c` (the smallest forced token when forced)."""
    if c.forced:
        return min(c.forced)
    banned = [t for t in c.banned if t < len(logits)]
    if banned:
        logits = logits.copy()
        logits[banned] = NEG_INF
    return int(np.argmax(logits))


def is_finished(sequence_length: int, token: int, s: SearchSettings) -> bool:
    """Whether a greedy row that just appended `token` (now `sequence_length` long, start token
    included) is done: it produced eos or reached max_length (transformers' stopping criteria)."""
    return token in s.eos_token_ids or sequence_length >= s.max_length


def _ends_with_eos(tokens: np.ndarray, s: SearchSettings) -> np.ndarray:
    if not s.eos_token_ids:
        return np.zeros(tokens.shape, bool)
    return np.isin(tokens, s.eos_token_ids)


# ----------------------------------------------------------------------------------------------
# greedy


def greedy_search(next_logits: NextLogits, batch_size: int, s: SearchSettings,
                  should_stop: Callable[[], bool] | None = None) -> np.ndarray:
    """Pick the argmax token each step; a row that produced eos continues with pad tokens; stop
    when every row has finished or the length reaches max_length. Returns (B, L) int64."""
    sequences = np.full((batch_size, 1), s.decoder_start_token_id, dtype=np.int64)
    unfinished = np.ones(batch_size, bool)
    pad = s.pad_token_id if s.pad_token_id is not None else (s.eos_token_ids[0] if s.eos_token_ids else None)
    while sequences.shape[1] < s.max_length:
        check_stop(should_stop)
        next_tokens = greedy_tokens(sequences, next_logits(sequences), s)  # (B,)
        if s.eos_token_ids:
            next_tokens = np.where(unfinished, next_tokens, pad)
        sequences = np.concatenate([sequences, next_tokens[:, None]], axis=1)
        unfinished &= ~np.array([is_finished(sequences.shape[1], t, s) for t in next_tokens.tolist()])
        if not unfinished.any():
            break
    return sequences


# ----------------------------------------------------------------------------------------------
# beam search


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float32: (x - max) - log(sum(exp(x - max))), torch's order."""
    x = x.astype(np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top-k of (B, M), best first; equal values keep index order. Returns (values, indices).

    Exactly the first k of a stable descending sort, without sorting all M: a partition finds the
    k-th largest value, then only the entries >= it (k, plus any ties at it) are sorted, in index
    order so that ties keep it. (Three full sorts made 53 ms of a 58 ms beam step over 5 beams x
    96,103 tokens, BigBird-Pegasus-large's vocabulary, on the 2-core dev machine; now the step's
    search takes 2.7 ms: docs/gpu.md.)"""
    B, M = x.shape
    if k >= M or M <= 4 * k:
        idx = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        return np.take_along_axis(x, idx, axis=-1), idx
    kth = -np.partition(-x, k - 1, axis=-1)[:, k - 1 : k]  # (B, 1) the k-th largest value
    idx = np.empty((B, k), np.int64)
    for b in range(B):
        cand = np.flatnonzero(x[b] >= kth[b])  # index order; at least k entries (NaN rows: fewer)
        if len(cand) < k:  # NaNs among the top: the full sort's order
            idx[b] = np.argsort(-x[b], kind="stable")[:k]
            continue
        idx[b] = cand[np.argsort(-x[b, cand], kind="stable")[:k]]
    return np.take_along_axis(x, idx, axis=-1), idx


def _gather(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """x: (B, K, ...), idx: (B, J) -> (B, J, ...): x[b, idx[b, j]]."""
    return np.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def beam_search(next_logits: NextLogits, reorder: Reorder, batch_size: int, s: SearchSettings,
                should_stop: Callable[[], bool] | None = None, *,
                log_softmax: Callable[[np.ndarray], np.ndarray] = log_softmax, topk: TopK = topk) -> np.ndarray:
    """transformers' beam search (the vectorised 2025 rewrite), step by step.

    State per input row b (shapes (B, nb) unless noted, nb = num_beams):
      running_seqs (B, nb, max_length)  the live hypotheses, best first, and their summed log-probs
      running_scores                    (beams 1.. start at -1e9 so step 1 expands beam 0 only);
      finished_seqs (B, nb, max_length) the best finished hypotheses so far, their length-penalised
      finished_scores / finished         scores (-1e9 = empty slot) and whether the slot is filled;
      finished_len                       the length of each finished hypothesis (for the output width);
      improvable (B, 1)                  False once no live beam can beat the worst finished one.
    Each step: log_softmax + processors per live beam, add the beam's score, keep the top
    K = max(2, 1 + n_eos) * nb (beam, token) candidates of the whole row; candidates that end in eos
    or reach max_length are "done": among the top nb candidates they compete for the finished
    slots (score / new_length ** length_penalty); the best nb not-done candidates become the
    live beams.
    """
    B, nb, L = batch_size, s.num_beams, s.max_length
    N = B * nb
    K = max(2, 1 + len(s.eos_token_ids)) * nb
    top_nb = np.arange(K) < nb  # (K,) the first nb of the K candidates
    if s.eos_token_ids:
        fill = s.pad_token_id if s.pad_token_id else s.eos_token_ids[0]  # transformers: `pad or eos[0]`
    else:
        fill = -1
    running_seqs = np.full((B, nb, L), fill, dtype=np.int64)
    running_seqs[:, :, 0] = s.decoder_start_token_id
    finished_seqs = running_seqs.copy()
    running_scores = np.zeros((B, nb), np.float32)
    running_scores[:, 1:] = IMPOSSIBLE
    finished_scores = np.full((B, nb), IMPOSSIBLE, np.float32)
    finished = np.zeros((B, nb), bool)
    finished_len = np.ones((B, nb), np.int64)
    improvable = np.ones((B, 1), bool)
    row_offset = (np.arange(B, dtype=np.int64) * nb)[:, None]  # (B, 1) flat row of beam 0
    cur_len = 1
    while True:
        check_stop(should_stop)
        flat = running_seqs[:, :, :cur_len].reshape(N, cur_len)  # (N, cur_len)
        logits = np.asarray(next_logits(flat), dtype=np.float32)  # (N, V)
        log_probs = process_scores(flat, log_softmax(logits), s)  # (N, V)
        V = log_probs.shape[-1]
        # accumulated score of every (beam, token) continuation, per input row
        cand = (log_probs.reshape(B, nb, V) + running_scores[:, :, None]).reshape(B, nb * V)  # (B, nb*V)
        cand_scores, cand_idx = topk(cand, K)  # (B, K) best first
        cand_beam = cand_idx // V  # (B, K) which live beam it extends
        cand_token = cand_idx % V  # (B, K)
        cand_seqs = _gather(running_seqs, cand_beam)  # (B, K, L), a copy
        cand_seqs[:, :, cur_len] = cand_token
        # a candidate is done when it ends in eos or reaches max_length (transformers' stopping criteria)
        done = _ends_with_eos(cand_token, s) | (cur_len + 1 >= L)  # (B, K)

        # live beams for the next step: the best nb candidates that are not done
        live_scores = cand_scores + done.astype(np.float32) * IMPOSSIBLE  # (B, K)
        keep = topk(live_scores, nb)[1]  # (B, nb)
        next_running_seqs = _gather(cand_seqs, keep)
        next_running_scores = _gather(live_scores, keep)
        source_rows = (_gather(cand_beam, keep) + row_offset).reshape(N)  # (N,) flat row each live beam came from

        # finished hypotheses: merge the done candidates among the top nb into the finished slots
        just_done = done & top_nb[None, :]  # (B, K)
        # length = generated tokens; the Python-float divisor rounds to float32 first, as in torch
        new_scores = cand_scores / np.float32((cur_len + 1 - 1) ** s.length_penalty)
        row_full = finished.all(axis=-1, keepdims=True) & (s.early_stopping is True)  # (B, 1)
        new_scores = new_scores + row_full.astype(np.float32) * IMPOSSIBLE
        new_scores = new_scores + (~improvable).astype(np.float32) * IMPOSSIBLE
        new_scores = new_scores + (~just_done).astype(np.float32) * IMPOSSIBLE
        merged_scores = np.concatenate([finished_scores, new_scores], axis=1)  # (B, nb+K)
        best = topk(merged_scores, nb)[1]  # (B, nb)
        finished_seqs = _gather(np.concatenate([finished_seqs, cand_seqs], axis=1), best)
        finished_scores = _gather(merged_scores, best)
        finished = _gather(np.concatenate([finished, just_done], axis=1), best)
        cand_len = np.full((B, K), cur_len + 1, np.int64)
        finished_len = _gather(np.concatenate([finished_len, cand_len], axis=1), best)

        running_seqs, running_scores = next_running_seqs, next_running_scores
        reorder(source_rows)
        cur_len += 1

        # can the best live beam still beat the worst finished one? (transformers' heuristic:
        # with early_stopping="never" and length_penalty > 0 assume the longest possible length)
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_len = L - 1
        else:
            best_len = cur_len - 1
        best_possible = running_scores[:, :1] / np.float32(best_len ** s.length_penalty)  # (B, 1)
        worst_finished = np.where(finished, finished_scores.min(axis=1, keepdims=True), IMPOSSIBLE)  # (B, nb)
        improvable = improvable & (best_possible > worst_finished).any(axis=-1, keepdims=True)

        all_full = bool(finished.all()) and s.early_stopping is True
        if not improvable.any() or all_full or done.all():
            break

    # output: the best finished hypothesis per row, cut to the longest of them
    width = int(finished_len[:, 0].max())
    return finished_seqs[:, 0, :width]
