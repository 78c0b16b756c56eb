"""int8 activations with one scale per row, so that a row's answer never depends on its batch.

ONNX Runtime's `quantize_dynamic` quantizes each activation entering a dense layer with
`DynamicQuantizeLinear`: one scale and zero point for the whole tensor, so every row's result
depends on the other rows of the batch, padding included (docs/export.md, "int8 and batching").
This module's post-pass replaces each of them by a per-row quantization, standard ops only:

    scale = max(|x|) / 127 over the last axis, per row           (..., 1)
    data  = QuantizeLinear(x * (127 / max|x|), 1, 128)            uint8 in [1, 255]
    zero point 128 (a scalar)

`MatMulInteger` takes only a scalar zero point for its left operand, and int8 x int8 has no fast
kernel on x86; a symmetric scale per row with uint8 values around the fixed zero point 128 keeps
the uint8 x int8 kernel `quantize_dynamic`'s graph uses. The scale is (..., rows, 1), and the
graph's own rescale `Mul(x_scale, w_scale)` broadcasts it over the product's columns.

Every step is element-wise within a row, and `MatMulInteger` accumulates in int32 (exact), so a
row's output is bitwise the same whatever else is in its batch. The int8 attention products
(export/sparse_attention.py) quantize their left operands with the same `per_row_uint8`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from longdoc.export.graph import GraphBuilder

LEVELS = 127.0  # symmetric: values -127..127 around the zero point
ZERO_POINTS = {False: (np.uint8, 128), True: (np.int8, 0)}  # signed -> (dtype, zero point)


def symmetric(g: GraphBuilder, x: str, axes: list[int], signed: bool = False) -> tuple[str, str, str]:
    """(data, scale, zero point) of float `x` with one symmetric scale per slice over `axes`:
    scale = max|x| / 127 over them (kept as size-1 axes; an all-zero slice gets a tiny scale).
    Unsigned: uint8 values 128 +- 127, zero point 128; signed: int8, zero point 0. Both zero
    points are scalars, which MatMulInteger requires of its left operand."""
    axes = g.const(axes)
    amax = g.op("Max", [g.op("ReduceMax", [x, axes], keepdims=1),
                        g.op("Neg", [g.op("ReduceMin", [x, axes], keepdims=1)])])
    amax = g.op("Max", [amax, g.fconst(1e-30)])
    dtype, zero = ZERO_POINTS[signed]
    zero_point = g.const(zero, dtype=dtype, hint="symmetric_zero_point")
    scaled = g.op("Mul", [x, g.op("Div", [g.fconst(LEVELS), amax])])  # |scaled| <= 127
    data = g.op("QuantizeLinear", [scaled, g.fconst(1.0), zero_point])
    return data, g.op("Div", [amax, g.fconst(LEVELS)]), zero_point


def per_row_uint8(g: GraphBuilder, x: str) -> tuple[str, str, str]:
    """`symmetric` uint8 with one scale per row of the last axis: scale (..., 1)."""
    return symmetric(g, x, [-1])


def per_row_activations(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace every `DynamicQuantizeLinear` of a float32 graph (what `quantize_dynamic` inserts
    before each MatMulInteger) by `per_row_uint8`, in place; returns `model`."""
    graph = model.graph
    g = GraphBuilder(graph.name)
    g._used.update(name for node in graph.node for name in (*node.input, *node.output, node.name))
    g._used.update(t.name for t in graph.initializer)  # fresh names never collide with the graph's own
    nodes, renamed = [], {}
    for node in graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            nodes.append(node)
            continue
        start = len(g.nodes)
        g.scope = f"{node.output[0]}/per_row/"
        renamed.update(zip(node.output, per_row_uint8(g, node.input[0])))
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
