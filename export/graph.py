"""A small ONNX graph builder over `onnx.helper`: named nodes, initializers, typed inputs.

We build the exported graphs directly from the checkpoint's state dict instead of tracing a
PyTorch forward: a tracer bakes the sequence length and the random block indices in as
constants, which is exactly what this export must not do. Building by hand gives full control
over which tensors are graph inputs (the layout table) and which axes are dynamic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 20  # >= 17 required; 20 adds the Gelu op (one fused kernel instead of 7 element-wise ops)
IR_VERSION = 9  # onnxruntime 1.18+ reads IR 9; newer onnx writes IR 10+ by default
FLOAT_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}
NUMPY_FLOAT = {"fp32": np.float32, "fp16": np.float16}
NEG_INF = -10000.0  # additive mask for masked logits (transformers' BigBird uses -10000.0 too)


class GraphBuilder:
    """Accumulates nodes; every method returns the name of the tensor it produced."""

    def __init__(self, name: str, dtype: str = "fp32"):
        self.name = name
        self.dtype = dtype
        self.float_type = FLOAT_TYPES[dtype]
        self.np_float = NUMPY_FLOAT[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._used: Counter[str] = Counter()
        self._consts: dict[tuple, str] = {}
        self.scope = ""

    def fresh(self, hint: str) -> str:
        hint = f"{self.scope}{hint}"
        self._used[hint] += 1
        n = self._used[hint]
        return hint if n == 1 else f"{hint}_{n}"

    # --- graph interface -------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        self._used[name] += 1
        return name

    def output(self, tensor: str, name: str, elem_type: int | None, shape: Sequence[int | str]) -> None:
        self.op("Identity", [tensor], out=name)
        elem_type = self.float_type if elem_type is None else elem_type
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))

    # --- tensors ---------------------------------------------------------------------
    def weight(self, name: str, array: np.ndarray) -> str:
        """A float parameter, stored in the graph's float dtype."""
        tensor = numpy_helper.from_array(np.ascontiguousarray(array, dtype=self.np_float), self.fresh(name))
        self.initializers.append(tensor)
        return tensor.name

    def const(self, value, dtype=np.int64, hint: str = "const") -> str:
        """A small constant (shapes, indices, scalars), deduplicated."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            tensor = numpy_helper.from_array(array, self.fresh(hint))
            self.initializers.append(tensor)
            self._consts[key] = tensor.name
        return self._consts[key]

    def fconst(self, value, hint: str = "fconst") -> str:
        """A float constant in the graph's dtype."""
        return self.const(value, dtype=self.np_float, hint=hint)

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None, n_out: int = 1, **attrs):
        outs = [out] if out else [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(f"n_{op_type}"), **attrs))
        return outs[0] if n_out == 1 else outs

    # --- layers ----------------------------------------------------------------------
    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray | None, name: str) -> str:
        """x @ weight.T + bias, weight in PyTorch's (out, in) layout; stored transposed so
        that dynamic quantization sees a MatMul with a constant right-hand side."""
        y = self.op("MatMul", [x, self.weight(f"{name}.weight_t", np.asarray(weight).T)])
        if bias is not None:
            y = self.op("Add", [y, self.weight(f"{name}.bias", bias)])
        return y

    def layer_norm(self, x: str, weight: np.ndarray, bias: np.ndarray, eps: float, name: str) -> str:
        # stash_type=1: mean and variance in fp32 even in an fp16 graph
        return self.op("LayerNormalization", [x, self.weight(f"{name}.weight", weight),
                                              self.weight(f"{name}.bias", bias)],
                       axis=-1, epsilon=float(eps), stash_type=1)

    def activation(self, x: str, kind: str) -> str:
        """`kind`, a name of `longdoc.model.activations.ACTIVATIONS` (LOWERED_ACTIVATIONS)."""
        if kind not in LOWERED_ACTIVATIONS:
            raise ValueError(f"unsupported activation {kind!r}; the export lowers {', '.join(sorted(LOWERED_ACTIVATIONS))}")
        return LOWERED_ACTIVATIONS[kind](self, x)

    def to_fp32(self, x: str) -> str:
        """Outputs that leave the graph as logits are fp32 in every dtype."""
        return x if self.dtype == "fp32" else self.op("Cast", [x], to=TensorProto.FLOAT)

    def to_float(self, x: str) -> str:
        return self.op("Cast", [x], to=self.float_type)

    # --- result ----------------------------------------------------------------------
    def model(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="longdoc", ir_version=IR_VERSION, doc_string=doc)
        return model


def save_model(model: onnx.ModelProto, path) -> None:
    """Save, with weights in a side file when the protobuf would pass its 2 GiB limit."""
    from pathlib import Path

    path = Path(path)
    if model.ByteSize() > 1_800_000_000:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def _gelu_tanh(g: GraphBuilder, x: str) -> str:  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    return g.op("Gelu", [x], approximate="tanh")


def _silu(g: GraphBuilder, x: str) -> str:
    return g.op("Mul", [x, g.op("Sigmoid", [x])])


# every name of longdoc.model.activations.ACTIVATIONS, as ONNX ops (tests/export/test_activations.py
# holds the two tables equal and each lowering to the PyTorch function's values)
LOWERED_ACTIVATIONS: dict[str, Callable[[GraphBuilder, str], str]] = {
    "gelu": lambda g, x: g.op("Gelu", [x]),  # 0.5 x (1 + erf(x / sqrt 2))
    "gelu_python": lambda g, x: g.op("Gelu", [x]),
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_10": lambda g, x: g.op("Clip", [g.op("Gelu", [x]), g.fconst(-10.0), g.fconst(10.0)]),
    "quick_gelu": lambda g, x: g.op("Mul", [x, g.op("Sigmoid", [g.op("Mul", [x, g.fconst(1.702)])])]),
    "relu": lambda g, x: g.op("Relu", [x]),
    "relu6": lambda g, x: g.op("Clip", [x, g.fconst(0.0), g.fconst(6.0)]),
    "relu2": lambda g, x: (lambda r: g.op("Mul", [r, r]))(g.op("Relu", [x])),
    "leaky_relu": lambda g, x: g.op("LeakyRelu", [x], alpha=0.01),
    "silu": _silu,
    "swish": _silu,
    "mish": lambda g, x: g.op("Mish", [x]),  # x tanh(softplus(x))
    "tanh": lambda g, x: g.op("Tanh", [x]),
    "sigmoid": lambda g, x: g.op("Sigmoid", [x]),
    "linear": lambda g, x: g.op("Identity", [x]),
}
