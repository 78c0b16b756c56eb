"""Shipping step: embedding tables stored in fp16 give the same rows (to fp16 rounding)."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from data.ship_model import shrink_embedding_tables


def test_shrink_embedding_tables_keeps_outputs(tmp_path):
    rng = np.random.default_rng(0)
    table = rng.normal(size=(50, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["word_embeddings", "ids"], ["rows"], name="g"),
         helper.make_node("Mul", ["rows", "rows"], ["out"], name="m")],
        "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", 8])],
        [numpy_helper.from_array(table, "word_embeddings")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    ids = np.array([[3, 7, 49]], np.int64)
    before = ort.InferenceSession(str(path)).run(None, {"ids": ids})[0]
    assert shrink_embedding_tables(path) == ["word_embeddings"]
    model = onnx.load(str(path))
    assert {i.name: i.data_type for i in model.graph.initializer} == {"word_embeddings_fp16": TensorProto.FLOAT16}
    assert [n.op_type for n in model.graph.node] == ["Gather", "Cast", "Mul"]
    after = ort.InferenceSession(str(path)).run(None, {"ids": ids})[0]
    assert after.dtype == np.float32
    np.testing.assert_allclose(after, before, rtol=2e-3, atol=1e-4)
    assert not np.array_equal(after, before)  # it really is rounded


def test_shrink_embedding_tables_records_the_new_checksum(tmp_path):
    """A shipped model dir must load: its manifest's sha256 of the rewritten graph is updated
    (it kept the pre-shrink checksum, and the service refused the shipped summarizer)."""
    import json

    from longdoc.export.manifest import sha256_of

    table = np.zeros((4, 2), np.float32)
    graph = helper.make_graph([helper.make_node("Gather", ["word_embeddings", "ids"], ["out"], name="g")], "g",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["S"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["S", 2])],
                              [numpy_helper.from_array(table, "word_embeddings")])
    path = tmp_path / "encoder.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"encoder.onnx": sha256_of(path), "x": "y"}}))
    shrink_embedding_tables(path)
    assert json.loads((tmp_path / "manifest.json").read_text())["files"] == {"encoder.onnx": sha256_of(path), "x": "y"}
