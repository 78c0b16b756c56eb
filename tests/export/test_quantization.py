"""The per-row int8 pass (export/quantization.py) as ONNX Runtime runs it: its own graph optimizer
fuses each product into MatMulIntegerToFloat but takes no bias into it (its kernel would scale the
bias by the row's scale) and builds no SkipLayerNormalization (its CPU kernel took 2.4x the time of
the two Subs and the LayerNormalization the pass writes instead); a GELU output's scale reads no
minimum (GELU's own bound stands for it). A random init's biases are all zero, so the fixture here
gives its checkpoint random ones: a bias scaled by the row's scale would go unseen otherwise."""

from __future__ import annotations

import math
from collections import Counter

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file, save_file

from longdoc.export.exporter import export_model
from longdoc.export.graph import GraphBuilder, save_model
from longdoc.export.manifest import Manifest, file_checksums
from longdoc.export.quantization import GELU_MIN, GELU_ZERO_POINT, per_row_uint8
from longdoc.export.runtime import OnnxModel
from longdoc.testing.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny QA checkpoint with random biases, exported fp32, int8, and int8 as `quantize_dynamic`
    writes it (one scale per tensor: its fused kernel adds the bias right)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = tmp_path_factory.mktemp("quantization")
    ckpt = make_tiny_checkpoint(root / "ckpt", "qa")
    state = load_file(str(ckpt / "model.safetensors"))
    rng = np.random.default_rng(1)
    for key, value in state.items():
        if key.endswith(".bias"):
            value[...] = rng.normal(0.0, 0.5, value.shape)
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    for dtype in ("fp32", "int8"):
        export_model(ckpt, root / dtype, "qa", dtype=dtype, progress=lambda _m: None)
    per_tensor = root / "per-tensor"
    export_model(ckpt, per_tensor, "qa", dtype="int8", progress=lambda _m: None)
    quantize_dynamic(str(root / "fp32" / "encoder.onnx"), str(root / "q.onnx"), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul"])
    save_model(onnx.load(str(root / "q.onnx")), per_tensor / "encoder.onnx")
    manifest = Manifest.load(per_tensor)
    replace(manifest, files=file_checksums(per_tensor, list(manifest.files))).save(per_tensor)
    return root


@pytest.fixture(scope="module")
def int8_qa(exports):
    return exports / "int8" / "encoder.onnx"


def test_dense_biases_enter_unscaled(exports):
    """The per-row graph's logits are as close to fp32's as the per-tensor graph's: with a bias
    scaled by its row's scale they were 90x as far (mean |diff| 1.08 against 0.012; per row 0.012)."""
    ids = np.random.default_rng(0).integers(7, 300, (2, 300))
    logits = {name: OnnxModel(exports / name, threads=1).run_encoder(ids, np.ones_like(ids))["start_logits"]
              for name in ("fp32", "int8", "per-tensor")}
    error = {name: float(np.abs(logits[name] - logits["fp32"]).mean()) for name in ("int8", "per-tensor")}
    assert error["int8"] <= 1.25 * error["per-tensor"], error


def optimized(path, tmp_path) -> onnx.ModelProto:
    """The graph as ONNX Runtime's CPU session optimizes it (default level: all)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath)


def test_onnx_runtime_fuses_each_product_without_its_bias(int8_qa, tmp_path):
    graph = onnx.load(str(int8_qa)).graph
    nodes = optimized(int8_qa, tmp_path).graph.node
    ops = Counter(node.op_type for node in nodes)
    fused = [node for node in nodes if node.op_type == "MatMulIntegerToFloat"]
    assert len(fused) == sum(node.op_type == "MatMulInteger" for node in graph.node)
    assert all(len(node.input) <= 6 for node in fused), "a bias (input 7) scaled by the row's scale"
    assert ops["SkipLayerNormalization"] == 0 and ops["LayerNormalization"] > 0


def test_gelu_outputs_quantize_without_a_minimum(int8_qa):
    graph = onnx.load(str(int8_qa)).graph
    gelus = {node.output[0] for node in graph.node if node.op_type == "Gelu"}
    reduced = {node.input[0]: node.op_type for node in graph.node if node.op_type in ("ReduceMin", "ReduceMax")}
    assert gelus and all(reduced.get(name) == "ReduceMax" for name in gelus)
    assert any(op == "ReduceMin" for op in reduced.values())  # the other activations still read theirs


def test_gelu_bound_keeps_every_gelu_value_in_range():
    """Values down to GELU's minimum (both forms) quantize without clipping at zero point 32."""
    g = GraphBuilder("gelu")
    data, scale, _ = per_row_uint8(g, "x", GELU_ZERO_POINT, GELU_MIN)
    x = np.linspace(-6, 1, 4096, dtype=np.float32)
    rows = {"erf": x * 0.5 * (1 + np.vectorize(math.erf)(x / np.sqrt(2))),
            "tanh": 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))}
    make, types = onnx.helper.make_tensor_value_info, onnx.TensorProto
    graph = onnx.helper.make_graph(g.nodes, "g", [make("x", types.FLOAT, [2, 4096])],
                                   [make(data, types.UINT8, None), make(scale, types.FLOAT, None)], g.initializers)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = np.stack(list(rows.values())).astype(np.float32)
    assert values.min() >= GELU_MIN
    q, s = session.run(None, {"x": values})
    restored = (q.astype(np.float32) - GELU_ZERO_POINT) * s
    assert np.abs(restored - values).max() <= s.max() / 2 * 1.001  # rounding only: nothing clipped at 0


def test_the_pass_over_its_own_graph_changes_nothing(int8_qa):
    from longdoc.export.quantization import per_row_activations

    once = onnx.load(str(int8_qa))
    twice = per_row_activations(onnx.load(str(int8_qa)))
    nodes = [[(n.op_type, list(n.input)) for n in model.graph.node] for model in (once, twice)]
    assert nodes[0] == nodes[1]
