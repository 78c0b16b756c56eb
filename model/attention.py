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

``block_sparse_attention`` reads ``key_blocks``, ``valid``, ``global_index``, ``row_source`` and
``band`` of a ``LayoutTensors``; ``global_rows`` (the same information as a mask) is what the dense
oracle reads. Build them with ``layout_tensors(layout)`` so they agree.

Longformer (Beltagy et al. 2020, Sec. 3.1) adds two things, both optional arguments here:
- a token-level band (``Layout.band`` = w): inside a sparse row's key blocks only keys at most w
  tokens from the query count, the rest are removed like table padding;
- per-request global tokens (``GlobalTokens``, built by ``global_tokens(mask)``): every sparse
  row gets G extra key slots holding them (and they are removed from the window slots, so
  each is counted once), and each global token's own row attends to every key, with its own
  projections when ``global_qkv`` is given (Longformer's query_global / key_global /
  value_global). That row is computed by the same dense-row code as the layout's global rows.
Masking is transformers' Longformer's where it matters: padded keys never count (-10000 added,
exactly 0 after the softmax for any row that holds a real key, which every real query does:
itself or, for global rows, every real key).
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
    band: int = 0  # Layout.band: > 0 keeps only keys at most `band` tokens from the query in sparse rows

    def to(self, device) -> LayoutTensors:
        """The same layout with its tensors on `device`."""
        return LayoutTensors(*(t.to(device) for t in self[:5]), band=self.band)


class GlobalTokens(NamedTuple):
    """Per-request global tokens (Longformer): G = the largest count in the batch."""

    index: torch.Tensor  # (B, G) long: each element's global positions, increasing; padding slots hold any position
    valid: torch.Tensor  # (B, G) bool: False = padding slot (an element with fewer global tokens)
    is_global: torch.Tensor  # (B, S) bool
    slot: torch.Tensor  # (B, S) long: the slot of each global position in `index` (0 elsewhere)


def global_tokens(global_mask: torch.Tensor, key_mask: torch.Tensor) -> GlobalTokens | None:
    """global_mask, key_mask: (B, S), non-zero = global / real token. A padded position is never
    global (as in transformers, where the two masks are multiplied). None when no token is global."""
    is_global = (global_mask != 0) & (key_mask != 0)  # (B, S)
    counts = is_global.sum(dim=1)  # (B,)
    G = int(counts.max()) if is_global.numel() else 0
    if G == 0:
        return None
    # stable sort puts the global positions first, in increasing order
    index = torch.argsort((~is_global).to(torch.int8), dim=1, stable=True)[:, :G]  # (B, G)
    valid = torch.arange(G, device=global_mask.device)[None, :] < counts[:, None]  # (B, G)
    slot = (torch.cumsum(is_global.long(), dim=1) - 1).clamp(min=0)  # (B, S)
    return GlobalTokens(index=index, valid=valid, is_global=is_global, slot=slot)


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
        band=int(layout.band),
    )


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout_tensors: LayoutTensors,
    key_mask: torch.Tensor,
    scale: float | None = None,
    global_tokens: GlobalTokens | None = None,
    global_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q, k, v: (B, H, S, D) with S = nb * block_size; key_mask: (B, S), 1 = real token.

    global_tokens: per-request global tokens (see the module docstring); global_qkv: their rows'
    projections, q (B, H, G, D) for the G slots of `global_tokens.index`, k and v (B, H, S, D)
    (default: q gathered at the global positions, k, v).
    Returns (B, H, S, D); positions where key_mask is 0 are zero.
    """
    B, H, S, D = q.shape
    key_blocks, valid, _, global_index, row_source, band = layout_tensors
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
    keep = valid.view(1, H, nb, 1, K, 1).expand(1, H, nb, 1, K, bs).reshape(1, H, nb, 1, K * bs)
    if band:  # token-level band inside the key blocks
        keep = keep & _band_mask(key_blocks, bs, band)  # (1, H, nb, bs, K*bs)
    if global_tokens is not None:  # a global token has a key slot of its own: not again in the window
        in_window = (~global_tokens.is_global).view(B, nb, bs).index_select(1, key_blocks.reshape(H * nb * K))
        keep = keep & in_window.view(B, H, nb, 1, K * bs)  # (B, H, nb, 1|bs, K*bs)
    # the gathered blocks are K times the size of k / v: build each right where it is consumed
    # so that at most one of them is alive at a time (peak memory)
    # scale q rather than the K-times larger scores (exact for power-of-two scales, D = 64)
    qs = qb * scale
    scores = torch.matmul(qs, _gather_blocks(k, flat, nb, K).transpose(-1, -2))  # (B, H, nb, bs, K*bs)
    # bias in the scores' dtype (fp16 under autocast): its minimum must not round to -inf
    bias = torch.where(keep, pen.to(scores.dtype), _excluded(scores.dtype))  # (B, H, nb, 1|bs, K*bs)
    scores += bias  # in place: matmul's backward needs its inputs, not its output
    G = 0
    if global_tokens is not None:
        G = global_tokens.index.shape[1]
        k_glob = _gather_tokens(k, global_tokens.index)  # (B, H, G, D)
        g_scores = torch.matmul(qs, k_glob.view(B, H, 1, G, D).transpose(-1, -2))  # (B, H, nb, bs, G)
        g_bias = torch.where(global_tokens.valid, 0.0, _excluded(g_scores.dtype)).to(g_scores.dtype)  # (B, G)
        scores = torch.cat([g_scores + g_bias.view(B, 1, 1, 1, G), scores], dim=-1)  # (B, H, nb, bs, G+K*bs)
    probs = F.softmax(scores, dim=-1)  # (B, H, nb, bs, G+K*bs)
    del scores
    sparse_out = torch.matmul(probs[..., G:], _gather_blocks(v, flat, nb, K))  # (B, H, nb, bs, D)
    if global_tokens is not None:
        v_glob = _gather_tokens(v, global_tokens.index)  # (B, H, G, D)
        sparse_out = sparse_out + torch.matmul(probs[..., :G], v_glob.view(B, H, 1, G, D))  # (B, H, nb, bs, D)

    # --- global rows: dense attention over the whole sequence
    Gb = global_index.shape[0]
    qg = qb.index_select(2, global_index).reshape(B, H, Gb * bs, D)  # (B, H, Gb*bs, D)
    global_out = _dense_rows(qg, k, v, penalty, scale).view(B, H, Gb, bs, D)  # (B, H, Gb, bs, D)

    # --- pick each block's output: sparse row or its global row
    out = torch.cat([sparse_out, global_out], dim=2).index_select(2, row_source)  # (B, H, nb, bs, D)
    out = out.reshape(B, H, S, D)  # (B, H, S, D)
    if global_tokens is not None:  # each global token's row attends to every key
        out = torch.where(global_tokens.is_global.view(B, 1, S, 1), _global_token_rows(q, k, v, global_tokens, global_qkv, penalty, scale), out)
    return out * key_mask.view(B, 1, S, 1)


def _dense_rows(q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, penalty: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows that attend to every key: q_rows (B, H, R, D), k, v (B, H, S, D), penalty (B, S)
    -> (B, H, R, D)."""
    B, S = penalty.shape
    scores = torch.matmul(q_rows, k.transpose(-1, -2)) * scale + penalty.view(B, 1, 1, S)  # (B, H, R, S)
    return torch.matmul(F.softmax(scores, dim=-1), v)  # (B, H, R, D)


def _global_token_rows(q, k, v, global_tokens: GlobalTokens, global_qkv, penalty, scale) -> torch.Tensor:
    """(B, H, S, D): at each global position its dense row (elsewhere: some slot's row, unused)."""
    B, H, S, D = q.shape
    q_rows, k_g, v_g = global_qkv if global_qkv is not None else (_gather_tokens(q, global_tokens.index), k, v)
    rows = _dense_rows(q_rows, k_g, v_g, penalty, scale)  # (B, H, G, D)
    return torch.gather(rows, 2, global_tokens.slot.view(B, 1, S, 1).expand(B, H, S, D))  # (B, H, S, D)


def _gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: (B, H, S, D), index: (B, G) positions -> (B, H, G, D)."""
    B, H, S, D = x.shape
    G = index.shape[1]
    return torch.gather(x, 2, index.view(B, 1, G, 1).expand(B, H, G, D))


def _band_mask(key_blocks: torch.Tensor, bs: int, band: int) -> torch.Tensor:
    """(1, H, nb, bs, K*bs) bool: key slot within `band` tokens of the query (key_blocks (H, nb, K))."""
    H, nb, K = key_blocks.shape
    offsets = torch.arange(bs, device=key_blocks.device)
    key_pos = (key_blocks.view(H, nb, K, 1) * bs + offsets).view(H, nb, 1, K * bs)  # (H, nb, 1, K*bs)
    query_pos = (torch.arange(nb, device=key_blocks.device).view(nb, 1) * bs + offsets).view(1, nb, bs, 1)  # (1, nb, bs, 1)
    return ((key_pos - query_pos).abs() <= band).unsqueeze(0)


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
    global_tokens: GlobalTokens | None = None,
    global_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The oracle: full (S x S) attention under the layout's multiplicity mask.

    A key block listed c times in a row contributes c * exp(logit), i.e. log(c) is added to its
    logits; blocks not listed are removed; global rows see every block once. With a band, a
    non-global row keeps only keys at most `band` tokens away. Global tokens: every row sees
    each of them exactly once, and each one's row is plain full attention (with `global_qkv`'s
    projections), written position by position.
    """
    B, H, S, D = q.shape
    key_blocks, valid, global_rows = layout_tensors.key_blocks, layout_tensors.valid, layout_tensors.global_rows
    nb = key_blocks.shape[1]
    bs = S // nb
    scale = 1.0 / D**0.5 if scale is None else scale  # D**0.5, not math.sqrt: traces without a TracerWarning
    key_mask = key_mask.to(q.dtype)

    counts = torch.zeros(H, nb, nb, dtype=q.dtype, device=q.device)
    counts.scatter_add_(2, key_blocks, valid.to(q.dtype))  # (H, nb, nb)
    counts = counts.repeat_interleave(bs, dim=1).repeat_interleave(bs, dim=2)  # (H, S, S)
    if layout_tensors.band:
        pos = torch.arange(S, device=q.device)
        counts = counts * ((pos[:, None] - pos[None, :]).abs() <= layout_tensors.band).to(q.dtype)
    counts = counts.unsqueeze(0).expand(B, H, S, S)  # (B, H, S, S)
    if global_tokens is not None:  # a global key counts once in every row
        counts = torch.where(global_tokens.is_global.view(B, 1, 1, S), torch.ones_like(counts), counts)
    row_is_global = global_rows.repeat_interleave(bs).view(1, 1, S, 1)
    counts = torch.where(row_is_global, torch.ones_like(counts), counts)

    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, S, S)
    logits = logits + torch.log(counts.clamp(min=1.0)) + ((1.0 - key_mask) * MASK_PENALTY).view(B, 1, 1, S)
    logits = logits.masked_fill(counts == 0, _excluded(logits.dtype))
    out = torch.matmul(F.softmax(logits, dim=-1), v)  # (B, H, S, D)
    if global_tokens is not None:
        out = out.clone()
        q_rows, k_g, v_g = global_qkv if global_qkv is not None else (None, k, v)
        for b in range(B):
            for g in range(global_tokens.index.shape[1]):
                if not global_tokens.valid[b, g]:
                    continue
                pos = int(global_tokens.index[b, g])
                qr = q[b, :, pos] if q_rows is None else q_rows[b, :, g]  # (H, D)
                lg = (qr[:, None, :] * k_g[b]).sum(-1) * scale + (1.0 - key_mask[b]) * MASK_PENALTY  # (H, S)
                out[b, :, pos] = (F.softmax(lg, dim=-1).unsqueeze(1) @ v_g[b]).squeeze(1)  # (H, D)
    return out * key_mask.view(B, 1, S, 1)
