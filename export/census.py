"""Op census of an exported graph: only standard ONNX ops (default domain, opset >= 17), no
control flow, and every block-sparse attention made of Gather + MatMul + Softmax.

Node names carry their layer scope (`layer3/...`, `enc3/...`, `dec3/...`; see export/graph.py),
which is how the per-attention check finds each layer's nodes.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import onnx

MIN_OPSET = 17  # export/graph.py writes opset 20 (Gelu)
# element-wise arithmetic, shape plumbing, the attention kernels, normalisation, TopK and CumSum
# (Longformer's per-request global tokens: their positions and each position's slot), Sin and Cos
# (ModernBERT's rotary angles, computed from the positions in the graph), and the
# ops ONNX Runtime's dynamic int8 quantization inserts (all in the default domain)
ALLOWED_OPS = frozenset("""
Add Sub Mul Div Neg Sqrt Pow Erf Tanh Sigmoid Relu Gelu Exp Log Abs Max Min Sin Cos Equal Less LessOrEqual Greater
GreaterOrEqual And Or Not Where Cast Identity
Shape Reshape Flatten Transpose Unsqueeze Squeeze Concat Split Slice Expand Range Gather GatherND GatherElements
MatMul Gemm Softmax LogSoftmax ArgMax ReduceMean ReduceSum ReduceMax ReduceMin LayerNormalization TopK CumSum
DynamicQuantizeLinear MatMulInteger QuantizeLinear DequantizeLinear
""".split())
CONTROL_FLOW = frozenset({"Loop", "If", "Scan"})
_SCOPE = re.compile(r"^(layer|enc|dec)(\d+)/")


def op_census(model: onnx.ModelProto) -> Counter:
    """(domain, op_type) -> count."""
    return Counter((node.domain or "ai.onnx", node.op_type) for node in model.graph.node)


def attention_int8_matmuls(model: onnx.ModelProto) -> Counter:
    """layer scope -> MatMulInteger nodes that multiply two activations (the attention's Q.K^T and
    P.V under --int8-attention; the dense layers' MatMulIntegers have a constant weight)."""
    constants = {t.name for t in model.graph.initializer}
    found: Counter = Counter()
    for node in model.graph.node:
        match = _SCOPE.match(node.name)
        if match and node.op_type == "MatMulInteger" and not set(node.input[:2]) & constants:
            found[match.group(0)] += 1
    return found


def check_graph(model: onnx.ModelProto | str, sparse: bool = True) -> list[str]:
    """Every rule the graph breaks, as sentences (empty = clean)."""
    if isinstance(model, str):
        model = onnx.load(model, load_external_data=False)
    problems = []
    opset = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    if opset.get("ai.onnx", 0) < MIN_OPSET:
        problems.append(f"default-domain opset {opset.get('ai.onnx')} < {MIN_OPSET}")
    for (domain, op), n in sorted(op_census(model).items()):
        if domain != "ai.onnx":
            problems.append(f"{n} node(s) of {domain}.{op}: only the default ONNX domain is allowed")
        elif op in CONTROL_FLOW:
            problems.append(f"{n} {op} node(s): no control flow allowed")
        elif op not in ALLOWED_OPS:
            problems.append(f"{n} {op} node(s): op not in the allowed set")
    per_layer: dict[str, Counter] = defaultdict(Counter)
    for node in model.graph.node:
        match = _SCOPE.match(node.name)
        if match:  # an int8 attention product counts as its MatMul
            op = "MatMul" if node.op_type == "MatMulInteger" else node.op_type
            per_layer[match.group(0)][op] += 1
    if not per_layer:
        problems.append("no layer-scoped nodes found (names must start with layerN/, encN/ or decN/)")
    for scope, ops in sorted(per_layer.items()):
        if scope.startswith("dec"):
            need = {"MatMul": 4, "Softmax": 2}  # self + cross attention over the cache
        elif sparse:
            need = {"Gather": 5, "MatMul": 4, "Softmax": 2}  # sparse rows + global rows
        else:
            need = {"MatMul": 2, "Softmax": 1}
        for op, n in need.items():
            if ops[op] < n:
                problems.append(f"{scope} attention has {ops[op]} {op} node(s), expected >= {n}")
    return problems
