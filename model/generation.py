"""Greedy and beam search over the PyTorch BigBird-Pegasus and LED, token-for-token identical to
transformers' `generate(do_sample=False)`.

The search itself is model/search.py (NumPy, shared with export/generation.py over ONNX Runtime);
this module drives it with the model's cached decoder step, moving each step's logits to a float32
NumPy array and the chosen rows back. Beam search gets torch's log_softmax and topk (run on the
model's device) as its two numerically sensitive primitives, so scores and tie order are
bit-identical to transformers' (model/search.py says why NumPy's are not).

Returned token ids: a LongTensor (B, L) on the input's device, starting with
decoder_start_token_id, as transformers returns it. Greedy pads finished rows with pad_token_id;
beam search fills the tail of shorter hypotheses with `pad_token_id or eos_token_id`
(transformers' expression: pad id 0 counts as unset, so Pegasus' beam outputs end in eos ids).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from longdoc.model import search
from longdoc.model.search import GENERATION_FIELDS, GenerationStopped, SearchSettings, banned_ngram_tokens  # noqa: F401


def _to_numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float32).numpy()


class _TorchPrimitives:
    """torch.log_softmax and torch.topk on `device`, as transformers computes them."""

    def __init__(self, device: torch.device | str):
        self.device = device

    def log_softmax(self, x: np.ndarray) -> np.ndarray:
        return _to_numpy(torch.log_softmax(torch.from_numpy(x).to(self.device), dim=-1))

    def topk(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        values, idx = torch.topk(torch.from_numpy(x).to(self.device), k)
        return _to_numpy(values), idx.cpu().numpy()


def _torch_callables(next_logits: Callable[[torch.Tensor], torch.Tensor],
                     reorder: Callable[[torch.Tensor], None] | None, device: torch.device | str):
    """The search's NumPy callables over torch ones: sequences and rows go to `device` as
    LongTensors, logits come back as (N, V) float32 arrays."""

    def np_next_logits(sequences: np.ndarray) -> np.ndarray:
        return _to_numpy(next_logits(torch.from_numpy(sequences).to(device)))

    def np_reorder(rows: np.ndarray) -> None:
        reorder(torch.from_numpy(rows).to(device))

    return np_next_logits, np_reorder


def greedy_search(next_logits: Callable[[torch.Tensor], torch.Tensor], batch_size: int, s: SearchSettings,
                  device: torch.device | str = "cpu",
                  should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """longdoc.model.search.greedy_search over torch callables: next_logits(sequences (N, cur_len) long)
    -> (N, V) logits. Returns (B, L) long on `device`."""
    np_next_logits, _ = _torch_callables(next_logits, None, device)
    out = search.greedy_search(np_next_logits, batch_size, s, should_stop)
    return torch.from_numpy(out).to(device)


def beam_search(next_logits: Callable[[torch.Tensor], torch.Tensor], reorder: Callable[[torch.Tensor], None],
                batch_size: int, s: SearchSettings, device: torch.device | str = "cpu",
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """longdoc.model.search.beam_search over torch callables (reorder gets a (N,) LongTensor) with torch's
    log_softmax and topk. Returns (B, L) long on `device`."""
    np_next_logits, np_reorder = _torch_callables(next_logits, reorder, device)
    prims = _TorchPrimitives(device)
    out = search.beam_search(np_next_logits, np_reorder, batch_size, s, should_stop,
                             log_softmax=prims.log_softmax, topk=prims.topk)
    return torch.from_numpy(out).to(device)


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
        if cur_len > self.model.max_decoder_positions:  # the embedding lookup would fail inside
            raise ValueError(f"decoder position {cur_len - 1} is beyond the decoder's position table "
                             f"({self.model.max_decoder_positions}); ask for fewer new tokens")
        tokens = sequences[:, -1:]  # (N, 1): earlier tokens are in the cache
        position_ids = torch.full((N, 1), cur_len - 1, dtype=torch.long, device=sequences.device)
        self_mask = torch.ones((N, cur_len), dtype=torch.long, device=sequences.device)
        logits, self.past = self.model.decoder_step(tokens, position_ids, self_mask, self.cross_kv,
                                                    self.encoder_attention_mask, self.past)
        return logits[:, -1]  # (N, V)

    def reorder(self, rows: torch.Tensor) -> None:
        self.past = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.past]


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             max_new_tokens: int | None = None, num_beams: int | None = None, length_penalty: float | None = None,
             no_repeat_ngram_size: int | None = None, early_stopping: bool | str | None = None,
             min_length: int | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, decoder_start_token_id: int | None = None,
             forced_eos_token_id: int | list[int] | None = None, forced_bos_token_id: int | None = None,
             global_attention_mask: torch.Tensor | None = None,
             should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """Summarise `input_ids` (B, L) with greedy (num_beams 1) or beam search.

    Unset arguments come from the model config's generation fields, else transformers' defaults
    (num_beams 1, length_penalty 1.0, no_repeat_ngram_size 0, early_stopping False, min_length 0,
    max_length 20 in total). max_new_tokens counts generated tokens after decoder_start.
    attention_mask defaults to `input_ids != pad` when pad occurs in the input (transformers' rule).
    global_attention_mask (B, L): the encoder's global tokens (LED; passed to `model.encode`).
    should_stop: see longdoc.model.search (raises GenerationStopped between decoder steps).
    Returns a LongTensor (B, T) starting with decoder_start_token_id.
    """
    settings = search.resolve_settings(
        {k: getattr(model.config, k, None) for k in GENERATION_FIELDS},
        max_new_tokens=max_new_tokens, num_beams=num_beams, length_penalty=length_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size, early_stopping=early_stopping, min_length=min_length,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, decoder_start_token_id=decoder_start_token_id,
        forced_eos_token_id=forced_eos_token_id, forced_bos_token_id=forced_bos_token_id)
    pad = settings.pad_token_id
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
        if pad is not None and bool((input_ids == pad).any()) and pad not in settings.eos_token_ids:
            attention_mask = (input_ids != pad).long()
    B = input_ids.shape[0]
    search.check_stop(should_stop)
    encoder_inputs = {} if global_attention_mask is None else {"global_attention_mask": global_attention_mask}
    enc = model.encode(input_ids, attention_mask, **encoder_inputs).last_hidden_state  # (B, L, C)
    nb = settings.num_beams
    if nb > 1:  # every beam of a row sees that row's encoder output
        enc = enc.repeat_interleave(nb, dim=0)  # (B*nb, L, C)
        attention_mask = attention_mask.repeat_interleave(nb, dim=0)
    decoder = _CachedDecoder(model, enc, attention_mask)
    if nb == 1:
        return greedy_search(decoder.next_logits, B, settings, device=input_ids.device, should_stop=should_stop)
    return beam_search(decoder.next_logits, decoder.reorder, B, settings, device=input_ids.device,
                       should_stop=should_stop)
