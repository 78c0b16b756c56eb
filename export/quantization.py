"""int8 activations with one scale per row, so that a row's answer never depends on its batch.

ONNX Runtime's `quantize_dynamic` quantizes each activation entering a dense layer with
`DynamicQuantizeLinear`: one scale and zero point for the whole tensor, so every row's result
depends on the other rows of the batch, padding included (docs/export.md, "int8"). This module's
post-pass replaces each of them by a per-row quantization, standard ops only:

    scale = max(max(x) / (255 - z), -min(x) / z) over the row's last axis     (..., 1)
    data  = QuantizeLinear(x, scale, z), per row (its per-axis form over a 2-D view)   uint8
    zero point z: a scalar, 128 (GELU outputs: 32, and GELU's own minimum, -0.1701, for min(x))

`MatMulInteger` takes only a scalar zero point for its left operand, and int8 x int8 has no fast
kernel on x86; a scale per row with uint8 values around a fixed zero point keeps the uint8 x int8
kernel `quantize_dynamic`'s graph uses. The scale is (..., rows, 1), and the graph's own rescale
`Mul(x_scale, w_scale)` broadcasts it over the product's columns; each bias Add after it becomes a
Sub (`_unfuse_bias` says how and why).

Every step is element-wise within a row, and `MatMulInteger` accumulates in int32 (exact), so a
row's output is bitwise the same whatever else is in its batch. The int8 attention products
(export/sparse_attention.py) quantize their operands with the same `quantize`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from longdoc.export.graph import GraphBuilder

ZERO_POINT = 128  # uint8 values around 128: a row's negatives and positives alike
# an activation GELU produced is >= -0.1701 (x Phi(x) >= -0.16997; its tanh form >= -0.17004): 223 of
# its 255 values go to the positive side, and that bound stands for the row's minimum (the scale is
# max / 223 or 0.1701 / 32, the larger), so no pass over the row looks for it
GELU_ZERO_POINT = 32
GELU_MIN = -0.1701


def quantize(g: GraphBuilder, x: str, axes: list[int], zero_point: int = ZERO_POINT,
             signed: bool = False, lower_bound: float | None = None) -> tuple[str, str, str]:
    """(data, scale, zero point) of float `x` with one scale per slice over `axes` (kept as size-1
    axes) and the fixed scalar `zero_point`, which MatMulInteger requires of its left operand:
    scale = max(max(x) / (qmax - z), min(x) / (qmin - z)), the smallest that keeps the slice in
    range (an all-zero slice gets a tiny scale). uint8 (qmin 0, qmax 255) or int8 (-128, 127);
    zero_point qmin: `x` is never negative; lower_bound: a known bound <= min(x), used in its place."""
    qmin, qmax = (-128, 127) if signed else (0, 255)
    assert qmin <= zero_point < qmax
    reduced = g.const(axes)
    candidates = [g.op("Div", [g.op("ReduceMax", [x, reduced], keepdims=1), g.fconst(qmax - zero_point)])]
    if zero_point > qmin and lower_bound is None:  # (zero_point qmin: x >= 0 by construction, probabilities)
        candidates.append(g.op("Div", [g.op("ReduceMin", [x, reduced], keepdims=1), g.fconst(qmin - zero_point)]))
    elif zero_point > qmin:
        candidates.append(g.fconst(np.float32(lower_bound) / np.float32(qmin - zero_point)))
    scale = g.op("Max", [*candidates, g.fconst(1e-30)])  # one variadic Max
    zero_point = g.const(zero_point, dtype=np.int8 if signed else np.uint8, hint="zero_point")
    if axes != [-1]:
        data = g.op("QuantizeLinear", [g.op("Div", [x, scale]), g.fconst(1.0), zero_point])
        return data, scale, zero_point
    # one scale per row: QuantizeLinear's per-axis form over a 2-D view (R, K), one pass over x
    # (a Mul by the reciprocal scale, then a scalar QuantizeLinear, was two: 1.2x the time of the
    # whole dense layer at K = 3072)
    rows = g.op("Flatten", [x], axis=-1)  # (R, K)
    row_scale = g.op("Reshape", [scale, g.const([-1])])  # (R,)
    row_zero_point = g.op("Expand", [zero_point, g.op("Shape", [row_scale])])
    # allowzero: an empty tensor's shape (..., 0, K) means 0 rows, not "copy that dimension"
    data = g.op("Reshape", [g.op("QuantizeLinear", [rows, row_scale, row_zero_point], axis=0), g.op("Shape", [x])],
                allowzero=1)
    return data, scale, zero_point


def per_row_uint8(g: GraphBuilder, x: str, zero_point: int = ZERO_POINT,
                  lower_bound: float | None = None) -> tuple[str, str, str]:
    """`quantize` to uint8 with one scale per row of the last axis: scale (..., 1)."""
    return quantize(g, x, [-1], zero_point, lower_bound=lower_bound)


def per_row_activations(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace every `DynamicQuantizeLinear` of a float32 graph (what `quantize_dynamic` inserts
    before each MatMulInteger) by `per_row_uint8`, in place; returns `model`."""
    graph = model.graph
    g = GraphBuilder(graph.name)
    g._used.update(name for node in graph.node for name in (*node.input, *node.output, node.name))
    g._used.update(t.name for t in graph.initializer)  # fresh names never collide with the graph's own
    nodes, renamed = [], {}
    producers = {out: node.op_type for node in graph.node for out in node.output}
    for node in graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            nodes.append(node)
            continue
        start = len(g.nodes)
        g.scope = f"{node.output[0]}/per_row/"
        while any(name.startswith(g.scope) for name in g._used):  # a graph passed through here before
            g.scope = f"{g.scope[:-1]}_/"
        gelu = producers.get(node.input[0]) == "Gelu"
        renamed.update(zip(node.output, per_row_uint8(g, node.input[0], GELU_ZERO_POINT, GELU_MIN) if gelu
                           else per_row_uint8(g, node.input[0])))
        nodes.extend(g.nodes[start:])
    for node in nodes:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    _unfuse_bias(graph, nodes)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(g.initializers)
    used = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return model


def _unfuse_bias(graph: onnx.GraphProto, nodes: list) -> None:
    """Keep each dense layer's bias out of ONNX Runtime's fused product, and its residual sum out of
    ONNX Runtime's SkipLayerNormalization. ONNX Runtime fuses MatMulInteger -> Cast -> Mul [->
    Add(constant bias)] into one MatMulIntegerToFloat kernel, which with a scale per row applies that
    scale after the fused bias, to the bias too (onnxruntime 1.32,
    contrib_ops/cpu/quantization/dynamic_quantize_matmul.cc). So the bias Add(product, bias) becomes
    Sub(product, -bias), the same sum bit for bit, added after the fused product (a graph this pass
    wrote before has that Sub already). Where a residual Add and a LayerNormalization follow, the two
    sums become product - (-bias - residual), i.e. product + (residual + bias): as many passes, and no
    Add left before the LayerNormalization, which ONNX Runtime would fuse into a
    SkipLayerNormalization, 2.4x the time of the Subs and the LayerNormalization at 4096 x 768 on one
    thread (its CPU kernel, onnxruntime 1.32)."""
    constants = {t.name: t for t in graph.initializer}
    products = {n.output[0] for n in nodes if n.op_type == "MatMulInteger"}
    casts = {n.output[0] for n in nodes if n.op_type == "Cast" and n.input[0] in products}
    rescaled = {n.output[0] for n in nodes if n.op_type == "Mul" and set(n.input) & casts}
    consumers = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}

    def sole_consumer(name: str, op_type: str):
        found = consumers.get(name, [])
        ok = len(found) == 1 and found[0].op_type == op_type and name not in graph_outputs
        return found[0] if ok else None

    for node in nodes:
        if node.op_type == "Add" and set(node.input) & rescaled:
            product, bias = node.input if node.input[0] in rescaled else reversed(node.input)
            if bias not in constants:
                continue
            negated = numpy_helper.from_array(-numpy_helper.to_array(constants[bias]), f"{bias}/negated")
            graph.initializer.append(negated)
            node.op_type = "Sub"
            node.input[:] = [product, negated.name]
        elif node.op_type == "Sub" and node.input[0] in rescaled and node.input[1] in constants:
            product = node.input[0]  # written so by an earlier version of this pass
        else:
            continue
        residual_add = sole_consumer(node.output[0], "Add")
        if residual_add is not None and sole_consumer(residual_add.output[0], "LayerNormalization") is not None:
            residual = next(name for name in residual_add.input if name != node.output[0])
            node.input[:] = [node.input[1], residual]  # -bias - residual
            residual_add.op_type = "Sub"
            residual_add.input[:] = [product, node.output[0]]
