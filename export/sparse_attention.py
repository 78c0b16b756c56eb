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

int8 attention (`longdoc export --int8-attention`, INT8_ATTENTION): both products, Q.K^T and P.V,
run as MatMulInteger on 8-bit operands, each rescaled by the product of its operands' scales
(Cast + Mul). K and V are quantized once per head group, before their blocks are gathered, so the
Gathers move bytes, not floats; the left operands (Q, P) are quantized right at their products, so
that ONNX Runtime fuses quantize + product + rescale into one DynamicQuantizeMatMul kernel:

    dynamic     DynamicQuantizeLinear (uint8, per tensor, with zero point) on Q, K, V and P
    dynamic-s8  Q and P as `dynamic`; K and V symmetric int8 (scale max|x| / 127, zero point 0),
                so the products are uint8 x int8, the pair AVX-512 VNNI multiplies natively
    per-row     as `dynamic-s8`, but every row of P gets its own scale (row max / 255): a flat
                row (p ~ 1/K) keeps its resolution next to a peaked one
    static-p    as `dynamic-s8`, but P with the fixed scale 1/255 (its range is [0, 1] by
                construction, no calibration needed)

This module builds graphs and needs the `onnx` package; the host side that serving needs (the
input names `LAYOUT_INPUTS`, the feeds) is export/layout_feed.py, which does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from longdoc.export.graph import NEG_INF, GraphBuilder
from longdoc.export.manifest import INT8_ATTENTION

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
    int8: str = "off"  # one of INT8_ATTENTION

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
                      head_dim: int, sparse: bool, heads_per_group: int | None = None,
                      int8: str = "off") -> AttentionContext:
    """heads_per_group: None = HEADS_PER_GROUP, 0 = all heads in one group; int8: INT8_ATTENTION."""
    if int8 not in INT8_ATTENTION:
        raise ValueError(f"int8 attention {int8!r} is not one of {', '.join(INT8_ATTENTION)}")
    m = g.to_float(attention_mask)  # (B, S) 1.0 = real token
    bias = g.op("Mul", [g.op("Sub", [g.fconst(1.0), m]), g.fconst(NEG_INF)])
    key_bias = g.op("Unsqueeze", [bias, g.const([1, 2])])  # (B, 1, 1, S)
    per_group = HEADS_PER_GROUP if heads_per_group is None else heads_per_group
    per_group = min(per_group, num_heads) if per_group > 0 else 0
    if not sparse:
        return AttentionContext(block_size, num_heads, head_dim, key_bias, None, None, False, per_group, int8)
    key_mask_blocks = g.op("Reshape", [m, g.const([0, -1, block_size])])  # (B, nb, bs)
    nb = g.op("Gather", [g.op("Shape", [key_mask_blocks]), g.const(1)], axis=0)  # scalar
    head_offset = g.op("Mul", [g.const(np.arange(num_heads).reshape(num_heads, 1, 1)), nb])  # (H,1,1)
    return AttentionContext(block_size, num_heads, head_dim, key_bias, key_mask_blocks, head_offset, True,
                            per_group, int8)


def split_heads(g: GraphBuilder, x: str, ctx: AttentionContext) -> str:
    """(B, S, H*D) -> (B, H, S, D)"""
    x = g.op("Reshape", [x, g.const([0, 0, ctx.num_heads, ctx.head_dim])])  # (B, S, H, D)
    return g.op("Transpose", [x], perm=[0, 2, 1, 3])


def merge_heads(g: GraphBuilder, x: str, ctx: AttentionContext) -> str:
    """(B, H, S, D) -> (B, S, H*D)"""
    x = g.op("Transpose", [x], perm=[0, 2, 1, 3])
    return g.op("Reshape", [x, g.const([0, 0, ctx.num_heads * ctx.head_dim])])


def dense_attention(g: GraphBuilder, q: str, k: str, v: str, bias: str, scale: float, int8: str = "off") -> str:
    """softmax(q k^T * scale + bias) v with q (B,H,T,D), k/v (B,H,S,D), bias broadcastable
    to (B,H,T,S); int8: INT8_ATTENTION."""
    q = g.op("Mul", [q, g.fconst(scale)])
    if int8 != "off":
        k, v = quantize_right(g, k, int8), quantize_right(g, v, int8)
    scores = matmul(g, q, transpose_right(g, k, [0, 1, 3, 2]))  # (B, H, T, S)
    probs = g.op("Softmax", [g.op("Add", [scores, bias])], axis=-1)
    return matmul(g, quantize_probs(g, probs, int8), v)  # (B, H, T, D)


# --- int8 attention (module docstring) ---------------------------------------------------------
# A tensor is either a float tensor's name (str) or a Quantized one; every op the attention applies
# to a key/value tensor before its product (Reshape, Gather, Transpose, Slice) applies to the
# 8-bit data and leaves scale and zero point alone, since they are per tensor.

@dataclass(frozen=True)
class Quantized:
    data: str  # uint8 or int8, the float tensor's shape
    scale: str  # scalar, or (..., rows, 1) for per-row probabilities
    zero_point: str | None  # scalar; None = 0 (per-row rows have no zero point input)


def _map(g: GraphBuilder, x, op: str, inputs: list[str], **attrs):
    """Apply a data-movement op to a float tensor or to a Quantized one's data."""
    if isinstance(x, Quantized):
        return Quantized(g.op(op, [x.data, *inputs], **attrs), x.scale, x.zero_point)
    return g.op(op, [x, *inputs], **attrs)


def transpose_right(g: GraphBuilder, x, perm: list[int]):
    return _map(g, x, "Transpose", [], perm=perm)


def _dynamic_uint8(g: GraphBuilder, x: str) -> Quantized:
    data, scale, zero_point = g.op("DynamicQuantizeLinear", [x], n_out=3)
    return Quantized(data, scale, zero_point)


def _symmetric_int8(g: GraphBuilder, x: str) -> Quantized:
    """Per tensor, zero point 0: scale = max|x| / 127 (never 0: an all-zero x gets a tiny scale)."""
    amax = g.op("Max", [g.op("ReduceMax", [x], keepdims=0), g.op("Neg", [g.op("ReduceMin", [x], keepdims=0)])])
    scale = g.op("Max", [g.op("Div", [amax, g.fconst(127.0)]), g.fconst(1e-30)])
    zero_point = g.const(0, dtype=np.int8, hint="int8_zero")
    return Quantized(g.op("QuantizeLinear", [x, scale, zero_point]), scale, zero_point)


def quantize_right(g: GraphBuilder, x: str, mode: str) -> Quantized:
    """Keys and values: uint8 with zero point (`dynamic`) or symmetric int8 (the others)."""
    return _dynamic_uint8(g, x) if mode == "dynamic" else _symmetric_int8(g, x)


def quantize_probs(g: GraphBuilder, probs: str, mode: str):
    """The left operand of P.V (softmax output in [0, 1], last axis = keys); `off`, `dynamic` and
    `dynamic-s8` leave it float (`matmul` quantizes it at the product)."""
    if mode in ("off", "dynamic", "dynamic-s8"):
        return probs
    if mode == "static-p":
        scale = g.fconst(1.0 / 255.0)
        zero_point = g.const(0, dtype=np.uint8, hint="uint8_zero")
        return Quantized(g.op("QuantizeLinear", [probs, scale, zero_point]), scale, zero_point)
    # per-row: QuantizeLinear's per-axis form over the rows of a 2-D view, scale = row max / 255
    keys = g.op("Slice", [g.op("Shape", [probs]), g.const([-1]), g.const([2**62])])  # (1,) keys per row
    rows = g.op("Reshape", [probs, g.op("Concat", [g.const([-1]), keys], axis=0)])  # (R, keys)
    scale = g.op("Max", [g.op("Div", [g.op("ReduceMax", [rows, g.const([1])], keepdims=0), g.fconst(255.0)]),
                         g.fconst(1e-30)])  # (R,)
    data = g.op("Reshape", [g.op("QuantizeLinear", [rows, scale], axis=0), g.op("Shape", [probs])])
    row_scale = g.op("Reshape", [scale, g.op("Concat", [g.op("Slice", [g.op("Shape", [probs]), g.const([0]),
                                                                      g.const([-1])]), g.const([1])], axis=0)])
    return Quantized(data, row_scale, None)  # row_scale (..., rows, 1)


def matmul(g: GraphBuilder, a, b) -> str:
    """a @ b (batched), float result. Float a and b: MatMul. Quantized b: a float `a` is quantized
    here, right at its product (DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul, which ONNX
    Runtime fuses into one DynamicQuantizeMatMul kernel; an `a` quantized earlier and reshaped or
    shared by two products left the rescale as separate passes over the scores)."""
    if not isinstance(b, Quantized):
        return g.op("MatMul", [a, b])
    if not isinstance(a, Quantized):
        a = _dynamic_uint8(g, a)
    inputs = [a.data, b.data, a.zero_point or "", b.zero_point or ""]
    while inputs[-1] == "":
        inputs.pop()
    acc = g.op("MatMulInteger", inputs)  # int32
    return g.op("Mul", [g.op("Cast", [acc], to=TensorProto.FLOAT), g.op("Mul", [a.scale, b.scale])])


def block_sparse_attention(g: GraphBuilder, q: str, k: str, v: str, layer: int,
                           ctx: AttentionContext) -> str:
    """q, k, v: (B, S, H*D) projections; returns (B, S, H*D). Scale 1/sqrt(D) is applied here.
    Its nodes are named `<layer scope>attn/...` (bench/profile_ops.py tells attention from dense layers by it)."""
    outer = g.scope
    g.scope = f"{outer}attn/"
    try:
        return _block_sparse_attention(g, q, k, v, layer, ctx)
    finally:
        g.scope = outer


def _block_sparse_attention(g: GraphBuilder, q: str, k: str, v: str, layer: int, ctx: AttentionContext) -> str:
    bs, D = ctx.block_size, ctx.head_dim
    scale = 1.0 / float(np.sqrt(D))
    q, k, v = (split_heads(g, t, ctx) for t in (q, k, v))  # (B, H, S, D)
    groups = ctx.head_groups()
    if not ctx.sparse:
        # full attention (original_full checkpoints): the (B, h, S, S) scores, their masked copy
        # and the probabilities exist for one head group at a time, which is what lets a
        # BigBird-base full-attention graph run at 16384 tokens in 24 GiB (all 12 heads: 24.6 GiB)
        outs = [dense_attention(g, *_heads(g, (q, k, v), h0, h1, len(groups)), ctx.key_bias, scale, ctx.int8)
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
    if ctx.int8 != "off":  # once per group, before any block is gathered (queries: at their products)
        k, v = quantize_right(g, k, ctx.int8), quantize_right(g, v, ctx.int8)
    qb = g.op("Reshape", [q, g.const([0, 0, -1, bs, D])])  # (B, h, nb, bs, D)
    k_flat = _map(g, k, "Reshape", [g.const([0, -1, bs, D])])  # (B, h*nb, bs, D)
    v_flat = _map(g, v, "Reshape", [g.const([0, -1, bs, D])])  # (B, h*nb, bs, D)
    flat_blocks = g.op("Add", [key_blocks, head_offset])  # (h, nb, K) ids into h*nb

    # sparse rows: gathered keys/values, one batched MatMul per side
    # (node order matters for peak memory: the gathered values are made only after the softmax,
    # so the gathered keys, the scores and the gathered values are never all alive at once)
    kg = _map(g, k_flat, "Gather", [flat_blocks], axis=1)  # (B, h, nb, K, bs, D)
    kg = _map(g, kg, "Reshape", [g.const([0, 0, 0, -1, D])])  # (B, h, nb, K*bs, D)
    scores = matmul(g, qb, transpose_right(g, kg, [0, 1, 2, 4, 3]))  # (B, h, nb, bs, K*bs)

    key_real = g.op("Gather", [ctx.key_mask_blocks, key_blocks], axis=1)  # (B, h, nb, K, bs)
    slot_ok = g.op("Unsqueeze", [g.to_float(valid), g.const([-1])])  # (h, nb, K, 1)
    allowed = g.op("Reshape", [g.op("Mul", [key_real, slot_ok]), g.const([0, 0, 0, 1, -1])])  # (B,h,nb,1,K*bs)
    bias = g.op("Mul", [g.op("Sub", [g.fconst(1.0), allowed]), g.fconst(NEG_INF)])
    probs = quantize_probs(g, g.op("Softmax", [g.op("Add", [scores, bias])], axis=-1), ctx.int8)
    vg = _map(g, v_flat, "Gather", [flat_blocks], axis=1)  # (B, h, nb, K, bs, D)
    vg = _map(g, vg, "Reshape", [g.const([0, 0, 0, -1, D])])  # (B, h, nb, K*bs, D)
    sparse_out = matmul(g, probs, vg)  # (B, h, nb, bs, D)

    # global rows: their query blocks attend to every key
    qg = g.op("Gather", [qb, "global_blocks"], axis=2)  # (B, h, G, bs, D)
    qg = g.op("Reshape", [qg, g.const([0, 0, -1, D])])  # (B, h, G*bs, D)
    g_scores = matmul(g, qg, transpose_right(g, k, [0, 1, 3, 2]))  # (B, h, G*bs, S)
    g_probs = quantize_probs(g, g.op("Softmax", [g.op("Add", [g_scores, ctx.key_bias])], axis=-1), ctx.int8)
    global_out = g.op("Reshape", [matmul(g, g_probs, v), g.const([0, 0, -1, bs, D])])  # (B,h,G,bs,D)

    both = g.op("Concat", [sparse_out, global_out], axis=2)  # (B, h, nb+G, bs, D)
    return g.op("Gather", [both, "block_source"], axis=2)  # (B, h, nb, bs, D)
