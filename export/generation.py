"""Greedy and beam search over ONNX Runtime (no torch): model/search.py's NumPy search driven by
a longdoc.export.runtime.OnnxModel's decoder graph, so the exported path produces the same tokens as the
PyTorch model (model/generation.py runs the same search).

Return value: one list of token ids per input row, starting with decoder_start_token_id (as
longdoc.model.generation and transformers return it), without trailing fill tokens.

`should_stop` (optional, any search): called before the encoder and before every decoder step,
from whatever thread runs the search; when it returns true the search raises `GenerationStopped`
(the service uses it to stop a request past its deadline or whose client went away between
decoder steps).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from longdoc.export.runtime import aligned_key_length, aligned_self_mask, next_past_window
from longdoc.model.search import GenerationStopped, SearchSettings, beam_search, check_stop, greedy_search, resolve_settings

__all__ = ["GenerationStopped", "SearchSettings", "generate", "generated_tokens", "search_defaults", "settings_for"]


class _CachedDecoder:
    """One new token per row through the decoder graph with a growing KV cache, every key axis
    aligned as the service's decoder aligns it (longdoc.export.runtime.KEY_ALIGNMENT): the cross
    state padded to a multiple of KEY_ALIGNMENT, the past right-aligned against the new key and
    left-padded to a multiple of KEY_ALIGNMENT after every step, so that a sequence's logits are
    bitwise those the service's steps give it."""

    def __init__(self, model, state):
        self.model, self.state = model, state.aligned()
        self.past = None

    def next_logits(self, sequences: np.ndarray) -> np.ndarray:
        N, cur_len = sequences.shape
        done = cur_len - 1  # tokens already in the past (every row has as many)
        if self.past is None:
            self.past = self.model.empty_past(N, aligned_key_length(0))  # masked
        P = self.past[0].shape[2]
        logits, present = self.model.decoder_step(self.state, sequences[:, -1:], np.full((N, 1), done, np.int64),
                                                  aligned_self_mask(P, [done] * N), self.past)
        start, stop, pad_before = next_past_window(P, done + 1)
        self.past = [np.pad(p[:, :, start:stop], ((0, 0), (0, 0), (pad_before, 0), (0, 0))) for p in present]
        return logits[:, -1]  # (N, V) float32

    def reorder(self, rows: np.ndarray) -> None:
        self.past = [p[rows] for p in self.past]


def search_defaults(manifest) -> dict:
    """A model's generation defaults under transformers' names, for `resolve_settings`: the
    exported ones (manifest.decoder["generation"]: the checkpoint's generation_config.json over
    its config.json) with eos and pad from the manifest's special tokens, and decoder_start from
    there too unless the generation defaults name one. The one translation of a manifest into
    search settings: `settings_for` and the service (ModelInfo.generation) both use it."""
    defaults = dict((manifest.decoder or {}).get("generation", {}))
    special = manifest.special_tokens
    defaults["eos_token_id"] = special.get("eos")
    defaults["pad_token_id"] = special.get("pad")
    if defaults.get("decoder_start_token_id") is None:
        defaults["decoder_start_token_id"] = special.get("decoder_start")
    return defaults


def settings_for(manifest, max_new_tokens=None, num_beams=None, length_penalty=None, no_repeat_ngram_size=None,
                 early_stopping=None, min_length=None) -> SearchSettings:
    """Unset arguments come from the model's generation defaults (`search_defaults`)."""
    return resolve_settings(search_defaults(manifest), max_new_tokens=max_new_tokens, num_beams=num_beams,
                            length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                            early_stopping=early_stopping, min_length=min_length)


def generate(model, input_ids, attention_mask=None, should_stop: Callable[[], bool] | None = None,
             settings: SearchSettings | None = None, **options) -> list[list[int]]:
    """Greedy (num_beams 1) or beam search with a longdoc.export.runtime.OnnxModel; `settings` as
    resolved already (the service), else `settings_for(model.manifest, **options)`."""
    s = settings if settings is not None else settings_for(model.manifest, **options)
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
    check_stop(should_stop)
    state = model.encode_for_decoding(input_ids, attention_mask)
    if s.num_beams > 1:  # every beam of a row sees that row's encoder output
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


def generated_tokens(row: list[int], s: SearchSettings) -> list[int]:
    """What a summary is made of: a `generate` row without its start token and without the eos
    that ended it (the tokens the service streams)."""
    row = _strip(row, s)[1:]
    return row[:-1] if row and row[-1] in s.eos_token_ids else row
