"""Block-sparse attention lowered to plain ONNX (opset 17): Gather, MatMul, Softmax, Reshape.

The layout is data fed at run time, not constants (docs/export.md says why):

    layout_key_blocks (L, H, nb, K) int64   key block per (layer, head, query block, slot)
    layout_valid      (L, H, nb, K) bool    False = padding slot
    global_blocks     (G,) int64            query blocks that attend to every key (G >= 1)
    block_source      (nb,) int64           i for a sparse row, nb + g for global block g

For a padded length S = nb * block_size (paper App. D, Fig. 6):

    sparse rows:  gather the K key/value blocks of each (head, query block), one batched MatMul,
                  masked softmax over K * block_size keys, MatMul with the gathered values.
                  A key block listed twice counts twice (transformers' hf-eval plan relies on it).
    global rows:  gather the G global query blocks and attend densely to all S keys.
    combine:      concatenate [sparse (nb blocks), global (G blocks)] and gather with
                  block_source, so no Scatter is needed.

Short inputs (seq_len <= full_attention_max_length) run through the same graph with a dense
table: K = nb, every row lists every key block, which is exact full attention.

This module builds graphs and needs the `onnx` package; the host side that serving needs (the
input names `LAYOUT_INPUTS`, the feeds) is export/layout_feed.py, which does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from longdoc.export.graph import NEG_INF, GraphBuilder

HEADS_PER_GROUP = 4  # block-sparse attention runs over groups of this many heads, one after another


@dataclass(frozen=True)
class AttentionContext:
    """Tensors shared by every layer of one graph."""

    block_size: int
    num_heads: int
    head_dim: int
    key_bias: str  # (B, 1, 1, S) additive key-padding bias
    key_mask_blocks: str | None  # (B, nb, bs) 1.0 = real token (sparse graphs)
    head_offset: str | None  # (H, 1, 1) int64: h * nb, turns per-head block ids into flat ids
    sparse: bool
    heads_per_group: int = 0  # 0 = all heads at once

    def head_groups(self) -> list[tuple[int, int]]:
        """[start, stop) head ranges, computed one after another (the last may be shorter)."""
        n = self.heads_per_group or self.num_heads
        return [(h, min(h + n, self.num_heads)) for h in range(0, self.num_heads, n)]


def declare_layout_inputs(g: GraphBuilder) -> None:
    g.input("layout_key_blocks", TensorProto.INT64, ["layers", "heads", "blocks", "slots"])
    g.input("layout_valid", TensorProto.BOOL, ["layers", "heads", "blocks", "slots"])
    g.input("global_blocks", TensorProto.INT64, ["global"])
    g.input("block_source", TensorProto.INT64, ["blocks"])


def attention_context(g: GraphBuilder, attention_mask: str, block_size: int, num_heads: int,
                      head_dim: int, sparse: bool, heads_per_group: int | None = None) -> AttentionContext:
    """heads_per_group: None = HEADS_PER_GROUP, 0 = all heads in one group."""
    m = g.to_float(attention_mask)  # (B, S) 1.0 = real token
    bias = g.op("Mul", [g.op("Sub", [g.fconst(1.0), m]), g.fconst(NEG_INF)])
    key_bias = g.op("Unsqueeze", [bias, g.const([1, 2])])  # (B, 1, 1, S)
    per_group = HEADS_PER_GROUP if heads_per_group is None else heads_per_group
    per_group = min(per_group, num_heads) if per_group > 0 else 0
    if not sparse:
        return AttentionContext(block_size, num_heads, head_dim, key_bias, None, None, False, per_group)
    key_mask_blocks = g.op("Reshape", [m, g.const([0, -1, block_size])])  # (B, nb, bs)
    nb = g.op("Gather", [g.op("Shape", [key_mask_blocks]), g.const(1)], axis=0)  # scalar
    head_offset = g.op("Mul", [g.const(np.arange(num_heads).reshape(num_heads, 1, 1)), nb])  # (H,1,1)
    return AttentionContext(block_size, num_heads, head_dim, key_bias, key_mask_blocks, head_offset, True,
                            per_group)


def split_heads(g: GraphBuilder, x: str, ctx: AttentionContext) -> str:
    """(B, S, H*D) -> (B, H, S, D)"""
    x = g.op("Reshape", [x, g.const([0, 0, ctx.num_heads, ctx.head_dim])])  # (B, S, H, D)
    return g.op("Transpose", [x], perm=[0, 2, 1, 3])


def merge_heads(g: GraphBuilder, x: str, ctx: AttentionContext) -> str:
    """(B, H, S, D) -> (B, S, H*D)"""
    x = g.op("Transpose", [x], perm=[0, 2, 1, 3])
    return g.op("Reshape", [x, g.const([0, 0, ctx.num_heads * ctx.head_dim])])


def dense_attention(g: GraphBuilder, q: str, k: str, v: str, bias: str, scale: float) -> str:
    """softmax(q k^T * scale + bias) v with q (B,H,T,D), k/v (B,H,S,D), bias broadcastable
    to (B,H,T,S)."""
    q = g.op("Mul", [q, g.fconst(scale)])
    scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])])  # (B, H, T, S)
    probs = g.op("Softmax", [g.op("Add", [scores, bias])], axis=-1)
    return g.op("MatMul", [probs, v])  # (B, H, T, D)


def block_sparse_attention(g: GraphBuilder, q: str, k: str, v: str, layer: int,
                           ctx: AttentionContext) -> str:
    """q, k, v: (B, S, H*D) projections; returns (B, S, H*D). Scale 1/sqrt(D) is applied here."""
    bs, D = ctx.block_size, ctx.head_dim
    scale = 1.0 / float(np.sqrt(D))
    q, k, v = (split_heads(g, t, ctx) for t in (q, k, v))  # (B, H, S, D)
    groups = ctx.head_groups()
    if not ctx.sparse:
        # full attention (original_full checkpoints): the (B, h, S, S) scores, their masked copy
        # and the probabilities exist for one head group at a time, which is what lets a
        # BigBird-base full-attention graph run at 16384 tokens in 24 GiB (all 12 heads: 24.6 GiB)
        outs = [dense_attention(g, *_heads(g, (q, k, v), h0, h1, len(groups)), ctx.key_bias, scale)
                for h0, h1 in groups]
        return merge_heads(g, outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1), ctx)

    q = g.op("Mul", [q, g.fconst(scale)])
    key_blocks = g.op("Gather", ["layout_key_blocks", g.const(layer)], axis=0)  # (H, nb, K) this layer's table
    valid = g.op("Gather", ["layout_valid", g.const(layer)], axis=0)  # (H, nb, K)

    # Heads in groups, one group after another: the gathered keys/values, scores and
    # probabilities (each (B, h, nb, bs, K*bs), the activation peak) exist for one group at a time.
    outs = []
    for h0, h1 in groups:
        parts = _heads(g, (q, k, v), h0, h1, len(groups), axis=1) + _heads(g, (key_blocks, valid), h0, h1,
                                                                              len(groups), axis=0)
        offset = ctx.head_offset if len(groups) == 1 else g.op(
            "Slice", [ctx.head_offset, g.const([0]), g.const([h1 - h0]), g.const([0])])
        outs.append(_head_group_attention(g, *parts, offset, ctx))
    out = outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1)  # (B, H, nb, bs, D)
    out = g.op("Transpose", [out], perm=[0, 2, 3, 1, 4])  # (B, nb, bs, H, D)
    return g.op("Reshape", [out, g.const([0, -1, ctx.num_heads * D])])  # (B, S, H*D)


def _heads(g: GraphBuilder, tensors: tuple[str, ...], h0: int, h1: int, n_groups: int,
           axis: int = 1) -> tuple[str, ...]:
    """Heads [h0, h1) of each tensor along `axis` (no Slice when there is one group)."""
    if n_groups == 1:
        return tensors
    start, stop = g.const([h0]), g.const([h1])
    return tuple(g.op("Slice", [t, start, stop, g.const([axis])]) for t in tensors)


def _head_group_attention(g: GraphBuilder, q: str, k: str, v: str, key_blocks: str, valid: str,
                          head_offset: str, ctx: AttentionContext) -> str:
    """One group of h heads: q (scaled), k, v (B, h, S, D); key_blocks, valid (h, nb, K);
    head_offset (h, 1, 1) -> (B, h, nb, bs, D)."""
    bs, D = ctx.block_size, ctx.head_dim
    qb = g.op("Reshape", [q, g.const([0, 0, -1, bs, D])])  # (B, h, nb, bs, D)
    k_flat = g.op("Reshape", [k, g.const([0, -1, bs, D])])  # (B, h*nb, bs, D)
    v_flat = g.op("Reshape", [v, g.const([0, -1, bs, D])])  # (B, h*nb, bs, D)
    flat_blocks = g.op("Add", [key_blocks, head_offset])  # (h, nb, K) ids into h*nb

    # sparse rows: gathered keys/values, one batched MatMul per side
    # (node order matters for peak memory: the gathered values are made only after the softmax,
    # so the gathered keys, the scores and the gathered values are never all alive at once)
    kg = g.op("Gather", [k_flat, flat_blocks], axis=1)  # (B, h, nb, K, bs, D)
    kg = g.op("Reshape", [kg, g.const([0, 0, 0, -1, D])])  # (B, h, nb, K*bs, D)
    scores = g.op("MatMul", [qb, g.op("Transpose", [kg], perm=[0, 1, 2, 4, 3])])  # (B, h, nb, bs, K*bs)

    key_real = g.op("Gather", [ctx.key_mask_blocks, key_blocks], axis=1)  # (B, h, nb, K, bs)
    slot_ok = g.op("Unsqueeze", [g.to_float(valid), g.const([-1])])  # (h, nb, K, 1)
    allowed = g.op("Reshape", [g.op("Mul", [key_real, slot_ok]), g.const([0, 0, 0, 1, -1])])  # (B,h,nb,1,K*bs)
    bias = g.op("Mul", [g.op("Sub", [g.fconst(1.0), allowed]), g.fconst(NEG_INF)])
    probs = g.op("Softmax", [g.op("Add", [scores, bias])], axis=-1)
    vg = g.op("Gather", [v_flat, flat_blocks], axis=1)  # (B, h, nb, K, bs, D)
    vg = g.op("Reshape", [vg, g.const([0, 0, 0, -1, D])])  # (B, h, nb, K*bs, D)
    sparse_out = g.op("MatMul", [probs, vg])  # (B, h, nb, bs, D)

    # global rows: their query blocks attend to every key
    qg = g.op("Gather", [qb, "global_blocks"], axis=2)  # (B, h, G, bs, D)
    qg = g.op("Reshape", [qg, g.const([0, 0, -1, D])])  # (B, h, G*bs, D)
    g_scores = g.op("MatMul", [qg, g.op("Transpose", [k], perm=[0, 1, 3, 2])])  # (B, h, G*bs, S)
    g_probs = g.op("Softmax", [g.op("Add", [g_scores, ctx.key_bias])], axis=-1)
    global_out = g.op("Reshape", [g.op("MatMul", [g_probs, v]), g.const([0, 0, -1, bs, D])])  # (B,h,G,bs,D)

    both = g.op("Concat", [sparse_out, global_out], axis=2)  # (B, h, nb+G, bs, D)
    return g.op("Gather", [both, "block_source"], axis=2)  # (B, h, nb, bs, D)
