"""Block-sparse attention that consumes any block layout (BigBird paper App. D, Fig. 6).

The layout (``longdoc.model.layout.Layout``) is data: for each (head, query block) a row of key-block
indices. Attention is gather key/value blocks -> batched matmul -> masked softmax -> matmul; query
blocks flagged in ``global_rows`` attend to the whole sequence densely. Everything is
Gather / MatMul / Softmax / Where / Concat with the layout as tensor inputs: no Python control
flow on tensor values, shapes depend only on (B, H, nb, block_size, K, G), so the function
exports to ONNX with the layout tensors as graph inputs.

Masking follows transformers' block-sparse BigBird exactly, so padded batches match it:
- a padded key adds ``MASK_PENALTY`` (-10000.0) to its logit (additive, not replace: a row whose
  keys are all padding gives the same softmax as without the mask, as in transformers);
- padding slots of the table (``valid == False``) are removed outright (half the dtype minimum
  via Where, finite so that adding a logit never gives -inf), they never count, even in a fully
  masked row;
- outputs at padded query positions are zero (transformers multiplies by ``from_mask``).
transformers also multiplies its band/random masks by the query mask; that only changes rows of
padded queries, whose outputs are zeroed anyway.

The softmax scale (default 1/sqrt(D)) is applied inside: to q before the sparse matmul (the
scores are K times larger than q), to the logits in the global rows. transformers scales the
logits; the two agree exactly for power-of-two scales (D = 64) and to an ulp otherwise.

``block_sparse_attention`` reads ``key_blocks``, ``valid``, ``global_index`` and ``row_source``
of a ``LayoutTensors``; ``global_rows`` (the same information as a mask) is what the dense
oracle reads. Build all five with ``layout_tensors(layout)`` so they agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from longdoc.model.layout import Layout

MASK_PENALTY = -10000.0  # transformers' attn_mask_penalty for padded keys


def _excluded(dtype: torch.dtype) -> float:
    """Logit bias of a key that must not count at all (far below MASK_PENALTY)."""
    return torch.finfo(dtype).min / 2


class LayoutTensors(NamedTuple):
    key_blocks: torch.Tensor  # (H, nb, K) long
    valid: torch.Tensor  # (H, nb, K) bool
    global_rows: torch.Tensor  # (nb,) bool
    global_index: torch.Tensor  # (G,) long: the global query blocks, increasing
    row_source: torch.Tensor  # (nb,) long: where each output block comes from in cat([sparse (nb), global (G)])


def layout_tensors(layout: Layout, device: torch.device | str | None = None) -> LayoutTensors:
    """A ``Layout``'s arrays as torch tensors (plus the two derived index vectors)."""
    nb = layout.n_blocks
    global_index = layout.global_index  # (G,)
    row_source = torch.arange(nb, dtype=torch.long)
    row_source[torch.as_tensor(global_index)] = nb + torch.arange(len(global_index), dtype=torch.long)
    return LayoutTensors(
        key_blocks=torch.as_tensor(layout.key_blocks.copy(), dtype=torch.long, device=device),
        valid=torch.as_tensor(layout.valid.copy(), dtype=torch.bool, device=device),
        global_rows=torch.as_tensor(layout.global_rows.copy(), dtype=torch.bool, device=device),
        global_index=torch.as_tensor(global_index.copy(), dtype=torch.long, device=device),
        row_source=row_source.to(device),
    )


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout_tensors: LayoutTensors,
    key_mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """q, k, v: (B, H, S, D) with S = nb * block_size; key_mask: (B, S), 1 = real token.

    Returns (B, H, S, D); positions where key_mask is 0 are zero.
    """
    B, H, S, D = q.shape
    key_blocks, valid, _, global_index, row_source = layout_tensors
    nb, K = key_blocks.shape[1], key_blocks.shape[2]
    bs = S // nb
    scale = 1.0 / D**0.5 if scale is None else scale  # D**0.5, not math.sqrt: traces without a TracerWarning
    key_mask = key_mask.to(q.dtype)
    penalty = (1.0 - key_mask) * MASK_PENALTY  # (B, S)

    # --- sparse rows: gather each row's key/value blocks
    qb = q.view(B, H, nb, bs, D)  # (B, H, nb, bs, D)
    # flat index into the (H * nb) key blocks of one batch element
    head_offset = torch.arange(H, device=q.device).view(H, 1, 1) * nb  # (H, 1, 1)
    flat = (key_blocks + head_offset).reshape(H * nb * K)  # (H*nb*K,)
    # one additive bias per (row, key slot): padded keys get MASK_PENALTY, table padding slots
    # get a value no real logit reaches (half the dtype minimum, so adding a logit never
    # overflows to -inf and a row that is all padding slots, e.g. a global row, stays finite)
    pen = penalty.view(B, nb, bs).index_select(1, key_blocks.reshape(H * nb * K))  # (B, H*nb*K, bs)
    pen = pen.view(B, H, nb, 1, K * bs)  # (B, H, nb, 1, K*bs)
    slot_valid = valid.view(1, H, nb, 1, K, 1).expand(1, H, nb, 1, K, bs).reshape(1, H, nb, 1, K * bs)
    # the gathered blocks are K times the size of k / v: build each right where it is consumed
    # so that at most one of them is alive at a time (peak memory)
    # scale q rather than the K-times larger scores (exact for power-of-two scales, D = 64)
    scores = torch.matmul(qb * scale, _gather_blocks(k, flat, nb, K).transpose(-1, -2))  # (B, H, nb, bs, K*bs)
    # bias in the scores' dtype (fp16 under autocast): its minimum must not round to -inf
    bias = pen.to(scores.dtype).masked_fill(~slot_valid, _excluded(scores.dtype))  # (B, H, nb, 1, K*bs)
    scores += bias  # in place: matmul's backward needs its inputs, not its output
    probs = F.softmax(scores, dim=-1)  # (B, H, nb, bs, K*bs)
    del scores
    sparse_out = torch.matmul(probs, _gather_blocks(v, flat, nb, K))  # (B, H, nb, bs, D)

    # --- global rows: dense attention over the whole sequence
    qg = qb.index_select(2, global_index)  # (B, H, G, bs, D)
    g_scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, H, G, bs, S)
    g_scores = g_scores + penalty.view(B, 1, 1, 1, S)
    g_probs = F.softmax(g_scores, dim=-1)  # (B, H, G, bs, S)
    global_out = torch.matmul(g_probs, v.unsqueeze(2))  # (B, H, G, bs, D)

    # --- pick each block's output: sparse row or its global row
    out = torch.cat([sparse_out, global_out], dim=2).index_select(2, row_source)  # (B, H, nb, bs, D)
    out = out.reshape(B, H, S, D)  # (B, H, S, D)
    return out * key_mask.view(B, 1, S, 1)


def _gather_blocks(x: torch.Tensor, flat_index: torch.Tensor, nb: int, K: int) -> torch.Tensor:
    """x: (B, H, S, D), flat_index: (H*nb*K,) into the H*nb blocks -> (B, H, nb, K*bs, D)."""
    B, H, S, D = x.shape
    bs = S // nb
    blocks = x.reshape(B, H * nb, bs, D).index_select(1, flat_index)  # (B, H*nb*K, bs, D)
    return blocks.view(B, H, nb, K * bs, D)  # (B, H, nb, K*bs, D)


def dense_reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout_tensors: LayoutTensors,
    key_mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The oracle: full (S x S) attention under the layout's multiplicity mask.

    A key block listed c times in a row contributes c * exp(logit), i.e. log(c) is added to its
    logits; blocks not listed are removed; global rows see every block once.
    """
    B, H, S, D = q.shape
    key_blocks, valid, global_rows = layout_tensors.key_blocks, layout_tensors.valid, layout_tensors.global_rows
    nb = key_blocks.shape[1]
    bs = S // nb
    scale = 1.0 / D**0.5 if scale is None else scale  # D**0.5, not math.sqrt: traces without a TracerWarning
    key_mask = key_mask.to(q.dtype)

    counts = torch.zeros(H, nb, nb, dtype=q.dtype, device=q.device)
    counts.scatter_add_(2, key_blocks, valid.to(q.dtype))  # (H, nb, nb)
    counts = torch.where(global_rows.view(1, nb, 1), torch.ones_like(counts), counts)
    counts = counts.repeat_interleave(bs, dim=1).repeat_interleave(bs, dim=2)  # (H, S, S)

    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, S, S)
    logits = logits + torch.log(counts.clamp(min=1.0)) + ((1.0 - key_mask) * MASK_PENALTY).view(B, 1, 1, S)
    logits = logits.masked_fill(counts == 0, _excluded(logits.dtype))
    out = torch.matmul(F.softmax(logits, dim=-1), v)  # (B, H, S, D)
    return out * key_mask.view(B, 1, S, 1)
