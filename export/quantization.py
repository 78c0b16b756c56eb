"""int8 activations with one scale per row, so that a row's answer never depends on its batch.

ONNX Runtime's `quantize_dynamic` quantizes each activation entering a dense layer with
`DynamicQuantizeLinear`: one scale and zero point for the whole tensor, so every row's result
depends on the other rows of the batch, padding included (docs/export.md, "int8"). This module's
post-pass replaces each of them by a per-row quantization, standard ops only:

    scale = max(max(x) / (255 - z), -min(x) / z) over the row's last axis     (..., 1)
    data  = QuantizeLinear(x, scale, z), per row (its per-axis form over a 2-D view)   uint8
    zero point z: a scalar, 128 (GELU outputs, >= -0.17: 32)

`MatMulInteger` takes only a scalar zero point for its left operand, and int8 x int8 has no fast
kernel on x86; a scale per row with uint8 values around a fixed zero point keeps the uint8 x int8
kernel `quantize_dynamic`'s graph uses. The scale is (..., rows, 1), and the graph's own rescale
`Mul(x_scale, w_scale)` broadcasts it over the product's columns; each bias Add after it becomes a
Sub of the negated bias (`_unfuse_bias` says why).

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
# an activation GELU produced is >= -0.17: 223 of its 255 values go to the positive side (the row's
# scale is max / 223 or 0.17 / 32, the larger)
GELU_ZERO_POINT = 32


def quantize(g: GraphBuilder, x: str, axes: list[int], zero_point: int = ZERO_POINT,
             signed: bool = False) -> tuple[str, str, str]:
    """(data, scale, zero point) of float `x` with one scale per slice over `axes` (kept as size-1
    axes) and the fixed scalar `zero_point`, which MatMulInteger requires of its left operand:
    scale = max(max(x) / (qmax - z), -min(x) / (z - qmin)), the smallest that keeps the slice in
    range (an all-zero slice gets a tiny scale). uint8 (qmin 0, qmax 255) or int8 (-128, 127);
    zero_point qmin: `x` is never negative."""
    qmin, qmax = (-128, 127) if signed else (0, 255)
    assert qmin <= zero_point < qmax
    reduced = g.const(axes)
    scale = g.op("Div", [g.op("ReduceMax", [x, reduced], keepdims=1), g.fconst(qmax - zero_point)])
    if zero_point > qmin:  # else x >= 0 by construction (probabilities)
        scale = g.op("Max", [scale, g.op("Div", [g.op("Neg", [g.op("ReduceMin", [x, reduced], keepdims=1)]),
                                                 g.fconst(zero_point - qmin)])])
    scale = g.op("Max", [scale, g.fconst(1e-30)])
    zero_point = g.const(zero_point, dtype=np.int8 if signed else np.uint8, hint="zero_point")
    if axes != [-1]:
        data = g.op("QuantizeLinear", [g.op("Div", [x, scale]), g.fconst(1.0), zero_point])
        return data, scale, zero_point
    # one scale per row: QuantizeLinear's per-axis form over a 2-D view (R, K), one pass over x
    # (a Mul by the reciprocal scale, then a scalar QuantizeLinear, was two: 1.2x the time of the
    # whole dense layer at K = 3072)
    shape = g.op("Shape", [x])
    rows = g.op("Reshape", [x, g.op("Concat", [g.const([-1]), g.op("Shape", [x], start=-1)], axis=0)])
    row_scale = g.op("Reshape", [scale, g.const([-1])])  # (R,)
    row_zero_point = g.op("Expand", [zero_point, g.op("Shape", [row_scale])])
    # allowzero: an empty tensor's shape (..., 0, K) means 0 rows, not "copy that dimension"
    data = g.op("Reshape", [g.op("QuantizeLinear", [rows, row_scale, row_zero_point], axis=0), shape], allowzero=1)
    return data, scale, zero_point


def per_row_uint8(g: GraphBuilder, x: str, zero_point: int = ZERO_POINT) -> tuple[str, str, str]:
    """`quantize` to uint8 with one scale per row of the last axis: scale (..., 1)."""
    return quantize(g, x, [-1], zero_point)


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
        zero_point = GELU_ZERO_POINT if producers.get(node.input[0]) == "Gelu" else ZERO_POINT
        renamed.update(zip(node.output, per_row_uint8(g, node.input[0], zero_point)))
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
    """Write each dense layer's bias Add(product, bias) as Sub(product, -bias) (the same sum, bit
    for bit). ONNX Runtime fuses MatMulInteger -> Cast -> Mul [-> Add(constant bias)] into one
    MatMulIntegerToFloat kernel, which with a scale per row applies that scale after the fused
    bias, to the bias too (onnxruntime 1.32, contrib_ops/cpu/quantization/dynamic_quantize_matmul.cc);
    without the Add the product stays fused and the bias is added after it."""
    constants = {t.name: t for t in graph.initializer}
    products = {n.output[0] for n in nodes if n.op_type == "MatMulInteger"}
    casts = {n.output[0] for n in nodes if n.op_type == "Cast" and n.input[0] in products}
    rescaled = {n.output[0] for n in nodes if n.op_type == "Mul" and set(n.input) & casts}
    for node in nodes:
        if node.op_type != "Add" or not set(node.input) & rescaled:
            continue
        product, bias = node.input if node.input[0] in rescaled else reversed(node.input)
        if bias in constants:
            negated = numpy_helper.from_array(-numpy_helper.to_array(constants[bias]), f"{bias}/negated")
            graph.initializer.append(negated)
            node.op_type = "Sub"
            node.input[:] = [product, negated.name]
