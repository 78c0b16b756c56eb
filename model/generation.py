"""Greedy and beam search for the encoder-decoder, token-for-token identical to transformers'
`generate(do_sample=False)` (transformers 5.x: `GenerationMixin._sample` / `_beam_search`).

The search is written against two callables, so that the same logic runs over the PyTorch model
here and (ported to NumPy) over ONNX Runtime in export/:

    next_logits(sequences) -> (N, V) float32   # logits for the next token of each of the N rows;
                                              # sequences: (N, cur_len) decoder tokens so far
    reorder(rows)                               # the cache now follows rows[i] into row i (N,)

Everything else is elementwise arithmetic, argmax / top-k and gathers on small (batch, beam)
arrays; each step says which NumPy call it corresponds to. Scores are float32 throughout, as in
transformers; ties in top-k are resolved by torch.topk (for distinct values a port must only sort
descending; equal values arise only in the -1e9 "impossible" entries, which never reach the output).

Returned token ids: a LongTensor (B, L) per input row, starting with decoder_start_token_id, as
transformers returns it. Greedy pads finished rows with pad_token_id; beam search fills the tail of
shorter hypotheses with `pad_token_id or eos_token_id` (transformers' expression: pad id 0 counts as
unset, so Pegasus' beam outputs end in eos ids).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

NEG_INF = -math.inf
IMPOSSIBLE = -1.0e9  # the score transformers gives candidates that must not be chosen


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


# ----------------------------------------------------------------------------------------------
# logits processors (transformers' order: no-repeat-ngram, min-length, forced-eos)


def banned_ngram_tokens(tokens: list[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram already in `tokens` (the decoder row, start token
    included): every earlier occurrence of the last n-1 tokens bans the token that followed it."""
    cur_len = len(tokens)
    if n <= 0 or cur_len < n:
        return []
    prefix = tokens[cur_len - n + 1:]  # the last n-1 tokens ([] for n = 1: ban every seen token)
    return [tokens[i + n - 1] for i in range(cur_len - n + 1) if tokens[i:i + n - 1] == prefix]


def process_scores(sequences: torch.Tensor, scores: torch.Tensor, s: SearchSettings) -> torch.Tensor:
    """sequences: (N, cur_len) long; scores: (N, V) float (logits for greedy, log-probs for beam).
    Returns new scores with forbidden tokens at -inf."""
    scores = scores.clone()
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


def _ends_with_eos(last_tokens: torch.Tensor, s: SearchSettings) -> torch.Tensor:
    # np.isin(last_tokens, eos_ids)
    if not s.eos_token_ids:
        return torch.zeros_like(last_tokens, dtype=torch.bool)
    return torch.isin(last_tokens, torch.tensor(s.eos_token_ids, device=last_tokens.device))


# ----------------------------------------------------------------------------------------------
# greedy


def greedy_search(next_logits: Callable[[torch.Tensor], torch.Tensor], batch_size: int, s: SearchSettings,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Pick the argmax token each step; a row that produced eos continues with pad tokens; stop
    when every row has finished or the length reaches max_length. Returns (B, L) long."""
    sequences = torch.full((batch_size, 1), s.decoder_start_token_id, dtype=torch.long, device=device)
    unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)
    pad = s.pad_token_id if s.pad_token_id is not None else (s.eos_token_ids[0] if s.eos_token_ids else None)
    while sequences.shape[1] < s.max_length:
        logits = next_logits(sequences).to(torch.float32)  # (B, V)
        scores = process_scores(sequences, logits, s)
        next_tokens = torch.argmax(scores, dim=-1)  # (B,) np.argmax: first maximum, as torch
        if s.eos_token_ids:
            next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
        unfinished = unfinished & ~_ends_with_eos(next_tokens, s)
        if not bool(unfinished.any()):
            break
    return sequences


# ----------------------------------------------------------------------------------------------
# beam search


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: (B, K, ...), idx: (B, J) -> (B, J, ...): x[b, idx[b, j]] (np.take_along_axis on axis 1)."""
    while idx.dim() < x.dim():
        idx = idx.unsqueeze(-1)
    return torch.take_along_dim(x, idx, dim=1)


def beam_search(next_logits: Callable[[torch.Tensor], torch.Tensor], reorder: Callable[[torch.Tensor], None],
                batch_size: int, s: SearchSettings, device: torch.device | str = "cpu") -> torch.Tensor:
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
    top_nb = torch.arange(K, device=device) < nb  # (K,) the first nb of the K candidates
    if s.eos_token_ids:
        fill = s.pad_token_id if s.pad_token_id else s.eos_token_ids[0]  # transformers: `pad or eos[0]`
    else:
        fill = -1
    running_seqs = torch.full((B, nb, L), fill, dtype=torch.long, device=device)
    running_seqs[:, :, 0] = s.decoder_start_token_id
    finished_seqs = running_seqs.clone()
    running_scores = torch.zeros((B, nb), dtype=torch.float32, device=device)
    running_scores[:, 1:] = IMPOSSIBLE
    finished_scores = torch.full((B, nb), IMPOSSIBLE, dtype=torch.float32, device=device)
    finished = torch.zeros((B, nb), dtype=torch.bool, device=device)
    finished_len = torch.ones((B, nb), dtype=torch.long, device=device)
    improvable = torch.ones((B, 1), dtype=torch.bool, device=device)
    row_offset = (torch.arange(B, device=device) * nb)[:, None]  # (B, 1) flat row of beam 0
    cur_len = 1
    while True:
        flat = running_seqs[:, :, :cur_len].reshape(N, cur_len)  # (N, cur_len)
        logits = next_logits(flat).to(torch.float32)  # (N, V)
        log_probs = process_scores(flat, torch.log_softmax(logits, dim=-1), s)  # (N, V)
        V = log_probs.shape[-1]
        # accumulated score of every (beam, token) continuation, per input row
        cand = (log_probs.view(B, nb, V) + running_scores[:, :, None]).view(B, nb * V)  # (B, nb*V)
        cand_scores, cand_idx = torch.topk(cand, K)  # (B, K) best first
        cand_beam = cand_idx // V  # (B, K) which live beam it extends
        cand_token = cand_idx % V  # (B, K)
        cand_seqs = _gather(running_seqs, cand_beam)  # (B, K, L)
        cand_seqs[:, :, cur_len] = cand_token
        # a candidate is done when it ends in eos or reaches max_length (transformers' stopping criteria)
        done = _ends_with_eos(cand_token, s) | (cur_len + 1 >= L)  # (B, K)

        # live beams for the next step: the best nb candidates that are not done
        live_scores = cand_scores + done.to(torch.float32) * IMPOSSIBLE  # (B, K)
        keep = torch.topk(live_scores, nb)[1]  # (B, nb)
        next_running_seqs = _gather(cand_seqs, keep)
        next_running_scores = _gather(live_scores, keep)
        source_rows = (_gather(cand_beam, keep) + row_offset).reshape(N)  # (N,) flat row each live beam came from

        # finished hypotheses: merge the done candidates among the top nb into the finished slots
        just_done = done & top_nb[None, :]  # (B, K)
        new_scores = cand_scores / ((cur_len + 1 - 1) ** s.length_penalty)  # length = generated tokens
        row_full = finished.all(dim=-1, keepdim=True) & (s.early_stopping is True)  # (B, 1)
        new_scores = new_scores + row_full.to(torch.float32) * IMPOSSIBLE
        new_scores = new_scores + (~improvable).to(torch.float32) * IMPOSSIBLE
        new_scores = new_scores + (~just_done).to(torch.float32) * IMPOSSIBLE
        merged_scores = torch.cat([finished_scores, new_scores], dim=1)  # (B, nb+K)
        best = torch.topk(merged_scores, nb)[1]  # (B, nb)
        finished_seqs = _gather(torch.cat([finished_seqs, cand_seqs], dim=1), best)
        finished_scores = _gather(merged_scores, best)
        finished = _gather(torch.cat([finished, just_done], dim=1), best)
        cand_len = torch.full((B, K), cur_len + 1, dtype=torch.long, device=device)
        finished_len = _gather(torch.cat([finished_len, cand_len], dim=1), best)

        running_seqs, running_scores = next_running_seqs, next_running_scores
        reorder(source_rows)
        cur_len += 1

        # can the best live beam still beat the worst finished one? (transformers' heuristic:
        # with early_stopping="never" and length_penalty > 0 assume the longest possible length)
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_len = L - 1
        else:
            best_len = cur_len - 1
        best_possible = running_scores[:, :1] / (best_len ** s.length_penalty)  # (B, 1)
        worst_finished = torch.where(finished, finished_scores.min(dim=1, keepdim=True)[0],
                                     torch.tensor(IMPOSSIBLE, device=device))  # (B, nb)
        improvable = improvable & (best_possible > worst_finished).any(dim=-1, keepdim=True)

        all_full = bool(finished.all()) and s.early_stopping is True
        if not bool(improvable.any()) or all_full or bool(done.all()):
            break

    # output: the best finished hypothesis per row, cut to the longest of them
    width = int(finished_len[:, 0].max())
    return finished_seqs[:, 0, :width]


# ----------------------------------------------------------------------------------------------
# the PyTorch model's driver


class _CachedDecoder:
    """Feeds one new token per row to the model's decoder_step with a growing KV cache."""

    def __init__(self, model, encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor):
        self.model = model
        self.cross_kv = model.cross_attention_kv(encoder_hidden_states)
        self.encoder_attention_mask = encoder_attention_mask
        self.past = None

    def next_logits(self, sequences: torch.Tensor) -> torch.Tensor:
        N, cur_len = sequences.shape
        tokens = sequences[:, -1:]  # (N, 1): earlier tokens are in the cache
        position_ids = torch.full((N, 1), cur_len - 1, dtype=torch.long, device=sequences.device)
        self_mask = torch.ones((N, cur_len), dtype=torch.long, device=sequences.device)
        logits, self.past = self.model.decoder_step(tokens, position_ids, self_mask, self.cross_kv,
                                                    self.encoder_attention_mask, self.past)
        return logits[:, -1]  # (N, V)

    def reorder(self, rows: torch.Tensor) -> None:
        self.past = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.past]


def _ids(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return (int(x),) if isinstance(x, int) else tuple(int(i) for i in x)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int | None = None, num_beams: int | None = None, length_penalty: float | None = None,
             no_repeat_ngram_size: int | None = None, early_stopping: bool | str | None = None,
             min_length: int | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, decoder_start_token_id: int | None = None,
             forced_eos_token_id: int | list[int] | None = None) -> torch.Tensor:
    """Summarise `input_ids` (B, L) with greedy (num_beams 1) or beam search.

    Unset arguments come from the model config's generation fields, else transformers' defaults
    (num_beams 1, length_penalty 1.0, no_repeat_ngram_size 0, early_stopping False, min_length 0,
    max_length 20 in total). max_new_tokens counts generated tokens after decoder_start.
    attention_mask defaults to `input_ids != pad` when pad occurs in the input (transformers' rule).
    Returns a LongTensor (B, T) starting with decoder_start_token_id.
    """
    cfg = model.config

    def pick(given, from_config, default):
        return given if given is not None else (from_config if from_config is not None else default)

    eos = _ids(eos_token_id if eos_token_id is not None else cfg.eos_token_id)
    pad = pad_token_id if pad_token_id is not None else cfg.pad_token_id
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
        if pad is not None and bool((input_ids == pad).any()) and pad not in eos:
            attention_mask = (input_ids != pad).long()
    max_length = 1 + max_new_tokens if max_new_tokens is not None else pick(None, cfg.max_length, 20)
    settings = SearchSettings(
        max_length=max_length,
        num_beams=pick(num_beams, cfg.num_beams, 1),
        length_penalty=pick(length_penalty, cfg.length_penalty, 1.0),
        early_stopping=pick(early_stopping, cfg.early_stopping, False),
        no_repeat_ngram_size=pick(no_repeat_ngram_size, cfg.no_repeat_ngram_size, 0),
        min_length=pick(min_length, cfg.min_length, 0),
        eos_token_ids=eos,
        pad_token_id=pad,
        decoder_start_token_id=pick(decoder_start_token_id, cfg.decoder_start_token_id, 0),
        forced_eos_token_ids=_ids(forced_eos_token_id if forced_eos_token_id is not None else cfg.forced_eos_token_id),
    )
    B = input_ids.shape[0]
    enc = model.encode(input_ids, attention_mask).last_hidden_state  # (B, L, C)
    nb = settings.num_beams
    if nb > 1:  # every beam of a row sees that row's encoder output
        enc = enc.repeat_interleave(nb, dim=0)  # (B*nb, L, C)
        attention_mask = attention_mask.repeat_interleave(nb, dim=0)
    decoder = _CachedDecoder(model, enc, attention_mask)
    if nb == 1:
        return greedy_search(decoder.next_logits, B, settings, device=input_ids.device)
    return beam_search(decoder.next_logits, decoder.reorder, B, settings, device=input_ids.device)
