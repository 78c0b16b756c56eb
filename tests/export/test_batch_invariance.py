"""A sequence's outputs do not depend on the rest of its batch (issue 40), bit for bit on the CPU:
for every family's fp32 and int8 export, a row run alone equals the same row run beside other
sequences of other lengths (padding included) or beside more windows of the same document, at the
same padded length (the service pads every sequence of a batch to its bucket's length).

int8 holds this because no activation scale is shared by two rows (export/quantization.py);
ONNX Runtime's own `quantize_dynamic` graph, one scale per tensor, does not
(`test_per_tensor_activations_depend_on_the_batch`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from longdoc.export.census import ALLOWED_OPS
from longdoc.export.exporter import export_model
from longdoc.export.graph import save_model
from longdoc.export.manifest import INT8_ATTENTION, Manifest, file_checksums
from longdoc.export.runtime import OnnxModel
from longdoc.testing.tiny_models import (CLS, SEP, make_tiny_checkpoint, make_tiny_encoder_decoder, make_tiny_led,
                                         make_tiny_longformer, make_tiny_modernbert, vocab_size)

# family -> (task, checkpoint builder)
FAMILIES = {
    "bigbird-qa": ("qa", lambda d: make_tiny_checkpoint(d, "qa")),
    "bigbird-classify": ("classify", lambda d: make_tiny_checkpoint(d, "classify")),
    "bigbird-pegasus": ("summarize", lambda d: make_tiny_checkpoint(d, "summarize")),
    "bert2bert": ("summarize", make_tiny_encoder_decoder),
    "longformer": ("qa", lambda d: make_tiny_longformer(d, "qa")),
    "led": ("summarize", make_tiny_led),
    "modernbert": ("classify", lambda d: make_tiny_modernbert(d, "classify")),
}
DTYPES = ("fp32", "int8")
LENGTHS = (100, 300)
QUESTION = [CLS, 7, 8, SEP]  # every row opens with a question (Longformer QA's global tokens)  # full attention (BigBird: up to 144 tokens) and block-sparse / windowed


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(family, dtype) -> exported model directory, built on first use."""
    root = tmp_path_factory.mktemp("invariance")
    built = {}

    def get(family: str, dtype: str, int8_attention: str = "off"):
        task, make = FAMILIES[family]
        if family not in built:
            built[family] = make(root / family)
        out = root / f"{family}-{dtype}-{int8_attention}"
        if not (out / "manifest.json").is_file():
            export_model(built[family], out, task, dtype=dtype, int8_attention=int8_attention, progress=lambda _m: None)
        return out

    return get


def batch_around(ids: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`ids` (S,) as row 1 of a batch of 4 at the same length S: a shorter sequence (padding), the
    document's next window (the same tokens shifted), and a sequence of other, larger tokens."""
    rng = np.random.default_rng(seed)
    S = len(ids)
    rows = np.stack([rng.integers(7, vocab_size(), S), ids, np.roll(ids, S // 3), rng.integers(300, vocab_size(), S)])
    rows[:, :4] = QUESTION
    mask = np.ones_like(rows)
    mask[0, S // 2:] = 0  # a shorter sequence: padding in the batch
    rows[0, S // 2:] = 0
    return rows, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_outputs_do_not_depend_on_the_batch(exports, family, dtype):
    assert_encoder_invariant(OnnxModel(exports(family, dtype), threads=1), f"{family} {dtype}")


@pytest.mark.parametrize("mode", INT8_ATTENTION[1:])
@pytest.mark.parametrize("family", ["bigbird-qa", "modernbert"])
def test_int8_attention_does_not_depend_on_the_batch(exports, family, mode):
    """`--int8-attention`: queries and probabilities one scale per row, keys and values one per
    (sequence, head)."""
    assert_encoder_invariant(OnnxModel(exports(family, "int8", mode), threads=1), f"{family} {mode}")


def assert_encoder_invariant(model: OnnxModel, what: str) -> None:
    for S in LENGTHS:
        ids = np.random.default_rng(S).integers(7, vocab_size(), S)
        rows, mask = batch_around(ids, S)
        if model.manifest.task == "summarize":
            alone = model.encode_for_decoding(rows[1:2], mask[1:2]).cross
            batched = model.encode_for_decoding(rows, mask).cross
            for a, b in zip(alone, batched):
                np.testing.assert_array_equal(b[1:2], a, err_msg=f"{what} at {S} tokens")
        else:
            alone = model.run_encoder(rows[1:2], mask[1:2])
            batched = model.run_encoder(rows, mask)
            for name in alone:
                np.testing.assert_array_equal(batched[name][1:2], alone[name], err_msg=f"{what} {name} at {S}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", [f for f, (task, _) in FAMILIES.items() if task == "summarize"])
def test_summaries_do_not_depend_on_the_batch(exports, family, dtype):
    """Greedy and beam tokens of a row alone and in a batch (the decoder's rows too)."""
    model = OnnxModel(exports(family, dtype), threads=1)
    ids = np.random.default_rng(1).integers(7, vocab_size(), 300)
    rows, mask = batch_around(ids, 2)
    for beams in (1, 3):
        alone = model.generate(rows[1:2], mask[1:2], max_new_tokens=12, num_beams=beams)
        batched = model.generate(rows, mask, max_new_tokens=12, num_beams=beams)
        assert batched[1] == alone[0], f"{family} {dtype} beams {beams}"


def test_per_tensor_activations_depend_on_the_batch(exports, tmp_path):
    """What the export replaced: `quantize_dynamic`'s one scale per activation tensor makes a
    row's logits change with its batch (the per-row pass removed, the same export otherwise)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32 = exports("bigbird-qa", "fp32")
    model_dir = tmp_path / "per-tensor"
    export_model(make_tiny_checkpoint(tmp_path / "ckpt", "qa"), model_dir, "qa", dtype="int8",
                 progress=lambda _m: None)
    per_row = onnx.load(str(model_dir / "encoder.onnx"))
    assert not [n for n in per_row.graph.node if n.op_type == "DynamicQuantizeLinear"]
    quantize_dynamic(str(fp32 / "encoder.onnx"), str(tmp_path / "q.onnx"), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul"])
    per_tensor = onnx.load(str(tmp_path / "q.onnx"))
    assert [n for n in per_tensor.graph.node if n.op_type == "DynamicQuantizeLinear"]
    save_model(per_tensor, model_dir / "encoder.onnx")
    manifest = Manifest.load(model_dir)
    replace(manifest, files=file_checksums(model_dir, list(manifest.files))).save(model_dir)
    model = OnnxModel(model_dir, threads=1)
    ids = np.random.default_rng(0).integers(7, vocab_size(), 300)
    rows, mask = batch_around(ids, 0)
    alone = model.run_encoder(rows[1:2], mask[1:2])["start_logits"]
    batched = model.run_encoder(rows, mask)["start_logits"][1:2]
    assert not np.array_equal(alone, batched)


@pytest.mark.parametrize("name", ["qa", "summarize", "classify"])
def test_shipped_models_quantize_activations_per_row(name):
    """The default models under models/ (data/requantize.py): no activation scale per tensor."""
    model_dir = Path(__file__).resolve().parents[2] / "models" / name
    for filename in Manifest.load(model_dir).graphs.values():
        ops = {node.op_type for node in onnx.load(str(model_dir / filename), load_external_data=False).graph.node}
        assert "MatMulInteger" in ops and "DynamicQuantizeLinear" not in ops, f"{name}/{filename}"
        assert ops <= ALLOWED_OPS, f"{name}/{filename}: {ops - ALLOWED_OPS}"
