"""Longformer export: the graph against transformers (QA and classification heads, lengths that are
and are not window multiples, global tokens at random positions and counts, only the first token,
transformers' own defaults, padded batches), the op census, one graph for every length, and
`longdoc verify` passing on the exported checkpoint and failing on another one.

Checkpoints are made by transformers (longdoc/testing/tiny_models.py `make_tiny_longformer`: window 16, so
blocks of w = 8 tokens under a band of 8)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from longdoc.export.census import check_graph, op_census
from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.manifest import Manifest
from longdoc.export.runtime import OnnxModel, default_global_mask
from longdoc.export.verify import VerifyError, verify_model
from longdoc.testing.tiny_models import CLS, PAD, SEP, make_tiny_checkpoint, make_tiny_longformer, vocab_size

LENGTHS = (1, 7, 8, 16, 37, 100, 512)  # one token, < w, = w, = window, not multiples, the maximum
TOL = 1e-4


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def longformer(tmp_path_factory):
    """task -> (checkpoint dir, transformers model, OnnxModel of its fp32 export)"""
    root = tmp_path_factory.mktemp("longformer")
    out = {}
    for task in ("qa", "classify"):
        checkpoint = make_tiny_longformer(root / f"{task}-checkpoint", task)
        export_model(checkpoint, root / f"{task}-model", task, progress=quiet)
        import transformers

        cls = {"qa": transformers.LongformerForQuestionAnswering,
               "classify": transformers.LongformerForSequenceClassification}[task]
        out[task] = (checkpoint, cls.from_pretrained(str(checkpoint)).eval(), OnnxModel(root / f"{task}-model",
                                                                                         threads=1))
    return out


def batch(S: int, B: int, seed: int):
    """ids (no special tokens but a leading [CLS]), attention mask with rows of S, 2S/3, S/3 real tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(7, vocab_size(), (B, S))
    ids[:, 0] = CLS
    mask = np.ones((B, S), np.int64)
    for b in range(1, B):
        mask[b, max(1, S * (B - b) // B):] = 0
    ids[mask == 0] = PAD
    return ids, mask


def global_masks(ids, mask, seed: int):
    """only the first token; 1..6 random real positions per row (different counts per row)"""
    rng = np.random.default_rng(seed)
    first = np.zeros_like(ids)
    first[:, 0] = 1
    scattered = np.zeros_like(ids)
    for b in range(len(ids)):
        real = np.flatnonzero(mask[b])
        scattered[b, rng.choice(real, size=min(len(real), 1 + (b * 2 + seed) % 6), replace=False)] = 1
    return {"first": first, "scattered": scattered}


def outputs(task, model, ids, mask, global_mask=None):
    kwargs = {} if global_mask is None else {"global_attention_mask": torch.from_numpy(global_mask)}
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), **kwargs)
    if task == "qa":
        return {"start_logits": out.start_logits.numpy(), "end_logits": out.end_logits.numpy()}
    return {"logits": out.logits.numpy()}


def assert_close(task, got, want, mask):
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, name
        sel = mask.astype(bool) if task == "qa" else np.ones(w.shape, bool)
        assert np.abs(g[sel] - w[sel]).max() <= TOL, (name, np.abs(g[sel] - w[sel]).max())


def matches_transformers(task: str, hf, onnx_model, S: int) -> None:
    """At length S, batch 1 and 3 (padded rows), every global-token mask: the export's outputs are
    transformers'."""
    for B in (1, 3):
        ids, mask = batch(S, B, seed=S + B)
        for kind, gm in global_masks(ids, mask, seed=S).items():
            got = onnx_model.run_encoder(ids, mask, global_attention_mask=gm)
            assert_close(task, got, outputs(task, hf, ids, mask, gm), mask)


@pytest.mark.parametrize("task", ["qa", "classify"])
@pytest.mark.parametrize("S", LENGTHS)
def test_graph_matches_transformers(longformer, task, S):
    _, hf, onnx_model = longformer[task]
    matches_transformers(task, hf, onnx_model, S)


def test_a_missing_global_token_is_seen(longformer):
    """The comparison can fail: another global set moves the outputs far above the tolerance."""
    _, hf, onnx_model = longformer["qa"]
    ids, mask = batch(100, 1, seed=1)
    gm = global_masks(ids, mask, seed=3)["scattered"]
    got = onnx_model.run_encoder(ids, mask, global_attention_mask=global_masks(ids, mask, 0)["first"])
    want = outputs("qa", hf, ids, mask, gm)
    assert np.abs(got["start_logits"] - want["start_logits"]).max() > 100 * TOL


def test_default_global_tokens_are_transformers_defaults(longformer):
    """No global mask on either side: QA attends globally to `<s> question` (transformers finds it
    from the separators of `<s> q </s></s> context </s>`), classification to the first token."""
    _, hf, onnx_model = longformer["qa"]
    ids, mask = batch(60, 2, seed=5)
    ids[:, 6], ids[:, 7], ids[0, 59], ids[1, 39] = SEP, SEP, SEP, SEP  # question of 5 tokens after <s>
    assert default_global_mask(onnx_model.manifest, ids)[:, :8].tolist() == [[1] * 6 + [0, 0]] * 2
    assert_close("qa", onnx_model.run_encoder(ids, mask), outputs("qa", hf, ids, mask), mask)
    _, hf, onnx_model = longformer["classify"]
    assert_close("classify", onnx_model.run_encoder(ids, mask), outputs("classify", hf, ids, mask), mask)


def test_qa_without_a_separator_needs_an_explicit_global_mask(longformer):
    onnx_model = longformer["qa"][2]
    ids, mask = batch(20, 2, seed=0)
    with pytest.raises(ValueError, match="separator"):
        onnx_model.run_encoder(ids, mask)


def test_manifest_names_the_global_tokens_and_the_window(longformer):
    for task, want in (("qa", "question"), ("classify", "first")):
        m = longformer[task][2].manifest
        assert m.global_tokens == want
        assert m.layer_attention is None  # one window for every layer: `attention` is every layer's
        assert (m.block_size, m.attention["band"], m.attention["pattern"]) == (8, 8, "longformer")
        assert m.max_length == 512  # 520 positions - pad_token_id - 1 = 518 tokens, rounded down to w
        assert m.min_length == 1 and m.full_attention_max_length == 0


def test_one_graph_with_a_clean_census_for_every_length(longformer):
    onnx_model = longformer["qa"][2]
    path = onnx_model.model_dir / "encoder.onnx"
    graph = onnx.load(str(path))
    assert check_graph(graph) == []
    ops = {op for _, op in op_census(graph)}
    assert {"TopK", "CumSum", "GatherElements"} <= ops and not ops & {"Loop", "If", "Scan"}
    for value in graph.graph.input:  # every axis of every token input is symbolic
        if value.name in ("input_ids", "attention_mask", "global_attention_mask"):
            assert [d.dim_param for d in value.type.tensor_type.shape.dim] == ["batch", "sequence"]
    assert sorted(p.name for p in onnx_model.model_dir.glob("*.onnx")) == ["encoder.onnx"]


def test_verify_passes_on_the_checkpoint_and_fails_on_another(longformer, tmp_path):
    checkpoint, _, onnx_model = longformer["classify"]
    for against in ("model", "transformers"):
        report = verify_model(onnx_model.model_dir, checkpoint, against=against, progress=quiet)
        assert report.ok, report.summary()
        assert len({c.length for c in report.checks}) >= 5
        assert any(c.length % 16 for c in report.checks) and {1, 3} <= {c.batch for c in report.checks}
    other = make_tiny_longformer(tmp_path / "other", "classify", seed=1)
    with pytest.raises(VerifyError, match="not the checkpoint"):
        verify_model(onnx_model.model_dir, other, progress=quiet)
    report = verify_model(onnx_model.model_dir, other, against="transformers", progress=quiet,
                          allow_other_checkpoint=True)
    assert not report.ok


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_fp16_and_int8_exports_verify(longformer, tmp_path, dtype):
    checkpoint = longformer["qa"][0]
    export_model(checkpoint, tmp_path / "model", "qa", dtype=dtype, progress=quiet)
    # seed 1: seed 0's inputs hold a near tie (1 row of 16) that int8 with one activation scale per row
    # breaks the other way, though its logits stay closer to fp32 than with one scale per tensor
    report = verify_model(tmp_path / "model", checkpoint, progress=quiet, lengths=[7, 37, 100, 512], seed=1)
    assert report.ok, report.summary()
    if dtype == "int8":
        assert {c.what for c in report.checks if c.graph == "agreement"} >= {"best span identical"}


def test_other_heads_and_int8_attention_are_refused(tmp_path):
    checkpoint = make_tiny_longformer(tmp_path / "ck2", "qa")
    with pytest.raises(CheckpointError, match="is a .qa. model, not .classify."):
        export_model(checkpoint, tmp_path / "out", "classify", progress=quiet)
    # int8 attention products exist for BigBird's block-sparse rows only (not the band + global slots)
    with pytest.raises(CheckpointError, match="Longformer's band and global tokens run in fp32"):
        export_model(checkpoint, tmp_path / "out", "qa", dtype="int8", int8_attention="per-row", progress=quiet)
    assert not (tmp_path / "out").exists()


# --- a window per layer (attention_window a list) ---------------------------------------------

# task -> (attention_window, lengths): w 8, 16, 8 run over blocks of 8 (3, 5, 3 blocks); w 12, 8, 24
# over blocks of 4, their gcd (7, 5, 13 blocks). transformers pads to the largest window, which
# every window must divide. Lengths: one token, not multiples of any window, multiples of the block
# or of a window, the maximum (518 positions: 512 and 516 tokens).
PER_LAYER = {"qa": ([16, 32, 16], (1, 7, 8, 16, 32, 37, 100, 512)),
             "classify": ([24, 16, 48], (1, 7, 12, 37, 48, 100, 516))}


@pytest.fixture(scope="module")
def per_layer(tmp_path_factory):
    """task -> (checkpoint dir, transformers model, OnnxModel of its fp32 export), 3 layers whose
    windows differ (PER_LAYER)."""
    import transformers

    root = tmp_path_factory.mktemp("longformer-per-layer")
    out = {}
    for task, (windows, _) in PER_LAYER.items():
        checkpoint = make_tiny_longformer(root / f"{task}-checkpoint", task, seed=2, num_hidden_layers=3,
                                          attention_window=windows)
        export_model(checkpoint, root / f"{task}-model", task, progress=quiet)
        cls = {"qa": transformers.LongformerForQuestionAnswering,
               "classify": transformers.LongformerForSequenceClassification}[task]
        out[task] = (checkpoint, cls.from_pretrained(str(checkpoint)).eval(), OnnxModel(root / f"{task}-model",
                                                                                         threads=1))
    return out


@pytest.mark.parametrize("task,S", [(task, S) for task, (_, lengths) in PER_LAYER.items() for S in lengths])
def test_per_layer_windows_match_transformers(per_layer, task, S):
    _, hf, onnx_model = per_layer[task]
    matches_transformers(task, hf, onnx_model, S)


def test_per_layer_manifest_carries_every_layers_window(per_layer):
    """The runtime reads the layers' specs from the manifest (no question about the architecture)."""
    for task, blocks, bands, windows in (("qa", 8, [8, 16, 8], [3, 5, 3]), ("classify", 4, [12, 8, 24], [7, 5, 13])):
        m = per_layer[task][2].manifest
        assert m.block_size == blocks and m.num_layers == 3
        assert [a["band"] for a in m.layer_attention] == bands
        assert [a["window_blocks"] for a in m.layer_attention] == windows
        assert {a["block_size"] for a in m.layer_attention} == {blocks} and m.attention == m.layer_attention[0]
        assert m.max_length == {"qa": 512, "classify": 516}[task]
        feed = per_layer[task][2].layout_inputs(m.max_length, "block_sparse")
        assert feed["layout_key_blocks"].shape == (3, 2, m.max_length // blocks, max(windows))
        assert feed["layout_valid"].sum(axis=-1).max(axis=(1, 2)).tolist() == windows


def test_a_wrong_middle_window_is_seen(per_layer):
    """The comparison can fail: transformers with the middle layer's window at 16 instead of 32
    (same weights) moves the outputs far above the tolerance."""
    import transformers

    checkpoint, hf, onnx_model = per_layer["qa"]
    narrow = transformers.LongformerForQuestionAnswering.from_pretrained(
        str(checkpoint), attention_window=[16, 16, 16]).eval()
    ids, mask = batch(100, 1, seed=4)
    gm = global_masks(ids, mask, seed=4)["first"]
    got = onnx_model.run_encoder(ids, mask, global_attention_mask=gm)
    assert_close("qa", got, outputs("qa", hf, ids, mask, gm), mask)
    want = outputs("qa", narrow, ids, mask, gm)
    assert np.abs(got["start_logits"] - want["start_logits"]).max() > 100 * TOL


def test_per_layer_export_verifies_and_has_one_clean_graph(per_layer):
    checkpoint, _, onnx_model = per_layer["qa"]
    for against in ("model", "transformers"):
        report = verify_model(onnx_model.model_dir, checkpoint, against=against, progress=quiet)
        assert report.ok, report.summary()
    graph = onnx.load(str(onnx_model.model_dir / "encoder.onnx"))
    assert check_graph(graph) == []
    assert not {op for _, op in op_census(graph)} & {"Loop", "If", "Scan"}


def test_manifest_rejects_an_unknown_global_tokens_rule(longformer):
    data = longformer["qa"][2].manifest.to_dict()
    with pytest.raises(ValueError, match="global_tokens"):
        Manifest.from_dict(dict(data, global_tokens="all"))


# --- the full-attention baseline (`longdoc export --attention full`, bench/longformer.py) ---------

FULL_LENGTHS = (7, 37, 512)  # not a multiple of w, another, the maximum
HF_FULL_WINDOW = 1024  # transformers' window w/2 = 512 tokens each side: every real token sees every other


@pytest.fixture(scope="module")
def full_qa(longformer, tmp_path_factory):
    """(transformers' QA model with a window covering every length, OnnxModel of the full export)"""
    import transformers

    checkpoint = longformer["qa"][0]
    out = tmp_path_factory.mktemp("longformer-full") / "model"
    export_model(checkpoint, out, "qa", progress=quiet, attention="full")
    hf = transformers.LongformerForQuestionAnswering.from_pretrained(str(checkpoint),
                                                                     attention_window=HF_FULL_WINDOW).eval()
    return hf, OnnxModel(out, threads=1)


@pytest.mark.parametrize("S", FULL_LENGTHS)
def test_full_attention_export_equals_longformer_whose_window_covers_the_input(full_qa, S):
    """transformers pads to a multiple of its window (1024) and attends w/2 = 512 tokens each side, so
    at S <= 512 every token sees every real token; no global tokens (all-zero mask: transformers' QA
    default would make the question global, with the global projections)."""
    hf, onnx_model = full_qa
    for B in (1, 3):
        ids, mask = batch(S, B, seed=S + B)
        got = onnx_model.run_encoder(ids, mask)
        want = outputs("qa", hf, ids, mask, np.zeros_like(ids))
        for name, w in want.items():
            sel = mask.astype(bool)
            assert np.abs(got[name][sel] - w[sel]).max() <= 1e-5, (name, np.abs(got[name][sel] - w[sel]).max())


def test_full_attention_export_is_not_the_windowed_model(full_qa, longformer):
    """The comparison can fail: past the checkpoint's own window (16) the baseline differs from it."""
    _, onnx_model = full_qa
    hf = longformer["qa"][1]
    ids, mask = batch(100, 1, seed=2)
    want = outputs("qa", hf, ids, mask, np.zeros_like(ids))
    assert np.abs(onnx_model.run_encoder(ids, mask)["start_logits"] - want["start_logits"]).max() > 100 * TOL


def test_full_attention_manifest_census_and_inputs(full_qa, tmp_path):
    """The manifest says dense attention (no global tokens, full attention at every length), the graph
    takes the token inputs only and passes the census as a dense graph; verify refuses it."""
    _, onnx_model = full_qa
    m = onnx_model.manifest
    assert m.attention["pattern"] == "dense" and m.global_tokens == "none"
    assert m.full_attention_max_length == m.max_length == 512 and m.block_size == 8
    graph = onnx.load(str(onnx_model.model_dir / "encoder.onnx"))
    assert check_graph(graph, sparse=False) == []
    assert sorted(i.name for i in graph.graph.input) == ["attention_mask", "input_ids"]
    assert not {op for _, op in op_census(graph)} & {"TopK", "Loop", "If", "Scan"}
    ids, mask = batch(20, 1, seed=0)
    with pytest.raises(ValueError, match="takes no global_attention_mask"):
        onnx_model.run_encoder(ids, mask, global_attention_mask=np.zeros_like(ids))
    with pytest.raises(VerifyError, match="full-attention Longformer export"):
        verify_model(onnx_model.model_dir, m.source["checkpoint"], progress=quiet)


def test_full_attention_is_refused_for_other_model_types(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "ck", "qa")
    with pytest.raises(CheckpointError, match="Longformer benchmark baseline"):
        export_model(checkpoint, tmp_path / "out", "qa", progress=quiet, attention="full")
    with pytest.raises(CheckpointError, match="attention 'dense' is not one of sparse, full"):
        export_model(checkpoint, tmp_path / "out", "qa", progress=quiet, attention="dense")
    assert not (tmp_path / "out").exists()
