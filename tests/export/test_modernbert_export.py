"""ModernBERT export (issue 28): the graph against transformers (QA, sequence classification with
"cls" and "mean" pooling, masked LM; lengths that are multiples of nothing, padded batches), the
sliding layers computed as a band (their attention probabilities grow linearly with the length,
the full layers' quadratically; only they read the window table), one graph for every length with
a clean op census, the manifest's per-layer attention, and `longdoc verify` passing at fp32 against
transformers and our model (fp16, int8 by its criteria) and failing on other rotary bases.

Checkpoints are made by transformers (longdoc/testing/tiny_models.py `make_tiny_modernbert`: hidden 64,
4 layers full/sliding/full/sliding, local_attention 16, so a band of 8 tokens over blocks of 8)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from longdoc.export.census import check_graph, op_census
from longdoc.export.exporter import export_model, exportable_model_types, read_config
from longdoc.export.manifest import Manifest
from longdoc.export.runtime import OnnxModel
from longdoc.export.verify import VerifyError, verify_model
from longdoc.model.layout import modernbert_layer_specs, modernbert_layer_types
from longdoc.testing.tiny_models import CLS, PAD, SEP, make_tiny_modernbert, vocab_size

LENGTHS = (1, 7, 8, 9, 37, 100, 333, 512)  # one token, < band, = band, not multiples, the maximum
TOL = 1e-4
# name -> (task, make_tiny_modernbert overrides)
EXPORTS = {"qa": ("qa", {}), "classify-cls": ("classify", {}),
           "classify-mean": ("classify", {"classifier_pooling": "mean"}), "mlm": ("mlm", {})}


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    """name -> (checkpoint dir, transformers model, OnnxModel of its fp32 export)"""
    import transformers

    root = tmp_path_factory.mktemp("modernbert")
    out = {}
    for name, (task, overrides) in EXPORTS.items():
        checkpoint = make_tiny_modernbert(root / f"{name}-checkpoint", task, **overrides)
        export_model(checkpoint, root / f"{name}-model", task, progress=quiet)
        cls = getattr(transformers, read_config(checkpoint)["architectures"][0])
        out[name] = (checkpoint, cls.from_pretrained(str(checkpoint)).eval(), OnnxModel(root / f"{name}-model",
                                                                                          threads=1))
    return out


def batch(S: int, B: int, seed: int, task: str = "classify"):
    """ids with a leading [CLS] (and a [SEP] after a short question for QA), attention mask with
    rows of S, 2S/3, S/3 real tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(7, vocab_size(), (B, S))
    ids[:, 0] = CLS
    if task == "qa" and S > 4:
        ids[:, min(S // 3, 9)] = SEP
    mask = np.ones((B, S), np.int64)
    for b in range(1, B):
        mask[b, max(1, S * (B - b) // B):] = 0
    ids[mask == 0] = PAD
    return ids, mask


def outputs(model, ids, mask) -> dict[str, np.ndarray]:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    names = ("start_logits", "end_logits") if hasattr(out, "start_logits") else ("logits",)
    return {n: getattr(out, n).numpy() for n in names}


def max_diff(got, want, mask) -> float:
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, (name, g.shape, w.shape)
        sel = mask.astype(bool) if w.ndim >= 2 and w.shape[:2] == mask.shape else np.ones(w.shape[:1], bool)
        worst = max(worst, float(np.abs(g[sel] - w[sel]).max()))
    return worst


@pytest.mark.parametrize("name", list(EXPORTS))
@pytest.mark.parametrize("S", LENGTHS)
def test_graph_matches_transformers(modernbert, name, S):
    _, hf, onnx_model = modernbert[name]
    for B in (1, 3):
        ids, mask = batch(S, B, seed=S + B, task=EXPORTS[name][0])
        diff = max_diff(onnx_model.run_encoder(ids, mask), outputs(hf, ids, mask), mask)
        assert diff <= TOL, (name, S, B, diff)


def test_padded_rows_equal_the_rows_alone(modernbert):
    """A row in a padded batch gives what it gives alone (its own length, another padded length)."""
    onnx_model = modernbert["classify-mean"][2]
    ids, mask = batch(101, 3, seed=5)
    together = onnx_model.run_encoder(ids, mask)["logits"]
    for b in range(3):
        n = int(mask[b].sum())
        alone = onnx_model.run_encoder(ids[b:b + 1, :n], mask[b:b + 1, :n])["logits"]
        assert np.abs(alone[0] - together[b]).max() <= 1e-5


def test_manifest_carries_every_layers_attention(modernbert):
    m = Manifest.load(modernbert["qa"][2].model_dir)
    assert m.architecture == "ModernBertForQuestionAnswering" and m.global_tokens == "none"
    assert [a["pattern"] for a in m.layer_attention] == ["dense", "longformer", "dense", "longformer"]
    assert [a["band"] for a in m.layer_attention] == [0, 8, 0, 8]
    assert (m.block_size, m.min_length, m.max_length, m.full_attention_max_length) == (8, 1, 512, 0)
    assert m.attention == m.layer_attention[0]


def test_one_graph_with_a_clean_census_for_every_length(modernbert):
    onnx_model = modernbert["qa"][2]
    graph = onnx.load(str(onnx_model.model_dir / "encoder.onnx"))
    assert check_graph(graph, sparse=False) == []
    ops = {op for _, op in op_census(graph)}
    assert {"Sin", "Cos", "Range", "Gather", "Softmax"} <= ops
    assert not ops & {"Loop", "If", "Scan", "TopK"}
    inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.graph.input}
    assert inputs == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                      "layout_key_blocks": ["layers", "heads", "blocks", "slots"],
                      "layout_valid": ["layers", "heads", "blocks", "slots"]}
    assert sorted(p.name for p in onnx_model.model_dir.glob("*.onnx")) == ["encoder.onnx"]
    # the window table is read by the sliding layers only; every layer has its attention
    reads_table = {node.name.split("/")[0] for node in graph.graph.node if "layout_key_blocks" in node.input}
    assert reads_table == {"layer1", "layer3"}
    for layer in range(4):
        layer_ops = [n.op_type for n in graph.graph.node if n.name.startswith(f"layer{layer}/attn/")]
        assert layer_ops.count("Softmax") >= 1 and layer_ops.count("MatMul") >= 2


def attention_probabilities(onnx_model: OnnxModel, S: int) -> dict[int, int]:
    """layer -> elements of its attention probabilities (every Softmax of the layer) at length S, batch 1."""
    import onnxruntime as ort

    graph = onnx.load(str(onnx_model.model_dir / "encoder.onnx"))
    probes = {node.output[0]: int(node.name[len("layer"):node.name.index("/")])
              for node in graph.graph.node if node.op_type == "Softmax" and node.name.startswith("layer")}
    graph.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                              for name in probes)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    ids, mask = batch(S, 1, seed=S)
    feed, _ = onnx_model.encoder_feed(ids, mask)
    sizes: dict[int, int] = {}
    for name, value in zip(probes, session.run(list(probes), feed)):
        sizes[probes[name]] = sizes.get(probes[name], 0) + value.size
    return sizes


def test_sliding_layers_are_computed_as_a_band(modernbert):
    """8x the length: a sliding layer's probabilities grow 8x (a band of 3 blocks per query block,
    no (S x S) scores), a full layer's 64x."""
    onnx_model = modernbert["qa"][2]
    short, long = attention_probabilities(onnx_model, 64), attention_probabilities(onnx_model, 512)
    heads = 4
    for layer in (1, 3):  # sliding: (1, H, nb, 8, 3 * 8) with nb = S / 8
        assert short[layer] == heads * 64 * 24 and long[layer] == heads * 512 * 24
        assert long[layer] == 8 * short[layer]
    for layer in (0, 2):  # full: (1, H, S, S)
        assert short[layer] == heads * 64 * 64 and long[layer] == 64 * short[layer]


def test_full_layers_write_the_scores_once(modernbert):
    """A full layer's key-padding bias rides in the Q.K^T product (an extra column of q and k), so
    the (H, S, S) scores are written by the MatMul and read by the Softmax only: no element-wise
    op passes over them (the bias Add was a quarter of a full layer's time at 8192 tokens)."""
    import onnxruntime as ort

    onnx_model = modernbert["qa"][2]
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(onnx_model.model_dir / "encoder.onnx")))
    types = {v.name: v.type.tensor_type.elem_type for v in graph.graph.value_info}
    probes = {node.output[0]: node.op_type for node in graph.graph.node
              if node.name.startswith(("layer0/attn/", "layer2/attn/"))}
    graph.graph.output.extend(onnx.helper.make_tensor_value_info(name, types[name], None) for name in probes)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    S, heads = 96, 4
    ids, mask = batch(S, 2, seed=5)  # the second row is padded: the bias is not all zeros
    feed, _ = onnx_model.encoder_feed(ids, mask)
    square = sorted(probes[name] for name, value in zip(probes, session.run(list(probes), feed))
                    if value.size >= 2 * heads * S * S)
    assert square == ["MatMul", "MatMul", "Softmax", "Softmax"]  # per full layer: Q.K^T and its softmax


def test_full_layers_run_their_queries_in_chunks_exactly(modernbert, tmp_path, monkeypatch):
    """Full attention runs its queries in chunks of rows (export/sparse_attention.py
    `query_chunk_sizes`; at 8192 tokens each chunk's scores stay in the cache for the Softmax and
    P.V): with 4 chunks of at least 16 rows, no full layer holds more than one chunk's scores, and
    every output equals the default export's, including lengths with empty chunks (1, 20) and
    uneven ones (37, 100)."""
    import onnxruntime as ort

    from longdoc.export import sparse_attention

    checkpoint, _, plain = modernbert["qa"]
    monkeypatch.setattr(sparse_attention, "QUERY_CHUNKS", 4)
    monkeypatch.setattr(sparse_attention, "QUERY_CHUNK_ROWS", 16)
    export_model(checkpoint, tmp_path / "chunked", "qa", progress=quiet)
    chunked = OnnxModel(tmp_path / "chunked", threads=1)
    for S in (1, 20, 37, 100):
        ids, mask = batch(S, 3, seed=S, task="qa")
        want, got = plain.run_encoder(ids, mask), chunked.run_encoder(ids, mask)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} at {S} tokens")

    graph = onnx.shape_inference.infer_shapes(onnx.load(str(tmp_path / "chunked" / "encoder.onnx")))
    types = {v.name: v.type.tensor_type.elem_type for v in graph.graph.value_info}
    probes = {node.output[0]: node.op_type for node in graph.graph.node if node.name.startswith("layer0/attn/")}
    graph.graph.output.extend(onnx.helper.make_tensor_value_info(name, types[name], None) for name in probes)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    S, heads, B = 96, 4, 2  # padded to 96: 4 chunks of 24 rows
    feed, _ = chunked.encoder_feed(*batch(S, B, seed=5))
    sizes = [(probes[name], value.size) for name, value in zip(probes, session.run(list(probes), feed))]
    assert max(size for _, size in sizes) == B * heads * 24 * S
    assert sorted(op for op, size in sizes if size == B * heads * 24 * S) == ["MatMul"] * 4 + ["Softmax"] * 4


def test_verify_passes_against_transformers_and_our_model(modernbert):
    for name in ("qa", "classify-mean"):
        checkpoint, _, onnx_model = modernbert[name]
        for against in ("transformers", "model"):
            report = verify_model(onnx_model.model_dir, checkpoint, against=against, progress=quiet)
            assert report.ok, report.summary()
            lengths = {c.length for c in report.checks}
            assert len(lengths) >= 5 and any(n % 8 for n in lengths) and {1, 3} <= {c.batch for c in report.checks}
            assert max(c.max_abs_diff for c in report.checks) <= TOL


def test_verify_fails_on_other_rotary_bases_and_refuses_another_band(modernbert, tmp_path):
    """The same weights (the same sha256: the manifest's checksum covers the weights file, not
    config.json) under swapped rotary bases: the comparison itself sees it. Another band is another
    block size, refused as another shape."""
    checkpoint, _, onnx_model = modernbert["qa"]
    swapped = make_tiny_modernbert(tmp_path / "swapped", "qa", global_rope_theta=50.0, local_rope_theta=2000.0)
    report = verify_model(onnx_model.model_dir, swapped, against="transformers", progress=quiet, lengths=[37, 100])
    assert not report.ok and min(c.max_abs_diff for c in report.checks) > 100 * TOL
    wider = make_tiny_modernbert(tmp_path / "wider", "qa", local_attention=32)
    with pytest.raises(VerifyError, match="block_size 16 \\(export: 8\\)"):
        verify_model(onnx_model.model_dir, wider, progress=quiet, allow_other_checkpoint=True)


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_fp16_and_int8_exports_verify(modernbert, tmp_path, dtype):
    checkpoint = modernbert["qa"][0]
    export_model(checkpoint, tmp_path / "model", "qa", dtype=dtype, progress=quiet)
    assert check_graph(str(tmp_path / "model" / "encoder.onnx"), sparse=False) == []
    report = verify_model(tmp_path / "model", checkpoint, progress=quiet, lengths=[7, 37, 100, 512])
    assert report.ok, report.summary()
    if dtype == "int8":
        assert {c.what for c in report.checks if c.graph == "agreement"} >= {"best span identical"}


def test_int8_attention_runs_the_dense_layers_products_in_int8(modernbert, tmp_path):
    """`--int8-attention` on ModernBERT: its full layers' Q.K^T and P.V become integer products
    (the band layers stay fp32, as Longformer's); the export verifies by agreement."""
    checkpoint = modernbert["qa"][0]
    export_model(checkpoint, tmp_path / "plain", "qa", dtype="int8", progress=quiet)
    export_model(checkpoint, tmp_path / "attn", "qa", dtype="int8", int8_attention="dynamic-s8", progress=quiet)

    def integer_products(d):
        return sum(n.op_type == "MatMulInteger" for n in onnx.load(str(d / "encoder.onnx")).graph.node)

    specs = modernbert_layer_specs(json.loads((checkpoint / "config.json").read_text()))
    full_layers = sum(not spec.band for spec in specs)
    assert full_layers >= 1
    # two products per attention group of each full layer beyond the weights' own MatMulIntegers
    assert integer_products(tmp_path / "attn") >= integer_products(tmp_path / "plain") + 2 * full_layers
    assert check_graph(str(tmp_path / "attn" / "encoder.onnx"), sparse=False) == []
    report = verify_model(tmp_path / "attn", checkpoint, progress=quiet, lengths=[7, 37, 100, 512])
    assert report.ok, report.summary()


def test_every_layer_types_spelling_is_the_model_files():
    """model/layout.py's layer types (export, manifest) are model/modernbert.py's (the PyTorch model)."""
    from longdoc.model.modernbert import ModernBertConfig

    for fields in ({"num_hidden_layers": 7}, {"num_hidden_layers": 5, "global_attn_every_n_layers": 2},
                   {"num_hidden_layers": 3, "global_attn_every_n_layers": 1},
                   {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}):
        config = {"model_type": "modernbert", "hidden_size": 32, "num_attention_heads": 2, **fields}
        assert modernbert_layer_types(config) == ModernBertConfig.from_dict(config).layer_type_list, fields
    specs = modernbert_layer_specs({"num_hidden_layers": 3, "local_attention": 128})
    assert [(s.pattern, s.block_size, s.band) for s in specs] == [("dense", 64, 0), ("longformer", 64, 64),
                                                                  ("longformer", 64, 64)]
    with pytest.raises(ValueError, match="leaves no sliding window"):
        modernbert_layer_specs({"num_hidden_layers": 2, "local_attention": 1})


def test_every_architecture_exports():
    assert "modernbert" in exportable_model_types("mlm") and "modernbert" in exportable_model_types("qa")
