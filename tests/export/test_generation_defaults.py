"""A checkpoint's generation settings travel to the exported model: generation_config.json (where
transformers writes them) over config.json, into manifest.decoder["generation"], and
OnnxModel.generate then gives what transformers' generate() gives for that checkpoint."""

import json

import numpy as np
import pytest

from longdoc.export.exporter import generation_defaults
from longdoc.export.runtime import OnnxModel
from longdoc.testing.tiny_models import EOS, TINY_GENERATION, make_tiny_checkpoint, make_tiny_export


def test_generation_config_json_wins_over_config_json(tmp_path):
    config = {"min_length": 3, "no_repeat_ngram_size": 4, "num_beams": 2, "decoder_start_token_id": 2,
              "vocab_size": 100}
    assert generation_defaults(tmp_path, config) == {"min_length": 3, "no_repeat_ngram_size": 4, "num_beams": 2,
                                                     "decoder_start_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"min_length": 6, "no_repeat_ngram_size": None, "forced_eos_token_id": 1, "length_penalty": 0.6,
         "eos_token_id": 1, "transformers_version": "5.0"}))
    assert generation_defaults(tmp_path, config) == {"min_length": 6, "num_beams": 2, "decoder_start_token_id": 2,
                                                     "forced_eos_token_id": 1, "length_penalty": 0.6}
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json: not a JSON object"):
        generation_defaults(tmp_path, config)


@pytest.fixture(scope="module")
def checkpoint_and_model(tmp_path_factory):
    """A transformers-made summarizer whose generation_config.json sets min_length,
    forced_eos_token_id, no_repeat_ngram_size and length_penalty; exported with transformers'
    eval-mode random blocks (plan hf-eval), so the two agree at block-sparse lengths too."""
    root = tmp_path_factory.mktemp("tiny-summarize-generation")
    checkpoint = make_tiny_checkpoint(root / "checkpoint", "summarize", source="transformers",
                                      generation=TINY_GENERATION)
    model_dir = make_tiny_export(root / "model", "summarize", checkpoint_dir=checkpoint, plan="hf-eval")
    return checkpoint, OnnxModel(model_dir, threads=1)


def cut(row) -> list[int]:
    """A generated row up to and including its first eos (what follows is fill)."""
    row = [int(t) for t in row]
    return row[: row.index(EOS, 1) + 1] if EOS in row[1:] else row


def test_exported_generation_defaults_generate_what_transformers_generates(checkpoint_and_model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    checkpoint, model = checkpoint_and_model
    assert model.manifest.decoder["generation"] == {**TINY_GENERATION, "decoder_start_token_id": 2}
    hf = transformers.BigBirdPegasusForConditionalGeneration.from_pretrained(checkpoint).eval()
    assert hf.generation_config.min_length == TINY_GENERATION["min_length"]
    rng = np.random.default_rng(0)
    differs_without_options = 0
    for length in (40, 130, 200):  # full attention, and block-sparse past (5 + 2r) * 16 = 144
        ids = rng.integers(7, 300, (1, length)).astype(np.int64)
        ids[0, -1] = EOS
        for num_beams in (1, 3):
            hf.model.encoder.set_attention_type("block_sparse")  # undo transformers' sticky switch to full
            with torch.no_grad():
                want = hf.generate(input_ids=torch.from_numpy(ids), do_sample=False, max_new_tokens=10,
                                   num_beams=num_beams)[0].tolist()
            got = model.generate(ids, max_new_tokens=10, num_beams=num_beams)[0]
            assert got == cut(want), (length, num_beams)
            plain = model.generate(ids, max_new_tokens=10, num_beams=num_beams, min_length=0,
                                   no_repeat_ngram_size=0, length_penalty=1.0)[0]
            differs_without_options += plain != got
    assert differs_without_options >= 2  # the options changed the answers (the test can fail)


def test_pytorch_reference_reads_generation_config_json(checkpoint_and_model):
    """`verify --against model` compares with a PyTorch model that has the same defaults."""
    from longdoc import model

    checkpoint, onnx_model = checkpoint_and_model
    reference = model.load_pretrained(checkpoint, plan="hf-eval")
    for key, value in TINY_GENERATION.items():
        assert getattr(reference.config, key) == value, key
    ids = np.random.default_rng(1).integers(7, 300, (1, 60)).astype(np.int64)
    ids[0, -1] = EOS
    torch = pytest.importorskip("torch")
    for num_beams in (1, 3):
        ours = reference.generate(torch.from_numpy(ids), num_beams=num_beams, max_new_tokens=12)[0].tolist()
        assert cut(onnx_model.generate(ids, num_beams=num_beams, max_new_tokens=12)[0]) == cut(ours)
