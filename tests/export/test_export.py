"""Export + ONNX Runtime on tiny models: op census, verify against PyTorch for every task,
one graph for every length, padded mixed-length batches, fp16/int8, and bad inputs."""

import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from longdoc.export.census import check_graph
from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.runtime import OnnxModel
from longdoc.export.sparse_attention import QUERY_CHUNKS
from longdoc.export.verify import Agreement, verify_lengths, verify_model
from longdoc.testing.tiny_models import SEP, make_tiny_checkpoint


def checkpoint_of(model_dir):
    return model_dir.parent / "checkpoint"  # tests/conftest.py layout


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def qa_model(tiny_qa_dir):
    return OnnxModel(tiny_qa_dir, threads=1)


# --- op census ------------------------------------------------------------------------------

def test_census_of_every_graph(tiny_qa_dir, tiny_classify_dir, tiny_summarize_dir):
    for path in (tiny_qa_dir / "encoder.onnx", tiny_classify_dir / "encoder.onnx",
                 tiny_summarize_dir / "encoder.onnx", tiny_summarize_dir / "decoder.onnx"):
        assert check_graph(str(path)) == [], path


def test_census_rejects_custom_ops_and_control_flow(tiny_qa_dir):
    model = onnx.load(str(tiny_qa_dir / "encoder.onnx"))
    model.graph.node.append(helper.make_node("Attention", ["a"], ["b"], domain="com.microsoft", name="layer0/x"))
    model.graph.node.append(helper.make_node("Loop", ["c"], ["d"], name="layer0/y"))
    problems = " ".join(check_graph(model))
    assert "com.microsoft.Attention" in problems and "Loop" in problems


def test_census_requires_gather_in_every_sparse_attention(tiny_qa_dir):
    model = onnx.load(str(tiny_qa_dir / "encoder.onnx"))
    keep = [n for n in model.graph.node if not (n.name.startswith("layer1/") and n.op_type == "Gather")]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    assert any("layer1/ attention has 0 Gather" in p for p in check_graph(model))


# --- verify: ORT against PyTorch --------------------------------------------------------------

def test_verify_qa_at_every_default_length(tiny_qa_dir):
    report = verify_model(tiny_qa_dir, checkpoint_of(tiny_qa_dir), progress=quiet, threads=1)
    lengths = {c.length for c in report.checks}
    assert len(lengths) >= 5 and any(n % 16 for n in lengths) and {16, 512} <= lengths
    assert {c.batch for c in report.checks} == {1, 3}
    assert report.ok, report.summary()
    assert max(c.max_abs_diff for c in report.checks) <= 1e-4


def test_verify_classify(tiny_classify_dir):
    report = verify_model(tiny_classify_dir, checkpoint_of(tiny_classify_dir), progress=quiet, threads=1,
                          lengths=[16, 145, 300])
    assert report.ok, report.summary()


def test_verify_summarize_logits_and_generation(tiny_summarize_dir):
    report = verify_model(tiny_summarize_dir, checkpoint_of(tiny_summarize_dir), progress=quiet, threads=1,
                          lengths=[20, 145, 512])
    assert report.ok, report.summary()
    assert {c.what for c in report.checks} >= {"greedy tokens", "beam(3) tokens", "decoder logits"}


def test_verify_mlm_converted_from_transformers(tmp_path):
    """A checkpoint built and saved by transformers, verified against transformers itself."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "mlm", source="transformers")
    export_model(ckpt, tmp_path / "model", "mlm", progress=quiet)
    report = verify_model(tmp_path / "model", ckpt, against="transformers", progress=quiet, threads=1,
                          lengths=[16, 144, 145, 200, 512])
    assert report.ok, report.summary()


def test_verify_full_attention_checkpoint_in_head_groups(tmp_path):
    """An original_full checkpoint exports to the dense lowering; with 8 heads it runs in two head
    groups of QUERY_CHUNKS query chunks each (export/sparse_attention.py) and still matches
    transformers."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qa", source="transformers", attention_type="original_full",
                                num_attention_heads=8)
    export_model(ckpt, tmp_path / "model", "qa", progress=quiet)
    graph = onnx.load(str(tmp_path / "model" / "encoder.onnx"))
    assert not check_graph(graph, sparse=False)
    softmaxes = [n for n in graph.graph.node if n.op_type == "Softmax"]
    assert len(softmaxes) == 2 * 2 * QUERY_CHUNKS  # 2 layers x 2 head groups x query chunks
    report = verify_model(tmp_path / "model", ckpt, against="transformers", progress=quiet, threads=1,
                          lengths=[16, 100, 512])
    assert report.ok, report.summary()


def test_verify_fails_on_a_wrong_graph(tiny_classify_dir, tmp_path):
    """verify can fail: the checkpoint changed after export."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_of(tiny_classify_dir), ckpt)
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(ckpt / "model.safetensors"))
    weights["classifier.out_proj.bias"] = weights["classifier.out_proj.bias"] + 0.01
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    report = verify_model(tiny_classify_dir, ckpt, progress=quiet, threads=1, lengths=[16],
                          allow_other_checkpoint=True)
    assert not report.ok and "MISMATCH" in report.summary()


# --- one graph, every length; padding ----------------------------------------------------------

def test_one_graph_serves_every_length(qa_model):
    session = qa_model.sessions["encoder"]
    rng = np.random.default_rng(0)
    for S in (1, 15, 144, 145, 161, 300, 512):
        ids = rng.integers(7, 300, (2, S))
        out = qa_model.run_encoder(ids, np.ones_like(ids))
        assert out["start_logits"].shape == (2, S) and np.isfinite(out["start_logits"]).all()
    assert qa_model.sessions["encoder"] is session
    assert {key[1] for key in qa_model._layouts} == {"full", "block_sparse"}


def test_sparse_scores_are_written_once(qa_model):
    """BigBird's block-sparse layers: the window bias (padded keys, the table's padding slots) rides
    in the scores' products: no element-wise op passes over the scores the MatMuls write (the Add
    was 15% of the encoder's GPU time, docs/gpu.md); gathers and reshapes of keys that large remain."""
    import onnxruntime as ort

    graph = onnx.shape_inference.infer_shapes(onnx.load(str(qa_model.model_dir / "encoder.onnx")))
    types = {v.name: v.type.tensor_type.elem_type for v in graph.graph.value_info}
    probes = {node.output[0]: (node.name.split("/")[0], node.op_type) for node in graph.graph.node
              if "/attn/" in node.name and node.output[0] in types}
    graph.graph.output.extend(helper.make_tensor_value_info(name, types[name], None) for name in probes)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    S = 300  # block-sparse (the tiny model's full-attention switch is below)
    ids = rng.integers(7, 300, (2, S))
    mask = np.ones_like(ids)
    mask[1, 200:] = 0  # a padded row: the bias is not all zeros
    feed, _ = qa_model.encoder_feed(ids, mask)
    assert qa_model._layouts and {key[1] for key in qa_model._layouts} >= {"block_sparse"}
    sizes: dict = {}
    for (layer, op), value in zip(probes.values(), session.run(list(probes), feed)):
        sizes.setdefault(layer, []).append((value.size, op))
    assert len(sizes) >= 2
    for layer, found in sizes.items():
        largest = max(size for size, op in found if op == "MatMul")
        elementwise = {op for size, op in found if size >= largest} & {"Add", "Sub", "Mul", "Div", "Where", "Cast"}
        assert not elementwise, (layer, sorted(found)[-6:])


@pytest.mark.parametrize("S", [100, 300])  # full attention and block-sparse
def test_mixed_length_batch_equals_rows_run_alone(qa_model, S):
    rng = np.random.default_rng(S)
    ids = rng.integers(7, 300, (3, S))
    ids[:, 4] = SEP
    mask = np.ones((3, S), np.int64)
    mask[1, S // 2:] = 0
    mask[2, 20:] = 0
    batch = qa_model.run_encoder(ids, mask)
    for row in range(3):
        alone = qa_model.run_encoder(ids[row:row + 1], mask[row:row + 1])
        real = mask[row].astype(bool)
        for name in ("start_logits", "end_logits"):
            np.testing.assert_allclose(batch[name][row, real], alone[name][0, real], atol=1e-5)


def test_layouts_are_cached_per_padded_length(qa_model):
    a = qa_model.layout_inputs(320, "block_sparse")
    assert qa_model.layout_inputs(320, "block_sparse") is a
    assert a["layout_key_blocks"].shape[:3] == (2, 2, 20)


# --- dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_fp16_and_int8_exports_load_and_run(tiny_qa_dir, tmp_path, dtype):
    out = tmp_path / dtype
    export_model(checkpoint_of(tiny_qa_dir), out, "qa", dtype=dtype, progress=quiet)
    assert check_graph(str(out / "encoder.onnx")) == []
    # int8's pass criteria (task agreement) are tested on a decisive model in test_verify.py; this
    # tiny shape's spans tie too easily for them, so only the deltas are checked here
    lax = Agreement(span=0.0, span_in_top=0.0)
    report = verify_model(out, checkpoint_of(tiny_qa_dir), progress=quiet, threads=1, lengths=[16, 145, 300],
                          agreement=lax)
    assert report.ok, report.summary()
    worst = max(c.max_abs_diff for c in report.checks if c.max_abs_diff is not None)
    if dtype == "fp16":
        assert worst <= 1e-2
    else:
        assert 0 < worst < 1.0  # int8 is reported, but it must be close


# --- bad inputs ----------------------------------------------------------------------------------

def test_bad_checkpoint_directories_fail_fast(tmp_path, tiny_classify_dir):
    with pytest.raises(CheckpointError, match="not a directory"):
        export_model(tmp_path / "nope", tmp_path / "out", "qa", progress=quiet)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        export_model(tmp_path / "empty", tmp_path / "out", "qa", progress=quiet)
    bad = tmp_path / "gpt"
    shutil.copytree(checkpoint_of(tiny_classify_dir), bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        export_model(bad, tmp_path / "out", "classify", progress=quiet)
    with pytest.raises(CheckpointError, match="is a 'classify' model, not 'qa'"):
        export_model(checkpoint_of(tiny_classify_dir), tmp_path / "out", "qa", progress=quiet)
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["BigBirdForCausalLM"]}))
    with pytest.raises(CheckpointError, match="architecture 'BigBirdForCausalLM' is not supported"):
        export_model(bad, tmp_path / "out", "classify", progress=quiet)
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        export_model(bad, tmp_path / "out", "classify", progress=quiet)
    assert not (tmp_path / "out").exists()


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
    from longdoc.cli import main

    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--task", "qa"]) == 1
    err = capsys.readouterr().err
    assert "no config.json" in err and "Traceback" not in err


def test_runtime_rejects_bad_inputs(qa_model):
    with pytest.raises(ValueError, match="outside"):
        qa_model.run_encoder(np.ones((1, 513), np.int64))
    with pytest.raises(ValueError, match=r"\(batch, sequence\)"):
        qa_model.run_encoder(np.ones((1, 2, 3), np.int64))
    with pytest.raises(ValueError, match="integers"):
        qa_model.run_encoder(np.ones((1, 8), np.float32))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        qa_model.run_encoder(np.ones((1, 8), np.int64), np.ones((1, 9), np.int64))
    with pytest.raises(ValueError, match="generate needs a summarize model"):
        qa_model.generate(np.ones((1, 8), np.int64))


def test_verify_lengths_cover_the_edges(qa_model):
    lengths = verify_lengths(qa_model.manifest)
    assert len(lengths) >= 5 and lengths[0] == 16 and lengths[-1] == 512 and {144, 145} <= set(lengths)


def test_runtime_imports_no_torch_and_no_onnx(tiny_qa_dir):
    """Serving machines have onnxruntime but neither torch nor the onnx package."""
    code = ("import sys, numpy as np; from longdoc.export.runtime import OnnxModel; "
            f"m = OnnxModel({str(tiny_qa_dir)!r}, threads=1); m.run_encoder(np.ones((1, 200), np.int64)); "
            "assert not {'torch', 'transformers', 'onnx'} & set(sys.modules), 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loading_returns_freed_heap_to_the_os(tiny_qa_dir, monkeypatch):
    """OnnxModel trims the heap once its sessions exist (docs/export.md, memory)."""
    import longdoc.export.runtime as runtime

    real, calls = runtime._release_freed_heap, []
    monkeypatch.setattr(runtime, "_release_freed_heap", lambda: calls.append(1))
    OnnxModel(tiny_qa_dir, threads=1)
    assert calls == [1]
    real()  # runs anywhere (a no-op off glibc Linux)


# --- one table of special tokens (longdoc.model.tokenization.special_token_ids) ------------------------

def test_manifest_special_tokens_are_complete(tiny_qa_dir, tiny_summarize_dir):
    """BERT-style configs name no [CLS]: the exporter asks the tokenizer, so the manifest is the
    whole truth and the service, eval and verify read it as is (no patch-ups downstream)."""
    from longdoc.export.manifest import Manifest
    from longdoc.testing.tiny_models import CLS, EOS, MASK, PAD

    qa = Manifest.load(tiny_qa_dir).special_tokens
    assert (qa["cls"], qa["sep"], qa["pad"], qa["mask"]) == (CLS, SEP, PAD, MASK)
    summarize = Manifest.load(tiny_summarize_dir).special_tokens
    assert summarize["eos"] == EOS and summarize["decoder_start"] is not None


def test_tokenizer_files_name_the_special_tokens(tmp_path):
    """special_tokens_map.json wins over config ids (what the tokenizer really emits). (A classifier:
    BigBird QA reads sep_token_id from its config, and export refuses one that disagrees,
    tests/export/test_special_token_ids.py.)"""
    import json

    from longdoc.testing.tiny_models import CLS

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "classify")
    (ckpt / "special_tokens_map.json").write_text(json.dumps({"sep_token": "[CLS]"}))
    manifest = export_model(ckpt, tmp_path / "model", "classify", progress=quiet)
    assert manifest.special_tokens["sep"] == CLS


# --- the output directory ------------------------------------------------------------------------

def test_export_refuses_a_non_empty_output_dir_unless_overwrite(tiny_qa_dir, tmp_path, capsys):
    from longdoc.cli import main

    out = tmp_path / "models" / "myqa"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    ck = checkpoint_of(tiny_qa_dir)
    assert main(["export", str(ck), str(out), "--task", "qa"]) == 1
    assert "is not empty; pass --overwrite to replace it" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert main(["export", str(ck), str(out), "--task", "qa", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["encoder.onnx", "manifest.json", "tokenizer.json"]
    assert [p.name for p in out.parent.iterdir()] == ["myqa"]  # no temporary sibling left


def test_export_never_writes_into_a_checkpoint_dir(tiny_qa_dir, tmp_path):
    ck = tmp_path / "checkpoint"
    shutil.copytree(checkpoint_of(tiny_qa_dir), ck)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    for source in (ck, checkpoint_of(tiny_qa_dir)):  # the same directory, or the arguments swapped
        with pytest.raises(CheckpointError, match="holds a checkpoint"):
            export_model(source, ck, "qa", progress=quiet, overwrite=True)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupted_export_leaves_nothing_half_written(tiny_qa_dir, tmp_path, existing):
    out = tmp_path / "myqa"
    if existing:
        export_model(checkpoint_of(tiny_qa_dir), out, "qa", progress=quiet)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if existing else None

    def interrupt(msg):
        if msg.startswith("wrote encoder.onnx"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_model(checkpoint_of(tiny_qa_dir), out, "qa", progress=interrupt, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == (["myqa"] if existing else [])
    if existing:  # the export it was replacing is whole
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_int8_export_prints_no_onnx_runtime_pre_processing_hint(tmp_path):
    """Issue 25, defect 6: every int8 export printed ONNX Runtime's "Please consider to run
    pre-processing before quantization" (a hint for static quantization), once per graph."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "classify")
    code = ("from longdoc.export.exporter import export_model; import sys; "
            f"export_model({str(ckpt)!r}, {str(tmp_path / 'model')!r}, 'classify', dtype='int8', progress=print)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "quantizing encoder graph to int8" in run.stdout
    assert "pre-processing" not in run.stdout + run.stderr, run.stderr
