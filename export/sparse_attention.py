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

How the sparse rows' blocks are gathered is an export choice (`longdoc export --sparse-gather`,
SPARSE_GATHER; `_block_tensors`): one Gather per head group (the default) or for all heads, a
product with a one-hot table, or the window's blocks as slices of a shifted copy with only the
table's other blocks gathered (the runtime then feeds the table without the window). All exact.

Longformer (Beltagy et al. 2020, Sec. 3.1; the PyTorch side is longdoc.model.attention) adds two
things to the same sparse rows, and takes no `global_blocks` / `block_source` inputs:

    band          keys more than `band` tokens from the query are removed inside the gathered
                  window blocks (a mask computed from the table, so any length works);
    per layer     a window that differs between layers (attention_window [16, 32, 16]) runs over
                  one block size b, the gcd of the layers' w: a layer of w = m b reads the first
                  2 m + 1 slots of its table under a band of w (`for_layer`). The tables of all
                  layers stack into one input, the narrower ones padded with invalid slots;
    global tokens `global_attention_mask` (B, S) graph input: TopK over the mask gives each row's
                  G global positions (G = the largest count in the batch, at least 1; padding
                  slots are masked). Every sparse row gets G extra key slots holding them (and
                  they leave the window, so each counts once); each global token's own row
                  attends to every key with the global projections, and a Where picks it
                  (CumSum of the mask gives each position its slot). No Loop/If/Scan.

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

from dataclasses import dataclass, replace

import numpy as np
from onnx import TensorProto

from longdoc.export.graph import NEG_INF, GraphBuilder
from longdoc.export.manifest import INT8_ATTENTION, SPARSE_GATHER

HEADS_PER_GROUP = 4  # block-sparse attention runs over groups of this many heads, one after another
# full attention over a whole sequence runs its queries in at most this many row chunks of at least
# QUERY_CHUNK_ROWS rows each (`dense_attention`; docs/export.md, "Query chunks in full attention")
QUERY_CHUNKS = 32
QUERY_CHUNK_ROWS = 256


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
    band: int = 0  # > 0: keys at most `band` tokens from the query count in sparse rows (Longformer)
    slots: int = 0  # > 0: the layer reads only the first `slots` key blocks of each table row
    global_tokens: GlobalTokenInputs | None = None  # per-request global tokens (Longformer)
    layout_global_rows: bool = True  # the layout's global query blocks (`global_blocks` input)
    int8: str = "off"  # one of INT8_ATTENTION
    gather: str = "gather"  # one of SPARSE_GATHER: how BigBird's windows gather their key/value blocks
    window_blocks: int = 3  # gather "window": the window read from slices (the layout spec's window_blocks)

    def head_groups(self) -> list[tuple[int, int]]:
        """[start, stop) head ranges, computed one after another (the last may be shorter)."""
        n = self.heads_per_group or self.num_heads
        return [(h, min(h + n, self.num_heads)) for h in range(0, self.num_heads, n)]


@dataclass(frozen=True)
class GlobalTokenInputs:
    """Per-request global tokens, computed once per graph from `global_attention_mask`."""

    index: str  # (B, G) int64: each row's global positions, increasing; padding slots hold any position
    slot_bias: str  # (B, 1, 1, 1, G) float: 0 for a real slot, NEG_INF for a padding slot
    is_global: str  # (B, S, 1) bool
    slot: str  # (B, S) int64: the slot of each global position in `index` (0 elsewhere)


def declare_layout_inputs(g: GraphBuilder, layout_global_rows: bool = True) -> None:
    g.input("layout_key_blocks", TensorProto.INT64, ["layers", "heads", "blocks", "slots"])
    g.input("layout_valid", TensorProto.BOOL, ["layers", "heads", "blocks", "slots"])
    if layout_global_rows:
        g.input("global_blocks", TensorProto.INT64, ["global"])
        g.input("block_source", TensorProto.INT64, ["blocks"])


def global_token_inputs(g: GraphBuilder, global_attention_mask: str, attention_mask: str) -> GlobalTokenInputs:
    """global_attention_mask, attention_mask: (B, S) int64 graph inputs (non-zero = global / real).
    A padded position is never global (transformers multiplies the two masks)."""
    is_global = g.op("And", [g.op("Not", [g.op("Equal", [global_attention_mask, g.const(0)])]),
                             g.op("Not", [g.op("Equal", [attention_mask, g.const(0)])])])  # (B, S) bool
    flag = g.op("Cast", [is_global], to=TensorProto.FLOAT)  # (B, S) fp32 in every graph dtype
    count = g.op("ReduceMax", [g.op("ReduceSum", [flag, g.const([1])], keepdims=0)], keepdims=1)  # (1,)
    G = g.op("Cast", [g.op("Max", [count, g.const([1.0], np.float32)])], to=TensorProto.INT64)  # (1,) >= 1
    # global positions first, increasing: key = flag * 2^22 - position (exact in fp32 below 2^22 tokens)
    positions = g.op("Cast", [g.op("Range", [g.const(0), g.op("Gather", [g.op("Shape", [flag]), g.const(1)], axis=0),
                                             g.const(1)])], to=TensorProto.FLOAT)  # (S,)
    key = g.op("Sub", [g.op("Mul", [flag, g.const(float(2 ** 22), np.float32)]), positions])
    _, index = g.op("TopK", [key, G], axis=1, largest=1, sorted=1, n_out=2)  # (B, G)
    real_slot = g.op("GatherElements", [flag, index], axis=1)  # (B, G) 1.0 = a real global token
    bias = g.op("Mul", [g.op("Sub", [g.const(1.0, np.float32), real_slot]), g.const(NEG_INF, np.float32)])
    slot_bias = g.op("Unsqueeze", [g.op("Cast", [bias], to=g.float_type), g.const([1, 2, 3])])  # (B,1,1,1,G)
    slot = g.op("Sub", [g.op("CumSum", [g.op("Cast", [is_global], to=TensorProto.INT64), g.const(1)]), g.const(1)])
    slot = g.op("Max", [slot, g.const(0)])  # (B, S)
    return GlobalTokenInputs(index, slot_bias, g.op("Unsqueeze", [is_global, g.const([2])]), slot)


def gather_tokens(g: GraphBuilder, x: str, index: str) -> str:
    """x (B, S, E), index (B, G) positions -> (B, G, E)."""
    idx = g.op("Unsqueeze", [index, g.const([2])])  # (B, G, 1)
    shape = g.op("Concat", [g.op("Shape", [index]), g.op("Slice", [g.op("Shape", [x]), g.const([2]), g.const([3])])],
                 axis=0)
    return g.op("GatherElements", [x, g.op("Expand", [idx, shape])], axis=1)


def longformer_context(g: GraphBuilder, attention_mask: str, global_attention_mask: str, block_size: int,
                       num_heads: int, head_dim: int) -> AttentionContext:
    """Windows of 3 blocks of w = block_size tokens under a band of w, plus the request's global tokens:
    a real key that is global leaves the window (it has a slot of its own)."""
    ctx = attention_context(g, attention_mask, block_size, num_heads, head_dim, sparse=True)
    tokens = global_token_inputs(g, global_attention_mask, attention_mask)
    local = g.op("And", [g.op("Not", [g.op("Equal", [attention_mask, g.const(0)])]),
                         g.op("Not", [g.op("Squeeze", [tokens.is_global, g.const([2])])])])  # (B, S)
    local_blocks = g.op("Reshape", [g.to_float(local), g.const([0, -1, block_size])])  # (B, nb, bs)
    return replace(ctx, key_mask_blocks=local_blocks, band=block_size, global_tokens=tokens,
                   layout_global_rows=False)


def for_layer(ctx: AttentionContext, spec) -> AttentionContext:
    """The context of one layer whose `longformer` spec (`longdoc.model.layout.longformer_layer_specs`,
    over ctx's block size) sets its band and its table width."""
    if spec.block_size != ctx.block_size:
        raise ValueError(f"layer spec block size {spec.block_size} is not the graph's {ctx.block_size}")
    return replace(ctx, band=spec.band, slots=spec.window_blocks)


def attention_context(g: GraphBuilder, attention_mask: str, block_size: int, num_heads: int,
                      head_dim: int, sparse: bool, heads_per_group: int | None = None,
                      int8: str = "off", gather: str = "gather", window_blocks: int = 3) -> AttentionContext:
    """heads_per_group: None = HEADS_PER_GROUP (gather "all-heads": 0), 0 = all heads in one group;
    int8: INT8_ATTENTION; gather: SPARSE_GATHER (not with int8 attention: `_block_tensors`)."""
    if int8 not in INT8_ATTENTION:
        raise ValueError(f"int8 attention {int8!r} is not one of {', '.join(INT8_ATTENTION)}")
    if gather not in SPARSE_GATHER:
        raise ValueError(f"sparse gather {gather!r} is not one of {', '.join(SPARSE_GATHER)}")
    if gather in ("onehot", "window") and int8 != "off":
        raise ValueError(f"sparse gather {gather!r} is built for float products (int8 attention {int8!r})")
    if heads_per_group is None and gather == "all-heads":
        heads_per_group = 0
    m = g.to_float(attention_mask)  # (B, S) 1.0 = real token
    bias = g.op("Mul", [g.op("Sub", [g.fconst(1.0), m]), g.fconst(NEG_INF)])
    key_bias = g.op("Unsqueeze", [bias, g.const([1, 2])])  # (B, 1, 1, S)
    per_group = HEADS_PER_GROUP if heads_per_group is None else heads_per_group
    per_group = min(per_group, num_heads) if per_group > 0 else 0
    if not sparse:
        return AttentionContext(block_size, num_heads, head_dim, key_bias, None, None, False, per_group, int8=int8,
                                gather=gather, window_blocks=window_blocks)
    key_mask_blocks = g.op("Reshape", [m, g.const([0, -1, block_size])])  # (B, nb, bs)
    nb = g.op("Gather", [g.op("Shape", [key_mask_blocks]), g.const(1)], axis=0)  # scalar
    head_offset = g.op("Mul", [g.const(np.arange(num_heads).reshape(num_heads, 1, 1)), nb])  # (H,1,1)
    return AttentionContext(block_size, num_heads, head_dim, key_bias, key_mask_blocks, head_offset, True,
                            per_group, int8=int8, gather=gather, window_blocks=window_blocks)


def split_heads(g: GraphBuilder, x: str, ctx: AttentionContext) -> str:
    """(B, S, H*D) -> (B, H, S, D)"""
    x = g.op("Reshape", [x, g.const([0, 0, ctx.num_heads, ctx.head_dim])])  # (B, S, H, D)
    return g.op("Transpose", [x], perm=[0, 2, 1, 3])


def merge_heads(g: GraphBuilder, x: str, ctx: AttentionContext) -> str:
    """(B, H, S, D) -> (B, S, H*D)"""
    x = g.op("Transpose", [x], perm=[0, 2, 1, 3])
    return g.op("Reshape", [x, g.const([0, 0, ctx.num_heads * ctx.head_dim])])


def with_key_bias_column(g: GraphBuilder, q: str, k: str, key_bias: str) -> tuple[str, str]:
    """q (B, h, T, D), k (B, h, S, D), key_bias (B, 1, 1, S) -> q' = [q, 1] (B, h, T, D+1) and
    k' = [k, bias] (B, h, S, D+1), so that q' k'^T = q k^T + bias: the key-padding bias rides in the
    scores' product instead of an Add over the scores (exact: the extra term is 0 for a real key)."""
    rows = g.op("Concat", [g.op("Shape", [q], end=3), g.const([1])], axis=0)  # (4,): B, h, T, 1
    keys = g.op("Concat", [g.op("Shape", [k], end=3), g.const([1])], axis=0)  # (4,): B, h, S, 1
    column = g.op("Expand", [g.op("Transpose", [key_bias], perm=[0, 1, 3, 2]), keys])  # (B, h, S, 1)
    return (g.op("Concat", [q, g.op("Expand", [g.fconst(1.0), rows])], axis=-1),
            g.op("Concat", [k, column], axis=-1))


def query_chunk_sizes(g: GraphBuilder, q: str, chunks: int, min_rows: int) -> str:
    """(chunks,) int64 row counts that split q's T rows (axis 2) in order: c = max(min_rows,
    ceil(T / chunks)) rows per chunk, the last non-empty one shorter, the rest 0. One graph for
    every length: a short input has a few chunks and many empty ones."""
    T = g.op("Gather", [g.op("Shape", [q]), g.const(2)], axis=0)  # scalar
    per = g.op("Max", [g.op("Div", [g.op("Add", [T, g.const(chunks - 1)]), g.const(chunks)]), g.const(min_rows)])
    left = g.op("Sub", [T, g.op("Mul", [g.const(np.arange(chunks)), per])])  # (chunks,) rows from each start
    return g.op("Min", [g.op("Max", [left, g.const(0)]), per])


def dense_attention(g: GraphBuilder, q: str, k: str, v: str, bias: str, scale: float, int8: str = "off",
                    fold_key_bias: bool = False, query_chunks: int = 0) -> str:
    """softmax(q k^T * scale + bias) v with q (B,H,T,D), k/v (B,H,S,D), bias broadcastable
    to (B,H,T,S); int8: INT8_ATTENTION.

    fold_key_bias (bias a key bias (B, 1, 1, S), float products): the bias rides in the product
    as one more column, q' = [q * scale, 1] and k' = [k, bias], so q' k'^T = q k^T * scale + bias
    without an Add over the (B, H, T, S) scores: at 8192 tokens that Add was a quarter of a
    ModernBERT full layer's attention time (docs/notes/modernbert.md). For an encoder's own queries
    (T = S); a decoder step (T = 1) would copy its cached keys every step to save a small Add.

    query_chunks (bias a key bias (B, 1, 1, S)): the queries run in up to this many chunks of rows
    (`query_chunk_sizes`, at least QUERY_CHUNK_ROWS rows each), each chunk's scores, softmax and
    P.V one after another, so only one chunk's (B, H, rows, S) scores exist at a time and they are
    still in the cache when Softmax and P.V read them. Exact: every row is computed as before."""
    q = g.op("Mul", [q, g.fconst(scale)])
    if fold_key_bias and int8 == "off":
        q, k = with_key_bias_column(g, q, k, bias)  # (B, H, T, D+1), (B, H, S, D+1)
        kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])

        def rows(qr: str) -> str:
            return g.op("MatMul", [g.op("Softmax", [g.op("MatMul", [qr, kt])], axis=-1), v])
    else:
        if int8 != "off":
            k, v = quantize_right(g, k, int8), quantize_right(g, v, int8)
        kt = transpose_right(g, k, [0, 1, 3, 2])

        def rows(qr: str) -> str:
            probs = g.op("Softmax", [g.op("Add", [matmul(g, qr, kt), bias])], axis=-1)
            return matmul(g, quantize_probs(g, probs, int8), v)
    if query_chunks <= 1:
        return rows(q)  # (B, H, T, D)
    parts = g.op("Split", [q, query_chunk_sizes(g, q, query_chunks, QUERY_CHUNK_ROWS)], axis=2, n_out=query_chunks)
    return g.op("Concat", [rows(part) for part in parts], axis=2)  # (B, H, T, D)


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
    # allowzero: an empty query chunk's shape (B, h, 0, keys) means 0 rows, not "copy dimension 2"
    data = g.op("Reshape", [g.op("QuantizeLinear", [rows, scale], axis=0), g.op("Shape", [probs])], allowzero=1)
    row_scale = g.op("Reshape", [scale, g.op("Concat", [g.op("Slice", [g.op("Shape", [probs]), g.const([0]),
                                                                      g.const([-1])]), g.const([1])], axis=0)],
                     allowzero=1)
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
                           ctx: AttentionContext, global_qkv: tuple[str, str, str] | None = None) -> str:
    """q, k, v: (B, S, H*D) projections; returns (B, S, H*D). Scale 1/sqrt(D) is applied here.
    global_qkv (with ctx.global_tokens): the global tokens' own rows' projections, q (B, G, H*D) at
    the G slots of `ctx.global_tokens.index`, k, v (B, S, H*D). Its nodes are named
    `<layer scope>attn/...` (an ONNX Runtime profile tells attention from dense layers by it)."""
    outer = g.scope
    g.scope = f"{outer}attn/"
    try:
        return _block_sparse_attention(g, q, k, v, layer, ctx, global_qkv)
    finally:
        g.scope = outer


def _block_sparse_attention(g: GraphBuilder, q: str, k: str, v: str, layer: int, ctx: AttentionContext,
                            global_qkv: tuple[str, str, str] | None) -> str:
    D = ctx.head_dim
    scale = 1.0 / float(np.sqrt(D))
    tokens = ctx.global_tokens
    if tokens is not None:  # the global tokens' keys/values as extra slots of every sparse row
        k_slots, v_slots = (split_heads(g, gather_tokens(g, t, tokens.index), ctx) for t in (k, v))  # (B, H, G, D)
    q, k, v = (split_heads(g, t, ctx) for t in (q, k, v))  # (B, H, S, D)
    groups = ctx.head_groups()
    if not ctx.sparse:
        # full attention (original_full checkpoints): the (B, h, S, S) scores, their masked copy
        # and the probabilities exist for one head group at a time, which is what lets a
        # BigBird-base full-attention graph run at 16384 tokens in 24 GiB (all 12 heads: 24.6 GiB)
        outs = [dense_attention(g, *_heads(g, (q, k, v), h0, h1, len(groups)), ctx.key_bias, scale, ctx.int8,
                                fold_key_bias=True, query_chunks=QUERY_CHUNKS)
                for h0, h1 in groups]
        return merge_heads(g, outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1), ctx)

    q = g.op("Mul", [q, g.fconst(scale)])
    key_blocks = g.op("Gather", ["layout_key_blocks", g.const(layer)], axis=0)  # (H, nb, K) this layer's table
    valid = g.op("Gather", ["layout_valid", g.const(layer)], axis=0)  # (H, nb, K)
    if ctx.slots:  # this layer's window: the first `slots` columns (the stacked table may be wider)
        key_blocks, valid = (g.op("Slice", [t, g.const([0]), g.const([ctx.slots]), g.const([2])])
                             for t in (key_blocks, valid))  # (H, nb, min(K, slots))

    # Heads in groups, one group after another: the gathered keys/values, scores and
    # probabilities (each (B, h, nb, bs, K*bs), the activation peak) exist for one group at a time.
    # Longformer's window is one table for every head (model/layout.py `_longformer`): its mask, with
    # the token-level band, is built once per layer from head 0's row, (B, 1, nb, bs, K*bs), instead
    # of once per head group (the band's element-wise work was most of the attention's time)
    shared_bias = _window_bias(g, *(g.op("Slice", [t, g.const([0]), g.const([1]), g.const([0])])
                                    for t in (key_blocks, valid)), ctx) if ctx.band else None
    outs = []
    for h0, h1 in groups:
        parts = _heads(g, (q, k, v), h0, h1, len(groups), axis=1) + _heads(g, (key_blocks, valid), h0, h1,
                                                                              len(groups), axis=0)
        offset = ctx.head_offset if len(groups) == 1 else g.op(
            "Slice", [ctx.head_offset, g.const([0]), g.const([h1 - h0]), g.const([0])])
        slots = _heads(g, (k_slots, v_slots), h0, h1, len(groups), axis=1) if tokens is not None else None
        outs.append(_head_group_attention(g, *parts, offset, ctx, slots, shared_bias))
    out = outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1)  # (B, H, nb, bs, D)
    out = g.op("Transpose", [out], perm=[0, 2, 3, 1, 4])  # (B, nb, bs, H, D)
    out = g.op("Reshape", [out, g.const([0, -1, ctx.num_heads * D])])  # (B, S, H*D)
    if tokens is None:
        return out
    # each global token's own row attends to every key with the global projections
    qg, kg, vg = (split_heads(g, t, ctx) for t in global_qkv)  # (B, H, G, D), (B, H, S, D) x2
    rows = dense_attention(g, qg, kg, vg, ctx.key_bias, scale, fold_key_bias=True)  # (B, H, G, D)
    rows = merge_heads(g, rows, ctx)  # (B, G, H*D)
    at_position = g.op("GatherElements", [rows, g.op("Expand", [g.op("Unsqueeze", [tokens.slot, g.const([2])]),
                                                                g.op("Shape", [out])])], axis=1)  # (B, S, H*D)
    return g.op("Where", [tokens.is_global, at_position, out])


def _heads(g: GraphBuilder, tensors: tuple[str, ...], h0: int, h1: int, n_groups: int,
           axis: int = 1) -> tuple[str, ...]:
    """Heads [h0, h1) of each tensor along `axis` (no Slice when there is one group)."""
    if n_groups == 1:
        return tensors
    start, stop = g.const([h0]), g.const([h1])
    return tuple(g.op("Slice", [t, start, stop, g.const([axis])]) for t in tensors)


def _window_bias(g: GraphBuilder, key_blocks: str, valid: str, ctx: AttentionContext) -> str:
    """Additive bias of the sparse rows' keys: 0 = counts, NEG_INF = padded key, table padding slot
    or (ctx.band) outside the band. key_blocks, valid (h, nb, K) -> (B, h, nb, 1 | bs, K*bs)."""
    key_real = g.op("Gather", [ctx.key_mask_blocks, key_blocks], axis=1)  # (B, h, nb, K, bs)
    slot_ok = g.op("Unsqueeze", [g.to_float(valid), g.const([-1])])  # (h, nb, K, 1)
    allowed = g.op("Reshape", [g.op("Mul", [key_real, slot_ok]), g.const([0, 0, 0, 1, -1])])  # (B,h,nb,1,K*bs)
    if ctx.band:
        allowed = g.op("Mul", [allowed, _band_mask(g, key_blocks, ctx.block_size, ctx.band)])  # (B,h,nb,bs,K*bs)
    return g.op("Mul", [g.op("Sub", [g.fconst(1.0), allowed]), g.fconst(NEG_INF)])


def _head_group_attention(g: GraphBuilder, q: str, k: str, v: str, key_blocks: str, valid: str,
                          head_offset: str, ctx: AttentionContext, slots: tuple[str, str] | None = None,
                          bias: str | None = None) -> str:
    """One group of h heads: q (scaled), k, v (B, h, S, D); key_blocks, valid (h, nb, K);
    head_offset (h, 1, 1); slots: the global tokens' keys and values (B, h, G, D); bias: the window's
    (`_window_bias`) when shared by every head, else built here -> (B, h, nb, bs, D)."""
    bs, D = ctx.block_size, ctx.head_dim
    # BigBird's windows (no band, no per-request global tokens, float products): the window's bias
    # rides in the scores' product, as in `dense_attention`. Each key carries its padding bias as a
    # last feature (`with_key_bias_column`), and a table's padding slot gathers a block appended
    # after the real ones whose bias is NEG_INF, so no element-wise op passes over the
    # (B, h, nb, bs, K*bs) scores (the Add was 15% of the encoder's GPU time, docs/gpu.md)
    fold = not ctx.band and slots is None and ctx.int8 == "off" and bias is None
    Dk = D + 1 if fold else D  # the keys' (and queries') last axis
    if fold:
        q, k = with_key_bias_column(g, q, k, ctx.key_bias)  # (B, h, S, D+1)
    if ctx.int8 != "off":  # once per group, before any block is gathered (queries: at their products)
        k, v = quantize_right(g, k, ctx.int8), quantize_right(g, v, ctx.int8)
    qb = g.op("Reshape", [q, g.const([0, 0, -1, bs, Dk])])  # (B, h, nb, bs, Dk)
    if ctx.gather in ("onehot", "window") and not fold:
        raise ValueError(f"sparse gather {ctx.gather!r} is built for BigBird's windows (no band, no global "
                         "tokens, float products)")

    # sparse rows: the key/value blocks of each row, one batched MatMul per side
    # (node order matters for peak memory: the values' blocks are made only after the softmax,
    # so the keys' blocks, the scores and the values' blocks are never all alive at once)
    kg = _block_tensors(g, k, key_blocks, valid, head_offset, ctx, Dk, fold)  # (B, h, nb, K'*bs, Dk)
    scores = matmul(g, qb, transpose_right(g, kg, [0, 1, 2, 4, 3]))  # (B, h, nb, bs, K'*bs)

    if not fold:
        scores = g.op("Add", [scores, _window_bias(g, key_blocks, valid, ctx) if bias is None else bias])
    if slots is not None:  # G global key slots in front of the window's keys
        k_slots, v_slots = (g.op("Unsqueeze", [t, g.const([2])]) for t in slots)  # (B, h, 1, G, D)
        slot_scores = g.op("MatMul", [qb, g.op("Transpose", [k_slots], perm=[0, 1, 2, 4, 3])])  # (B,h,nb,bs,G)
        scores = g.op("Concat", [g.op("Add", [slot_scores, ctx.global_tokens.slot_bias]), scores], axis=-1)
    probs = g.op("Softmax", [scores], axis=-1)
    if slots is not None:
        G = g.op("Shape", [slots[0]], start=2, end=3)  # (1,)
        slot_probs = g.op("Slice", [probs, g.const([0]), G, g.const([-1])])  # (B, h, nb, bs, G)
        probs = g.op("Slice", [probs, G, g.const([2 ** 62]), g.const([-1])])  # (B, h, nb, bs, K*bs)
    probs = quantize_probs(g, probs, ctx.int8)
    vg = _block_tensors(g, v, key_blocks, valid, head_offset, ctx, D, False)  # (B, h, nb, K'*bs, D)
    sparse_out = matmul(g, probs, vg)  # (B, h, nb, bs, D)
    if slots is not None:
        sparse_out = g.op("Add", [sparse_out, g.op("MatMul", [slot_probs, v_slots])])
    if not ctx.layout_global_rows:
        return sparse_out

    # global rows: their query blocks attend to every key
    qg = g.op("Gather", [qb, "global_blocks"], axis=2)  # (B, h, G, bs, Dk)
    qg = g.op("Reshape", [qg, g.const([0, 0, -1, Dk])])  # (B, h, G*bs, Dk)
    g_scores = matmul(g, qg, transpose_right(g, k, [0, 1, 3, 2]))  # (B, h, G*bs, S)
    if not fold:  # folded: k's last feature is the key bias
        g_scores = g.op("Add", [g_scores, ctx.key_bias])
    g_probs = quantize_probs(g, g.op("Softmax", [g_scores], axis=-1), ctx.int8)
    global_out = g.op("Reshape", [matmul(g, g_probs, v), g.const([0, 0, -1, bs, D])])  # (B,h,G,bs,D)

    both = g.op("Concat", [sparse_out, global_out], axis=2)  # (B, h, nb+G, bs, D)
    return g.op("Gather", [both, "block_source"], axis=2)  # (B, h, nb, bs, D)


def _block_tensors(g: GraphBuilder, x, key_blocks: str, valid: str, head_offset: str, ctx: AttentionContext,
                   width: int, keys: bool) -> str:
    """Each sparse row's key (or value) blocks, side by side: x (B, h, S, width) -> (B, h, nb, K'*bs,
    width), for a table key_blocks, valid (h, nb, K). keys (the fold: x's last feature is the key
    bias): a padding slot reads a block of zero keys whose bias is NEG_INF, appended after the real
    ones; a value's padding slot reads any block (its probability is 0), or zeros.

    ctx.gather (SPARSE_GATHER), each exact (verify):
      gather, all-heads  one Gather of (B, h*nb, bs, width) by the flat block ids (K' = K);
      onehot   a product with a one-hot table of the ids (h, nb*K, nb+1) by (B, h, nb+1, bs*width): a
               GEMM that copies, every output one product by 1 plus products by 0 (K' = K);
      window   the window's W blocks (i - W//2 .. i + W//2) as W slices of a copy shifted by padding
               blocks (zero keys under NEG_INF outside the sequence), then the table's other blocks
               by one Gather: the table holds only those (layout_feed.without_window; K' = W + K)."""
    bs = ctx.block_size
    if ctx.gather == "onehot":
        blocks = g.op("Reshape", [x, g.const([0, 0, -1, bs * width])])  # (B, h, nb, bs*width)
        nb = g.op("Shape", [blocks], start=2, end=3)  # (1,)
        extra = _padding_blocks(g, blocks, 1, (bs * width,), keys, width)  # (B, h, 1, bs*width)
        blocks = g.op("Concat", [blocks, extra], axis=2)  # (B, h, nb+1, bs*width)
        ids = g.op("Where", [valid, key_blocks, g.op("Squeeze", [nb, g.const([0])])])  # (h, nb, K) in [0, nb]
        columns = g.op("Range", [g.const(0), g.op("Squeeze", [g.op("Add", [nb, g.const([1])]), g.const([0])]),
                                 g.const(1)])  # (nb+1,)
        onehot = g.to_float(g.op("Equal", [g.op("Unsqueeze", [ids, g.const([3])]), columns]))  # (h, nb, K, nb+1)
        onehot = g.op("Reshape", [onehot, g.op("Concat", [g.op("Shape", [onehot], end=1), g.const([-1]),
                                                          g.op("Shape", [onehot], start=3)], axis=0)])
        picked = g.op("MatMul", [onehot, blocks])  # (B, h, nb*K, bs*width)
        return g.op("Reshape", [picked, g.op("Concat", [g.op("Shape", [blocks], end=2), nb, g.const([-1, width])],
                                             axis=0)])  # (B, h, nb, K*bs, width)
    flat = _map(g, x, "Reshape", [g.const([0, -1, bs, width])])  # (B, h*nb, bs, width); int8: quantized
    flat_blocks = g.op("Add", [key_blocks, head_offset])  # (h, nb, K) ids into h*nb
    ids = flat_blocks
    if keys:  # padding slots -> block h*nb
        n_blocks = g.op("Shape", [flat], start=1, end=2)  # (1,) h*nb
        flat = g.op("Concat", [flat, _padding_blocks(g, flat, 1, (bs, width), True, width)], axis=1)
        ids = g.op("Where", [valid, flat_blocks, g.op("Squeeze", [n_blocks, g.const([0])])])
    gathered = _map(g, flat, "Gather", [ids], axis=1)  # (B, h, nb, K, bs, width)
    gathered = _map(g, gathered, "Reshape", [g.const([0, 0, 0, -1, width])])  # (B, h, nb, K*bs, width)
    if ctx.gather != "window":
        return gathered
    half = ctx.window_blocks // 2
    blocks = g.op("Reshape", [x, g.const([0, 0, -1, bs, width])])  # (B, h, nb, bs, width)
    nb = g.op("Shape", [blocks], start=2, end=3)  # (1,)
    pad = _padding_blocks(g, blocks, half, (bs, width), keys, width)  # (B, h, half, bs, width)
    shifted = g.op("Concat", [pad, blocks, pad], axis=2)  # (B, h, nb + 2 half, bs, width)
    window = [blocks if d == half else g.op("Slice", [shifted, g.const([d]), g.op("Add", [nb, g.const([d])]),
                                                        g.const([2])])
              for d in range(2 * half + 1)]  # each (B, h, nb, bs, width): block i - half + d of row i
    return g.op("Concat", [*window, gathered], axis=3)  # (B, h, nb, (W + K)*bs, width)


def _padding_blocks(g: GraphBuilder, like: str, n: int, tail: tuple[int, ...], keys: bool, width: int) -> str:
    """n blocks to append on axis len(shape(like)) - len(tail) - 1 of `like` (its leading dims kept):
    zero keys whose last feature (the key bias) is NEG_INF when `keys`, else zeros."""
    block = np.zeros(tail, np.float32)  # (bs, width) or (bs*width,)
    if keys:
        block.reshape(-1, width)[:, -1] = NEG_INF
    lead = g.op("Shape", [like], end=-1 - len(tail))  # the dims before the block axis
    return g.op("Expand", [g.fconst(block), g.op("Concat", [lead, g.const([n, *tail])], axis=0)])


def _band_mask(g: GraphBuilder, key_blocks: str, bs: int, band: int) -> str:
    """(h, nb, bs, K*bs) float, 1.0 = the key slot is at most `band` tokens from the query
    (key_blocks (h, nb, K))."""
    offsets = g.const(np.arange(bs))
    key_pos = g.op("Add", [g.op("Unsqueeze", [g.op("Mul", [key_blocks, g.const(bs)]), g.const([3])]), offsets])
    key_pos = g.op("Reshape", [key_pos, g.const([0, 0, 1, -1])])  # (h, nb, 1, K*bs)
    nb = g.op("Shape", [key_blocks], start=1, end=2)  # (1,)
    query_pos = g.op("Range", [g.const(0), g.op("Squeeze", [g.op("Mul", [nb, g.const([bs])]), g.const([0])]),
                               g.const(1)])
    query_pos = g.op("Reshape", [query_pos, g.const([1, -1, bs, 1])])  # (1, nb, bs, 1)
    near = g.op("LessOrEqual", [g.op("Abs", [g.op("Sub", [key_pos, query_pos])]), g.const(band)])
    return g.to_float(near)
