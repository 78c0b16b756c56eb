"""`longdoc export --task embed` (issue 39): a sentence-transformers folder as shipped (modules.json,
1_Pooling/config.json, sentence_bert_config.json, the Transformer's checkpoint) -> an encoder
graph whose `embedding` output is the folder's pooling of the last hidden states, for BERT,
BigBird and ModernBERT checkpoints, mean and cls pooling; against sentence-transformers itself
(its Transformer, Pooling and Normalize modules on the same token ids), and `longdoc verify`.
The folder's other modules, pooling modes and lower-casing are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.manifest import Manifest
from longdoc.export.runtime import OnnxModel
from longdoc.export.verify import verify_model
from longdoc.export.windows import unit
from longdoc.testing.tiny_models import CLS, PAD, SEP, make_tiny_sentence_transformer, tiny_tokenizer, vocab_size

LENGTHS = (1, 9, 37, 128)  # one token, not block multiples, the folder's max_seq_length


def quiet(_msg):
    pass


def token_batch(S: int, seed: int):
    """[CLS] ... [SEP] rows of S, 2S/3 and S/3 tokens, padded."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(7, vocab_size(), (3, S))
    mask = np.zeros((3, S), np.int64)
    for b, n in enumerate((S, max(1, 2 * S // 3), max(1, S // 3))):
        ids[b, 0], ids[b, n - 1] = CLS, SEP
        mask[b, :n] = 1
    ids[mask == 0] = PAD
    return ids, mask


def sentence_transformers_vectors(folder, ids, mask) -> np.ndarray:
    """sentence-transformers' own modules (Transformer, Pooling, Normalize) on the token ids."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    with torch.no_grad():
        out = model({"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)})
    return out["sentence_embedding"].numpy()


@pytest.mark.parametrize("family", ["bert", "big_bird", "modernbert"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embedding_matches_sentence_transformers(tmp_path, family, pooling):
    folder = make_tiny_sentence_transformer(tmp_path / "st", family, pooling=pooling)
    manifest = export_model(folder, tmp_path / "model", "embed", progress=quiet)
    assert manifest.embedding == {"pooling": pooling, "normalize": True}
    assert manifest.max_length == 128  # sentence_bert_config.json's max_seq_length: the window
    model = OnnxModel(tmp_path / "model", threads=1)
    for S in LENGTHS:
        ids, mask = token_batch(S, S)
        got = unit(model.run_encoder(ids, mask)["embedding"])  # the graph pools; the service normalizes
        want = sentence_transformers_vectors(folder, ids, mask)
        assert np.abs(got - want).max() <= 1e-5, (family, pooling, S)


def test_embed_export_verifies(tmp_path):
    folder = make_tiny_sentence_transformer(tmp_path / "st", "bert")
    export_model(folder, tmp_path / "fp32", "embed", progress=quiet)
    export_model(folder, tmp_path / "int8", "embed", dtype="int8", progress=quiet)
    for against in ("model", "transformers"):
        report = verify_model(tmp_path / "fp32", folder, against=against, progress=quiet)
        assert report.ok, report.summary()
        assert any(c.what == "embedding" for c in report.checks)
    report = verify_model(tmp_path / "int8", folder, progress=quiet)
    assert report.ok, report.summary()
    assert any(c.what.startswith("cosine") for c in report.checks)


def test_verify_catches_other_pooling(tmp_path):
    """an export pooled otherwise than the folder says fails verify (its reference pools as the manifest says)"""
    folder = make_tiny_sentence_transformer(tmp_path / "st", "bert", pooling="cls")
    export_model(folder, tmp_path / "model", "embed", progress=quiet)
    path = tmp_path / "model" / "manifest.json"
    data = json.loads(path.read_text())
    data["embedding"]["pooling"] = "mean"
    path.write_text(json.dumps(data))
    report = verify_model(tmp_path / "model", folder, progress=quiet)
    assert not report.ok


def test_plain_checkpoint_is_mean_pooled_unnormalized(tmp_path):
    folder = make_tiny_sentence_transformer(tmp_path / "st", "bert", pooling="cls", normalize=False)
    (folder / "modules.json").unlink()
    manifest = export_model(folder, tmp_path / "model", "embed", progress=quiet)
    assert manifest.embedding == {"pooling": "mean", "normalize": False}
    assert manifest.max_length == 512  # no sentence-transformers config: the model's own bound


@pytest.mark.parametrize("change, message", [
    (lambda f: (f / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True})),
     "pooling max"),
    (lambda f: (f / "modules.json").write_text(json.dumps(
        [*json.loads((f / "modules.json").read_text()), {"path": "3_Dense", "type": "sentence_transformers.models.Dense"}])),
     "Dense"),
    (lambda f: (f / "sentence_bert_config.json").write_text(json.dumps({"do_lower_case": True})), "do_lower_case"),
    (lambda f: (f / "modules.json").write_text("[{"), "not valid JSON"),
])
def test_folders_the_export_cannot_reproduce_are_refused(tmp_path, change, message):
    folder = make_tiny_sentence_transformer(tmp_path / "st", "bert")
    change(folder)
    with pytest.raises(CheckpointError, match=message):
        export_model(folder, tmp_path / "model", "embed", progress=quiet)
    assert not (tmp_path / "model").exists()


def test_tokenizer_truncation_and_padding_are_dropped(tmp_path):
    """sentence-transformers folders ship a tokenizer.json that truncates (all-MiniLM-L6-v2's at 128)
    and pads: the export's tokenizer must do neither, or the service would embed a cut document"""
    folder = make_tiny_sentence_transformer(tmp_path / "st", "bert")
    tok = tiny_tokenizer()
    tok.enable_truncation(16)
    tok.enable_padding(length=16)
    tok.save(str(folder / "tokenizer.json"))
    notes = []
    export_model(folder, tmp_path / "model", "embed", progress=notes.append)
    model = OnnxModel(tmp_path / "model", threads=1)
    assert len(model.tokenizer.encode(" ".join(["water"] * 40)).ids) == 42
    assert any("dropped" in n and "truncation" in n for n in notes)


def test_manifest_embedding_is_checked(tmp_path):
    folder = make_tiny_sentence_transformer(tmp_path / "st", "bert")
    manifest = export_model(folder, tmp_path / "model", "embed", progress=quiet)
    data = manifest.to_dict()
    with pytest.raises(ValueError, match="embedding"):
        Manifest.from_dict({**data, "embedding": {"pooling": "max", "normalize": True}})
    with pytest.raises(ValueError, match="embedding"):
        Manifest.from_dict({**data, "embedding": None})
    with pytest.raises(ValueError, match="embedding is for task"):
        Manifest.from_dict({**data, "task": "mlm", "embedding": {"pooling": "mean", "normalize": True}})
