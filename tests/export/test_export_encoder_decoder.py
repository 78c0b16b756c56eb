"""`longdoc export` / `longdoc verify` / `longdoc serve` with the BERT2BERT encoder-decoder
(transformers' EncoderDecoderModel: big_bird encoder, bert decoder), tiny random models."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from longdoc.testing.tiny_models import CLS, PAD, SEP, make_tiny_encoder_decoder, tiny_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def b2b(tmp_path_factory):
    root = tmp_path_factory.mktemp("b2b")
    return make_tiny_encoder_decoder(root / "checkpoint")


@pytest.fixture(scope="module")
def exported(b2b, tmp_path_factory):
    from longdoc.export.exporter import export_model

    out = {}

    def get(dtype):
        if dtype not in out:
            out[dtype] = tmp_path_factory.mktemp("export") / dtype
            export_model(b2b, out[dtype], "summarize", dtype=dtype, progress=lambda _m: None)
        return out[dtype]

    return get


def test_manifest_says_summarize_with_both_graphs(exported, b2b):
    manifest = json.loads((exported("fp32") / "manifest.json").read_text())
    assert manifest["task"] == "summarize" and manifest["architecture"] == "EncoderDecoderModel"
    assert manifest["graphs"] == {"encoder": "encoder.onnx", "decoder": "decoder.onnx"}
    assert manifest["decoder"]["num_layers"] == 2 and manifest["decoder"]["max_positions"] == 64
    assert (manifest["hidden_size"], manifest["block_size"], manifest["max_length"]) == (32, 16, 512)
    assert manifest["full_attention_max_length"] == 144 and manifest["attention"]["pattern"] == "bigbird"
    special = manifest["special_tokens"]
    assert (special["decoder_start"], special["eos"], special["pad"]) == (CLS, SEP, PAD)
    from longdoc.export.census import check_graph

    for graph in ("encoder.onnx", "decoder.onnx"):  # standard ops only, every layer's attention present
        assert check_graph(str(exported("fp32") / graph)) == []


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_verify_passes_on_the_exported_checkpoint(exported, b2b, dtype):
    from longdoc.export.verify import verify_model

    report = verify_model(exported(dtype), b2b, lengths=[16, 144, 145, 250], progress=lambda _m: None,
                          max_new_tokens=6)
    assert report.ok, report.summary()
    kinds = {c.what for c in report.checks}
    assert {"decoder logits", "greedy tokens", "beam(3) tokens"} <= kinds
    fp32 = max(c.max_abs_diff for c in report.checks if c.max_abs_diff is not None)
    assert fp32 <= (1e-4 if dtype == "fp32" else 1e-1)


def test_verify_against_transformers_itself(exported, b2b):
    from longdoc.export.verify import verify_model

    report = verify_model(exported("fp32"), b2b, against="transformers", lengths=[40, 250],
                          progress=lambda _m: None, max_new_tokens=6)
    assert report.ok, report.summary()


def test_verify_fails_on_a_wrong_checkpoint(exported, tmp_path):
    from longdoc.export.verify import VerifyError, verify_model

    other = make_tiny_encoder_decoder(tmp_path / "other", seed=1)
    with pytest.raises(VerifyError, match="not the checkpoint this model was exported from"):
        verify_model(exported("fp32"), other, progress=lambda _m: None)
    report = verify_model(exported("fp32"), other, lengths=[40, 250], allow_other_checkpoint=True,
                          progress=lambda _m: None, max_new_tokens=6)
    assert not report.ok
    assert any(c.what == "decoder logits" and c.max_abs_diff > 1e-2 for c in report.checks)


def test_real_serve_summarizes_like_the_pytorch_reference(exported, b2b, tmp_path):
    from longdoc.model import load_pretrained
    from tests.service.conftest import ServeProcess, streamed_tokens

    words = "the water of a river is cold and the boy saw a fish in the sea near the farm".split()
    rng = np.random.default_rng(3)
    docs = [" ".join(rng.choice(words, n)) for n in (30, 200)]  # full attention / block-sparse
    tok = tiny_tokenizer()
    reference = load_pretrained(b2b)
    want = []
    # the service's input is BERT's `[CLS] document [SEP]` (manifest summarize_input "cls-doc-eos"; it
    # used to be `document [SEP]`, which a BERT2BERT checkpoint trained elsewhere has never seen)
    assert json.loads((exported("fp32") / "manifest.json").read_text())["summarize_input"] == "cls-doc-eos"
    for doc in docs:
        ids = torch.tensor([[CLS, *tok.encode(doc, add_special_tokens=False).ids, SEP]])
        row = reference.generate(ids, max_new_tokens=12)[0, 1:].tolist()  # without the start token
        want.append(row[: row.index(SEP)] if SEP in row else row)
    assert any(len(w) > 2 for w in want)
    with ServeProcess(["--model", f"b2b={exported('fp32')}", "--no-warmup"], tmp_path / "serve.log") as s:
        assert streamed_tokens(s.url, docs, 12) == want
        models = httpx.get(s.url + "/v1/models", timeout=10).json()
        assert "b2b" in json.dumps(models) and "summarize" in json.dumps(models)
