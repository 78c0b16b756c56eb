"""Loading and saving checkpoint directories: round trips through transformers, and bad input."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from longdoc.model.checkpoint import LoadError, load_pretrained, save_pretrained
from tests.model.conftest import SEP, random_batch


@pytest.mark.parametrize(
    "arch", ["BigBirdModel", "BigBirdForQuestionAnswering", "BigBirdForSequenceClassification", "BigBirdForMaskedLM"]
)
def test_save_then_transformers_loads_same_outputs(hf_checkpoint, tmp_path, arch):
    import transformers

    ckpt = hf_checkpoint(arch, num_labels=3) if arch.endswith("Classification") else hf_checkpoint(arch)
    ours = load_pretrained(ckpt.directory, plan="hf-eval")
    with torch.no_grad():  # change every weight so a silent re-init would show
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out_dir = save_pretrained(ours, tmp_path / "saved")
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["model_type"] == "big_bird"

    theirs = getattr(transformers, arch).from_pretrained(out_dir).eval()
    ids, mask = random_batch(2, 170, pad_tail=10)
    ids[:, 7] = SEP
    with torch.no_grad():
        a, b = theirs(input_ids=ids, attention_mask=mask), ours(ids, attention_mask=mask)
    field = {"BigBirdModel": "last_hidden_state", "BigBirdForQuestionAnswering": "end_logits"}.get(arch, "logits")
    x, y = getattr(a, field), getattr(b, field)
    keep = mask.bool() if x.dim() >= 2 and x.shape[:2] == mask.shape else slice(None)
    x, y = x[keep], y[keep]
    if field == "end_logits":
        x, y = x[x > -1e5], y[y > -1e5]
    assert (x - y).abs().max().item() <= 1e-5
    # and we load what we saved, bit for bit
    again = load_pretrained(out_dir, plan="hf-eval")
    for (k, v), (k2, v2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k


def test_untied_mlm_decoder_round_trips(hf_checkpoint, tmp_path):
    ckpt = hf_checkpoint("BigBirdForMaskedLM", tie_word_embeddings=False)
    ours = load_pretrained(ckpt.directory)
    assert ours.cls.predictions.decoder.weight is not ours.bert.embeddings.word_embeddings.weight
    sd = ckpt.reference(False).state_dict()
    assert torch.equal(ours.cls.predictions.decoder.weight, sd["cls.predictions.decoder.weight"])
    saved = load_file(save_pretrained(ours, tmp_path / "s") / "model.safetensors")
    assert "cls.predictions.decoder.weight" in saved


def test_tied_mlm_decoder_shares_the_embedding(hf_checkpoint):
    ours = load_pretrained(hf_checkpoint("BigBirdForMaskedLM").directory)
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight
    assert ours.cls.predictions.decoder.bias is ours.cls.predictions.bias


def test_pytorch_model_bin_and_legacy_extras(hf_checkpoint, tmp_path):
    """A .bin state dict with what older checkpoints carry: position_ids buffers, the tied
    decoder keys, and a pretraining checkpoint's next-sentence head."""
    ckpt = hf_checkpoint("BigBirdForMaskedLM")
    d = tmp_path / "bin"
    d.mkdir()
    cfg = json.loads((ckpt.directory / "config.json").read_text())
    cfg["architectures"] = ["BigBirdForPreTraining"]
    (d / "config.json").write_text(json.dumps(cfg))
    sd = dict(load_file(ckpt.directory / "model.safetensors"))
    sd["bert.embeddings.position_ids"] = torch.arange(1024)[None]
    sd["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"].clone()
    sd["cls.seq_relationship.weight"] = torch.zeros(2, 32)
    sd["cls.seq_relationship.bias"] = torch.zeros(2)
    torch.save(sd, d / "pytorch_model.bin")
    ours = load_pretrained(d)
    assert type(ours).__name__ == "BigBirdForMaskedLM"
    assert torch.equal(ours.cls.predictions.bias, sd["cls.predictions.bias"])


def test_bare_encoder_from_a_task_checkpoint(hf_checkpoint):
    ckpt = hf_checkpoint("BigBirdForSequenceClassification")
    enc = load_pretrained(ckpt.directory, architecture="BigBirdModel")
    ref = ckpt.reference(False).state_dict()
    assert torch.equal(enc.encoder.layer[1].output.dense.weight, ref["bert.encoder.layer.1.output.dense.weight"])
    assert torch.equal(enc.pooler.weight, ref["bert.pooler.weight"])
    # a QA checkpoint has no pooler: its encoder comes without one
    qa_enc = load_pretrained(hf_checkpoint("BigBirdForQuestionAnswering").directory, architecture="BigBirdModel")
    assert qa_enc.pooler is None and qa_enc(torch.tensor([[70, 71, 72]])).pooler_output is None


# ---------------------------------------------------------------------------------------------
# bad directories


def _copy(ckpt, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(ckpt.directory, d)
    return d


def test_missing_directory_and_files(hf_checkpoint, tmp_path):
    with pytest.raises(LoadError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    d = _copy(hf_checkpoint("BigBirdModel"), tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no weights: expected model.safetensors or pytorch_model.bin"):
        load_pretrained(d)
    (d / "config.json").unlink()
    with pytest.raises(LoadError, match="no config.json"):
        load_pretrained(d)


def test_mismatched_shape_names_key_and_shapes(hf_checkpoint, tmp_path):
    d = _copy(hf_checkpoint("BigBirdForSequenceClassification"), tmp_path)
    sd = dict(load_file(d / "model.safetensors"))
    sd["classifier.out_proj.weight"] = torch.zeros(5, 32)
    del sd["bert.encoder.layer.1.output.dense.bias"]
    sd["bert.encoder.layer.7.output.dense.bias"] = torch.zeros(32)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(LoadError) as e:
        load_pretrained(d)
    msg = str(e.value)
    assert "classifier.out_proj.weight: checkpoint (5, 32) vs model (2, 32)" in msg
    assert "missing keys (1): bert.encoder.layer.1.output.dense.bias" in msg
    assert "unexpected keys (1): bert.encoder.layer.7.output.dense.bias" in msg


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"model_type": "gpt2"}, r"unsupported model_type 'gpt2'; supported: model_type 'big_bird'"),
        ({"model_type": None}, r"unsupported model_type None"),
        ({"architectures": ["BigBirdForCausalLM"]}, r"unsupported architecture 'BigBirdForCausalLM'.*BigBirdForMaskedLM"),
        ({"hidden_act": "swiglu_x"}, r"hidden_act 'swiglu_x' is not supported"),
    ],
)
def test_unknown_model_type_or_architecture(hf_checkpoint, tmp_path, change, pattern):
    d = _copy(hf_checkpoint("BigBirdModel"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=pattern):
        load_pretrained(d)


class _SideEffect:
    """Unpickling this object would create a file (if anything executed it)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_bin_with_code_is_refused_and_not_executed(hf_checkpoint, tmp_path):
    d = _copy(hf_checkpoint("BigBirdModel"), tmp_path)
    (d / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    sd = {"embeddings.word_embeddings.weight": torch.zeros(3), "payload": _SideEffect(marker)}
    with open(tmp_path / "plain-pickle.bin", "wb") as f:
        pickle.dump(sd, f)
    torch.save(sd, tmp_path / "torch-format.bin")  # the zip format too
    for source in (tmp_path / "plain-pickle.bin", tmp_path / "torch-format.bin"):
        shutil.copy(source, d / "pytorch_model.bin")
        with pytest.raises(LoadError, match="refused: not a plain state dict"):
            load_pretrained(d)
    assert not marker.exists()
    # control: the payload is live (plain pickle runs it), so the assertion above can fail
    pickle.loads((tmp_path / "plain-pickle.bin").read_bytes())
    assert marker.exists()


def test_bin_that_is_a_list_is_refused(hf_checkpoint, tmp_path):
    d = _copy(hf_checkpoint("BigBirdModel"), tmp_path)
    (d / "model.safetensors").unlink()
    torch.save([torch.zeros(2)], d / "pytorch_model.bin")
    with pytest.raises(LoadError, match=r"not a plain state dict \(expected \{name: tensor\}, got list\)"):
        load_pretrained(d)


def test_corrupt_safetensors_and_config(hf_checkpoint, tmp_path):
    d = _copy(hf_checkpoint("BigBirdModel"), tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(LoadError, match="not a readable safetensors file"):
        load_pretrained(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="not valid JSON"):
        load_pretrained(d)


# ---------------------------------------------------------------------------------------------
# tokenizer files (longdoc.model.tokenization: no torch)


def _write_tokenizer(d):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<s>", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))


def test_tokenizer_and_special_token_ids(tmp_path):
    from longdoc.model.tokenization import load_tokenizer, special_token_ids

    _write_tokenizer(tmp_path)
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"cls_token": {"content": "[CLS]", "lstrip": False}, "sep_token": "[SEP]", "mask_token": "[MASK]"})
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>", "sep_token": "[UNK]"}))
    # config ids fill what the tokenizer files do not name; a wrong config sep id loses to the file
    (tmp_path / "config.json").write_text(
        json.dumps({"bos_token_id": 2, "eos_token_id": 1, "sep_token_id": 99, "decoder_start_token_id": 0})
    )
    assert load_tokenizer(tmp_path).encode("hello world").ids == [6, 7]
    assert special_token_ids(tmp_path) == {
        "pad": 0, "cls": 3, "sep": 4, "mask": 5, "bos": 2, "eos": 1, "decoder_start": 0
    }


def test_tokenizer_missing_is_a_clear_error(tmp_path):
    from longdoc.model.tokenization import TokenizerError, load_tokenizer, special_token_ids

    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        special_token_ids(tmp_path)


def test_tokenization_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, longdoc.model.tokenization; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bigbird_pegasus_dispatch_and_round_trip(tmp_path):
    """model_type bigbird_pegasus goes to longdoc.model.pegasus; what we save, transformers loads."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BigBirdPegasusConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=512,
        block_size=16, num_random_blocks=2, dropout=0.0, attention_dropout=0.0,
    )
    transformers.BigBirdPegasusForConditionalGeneration(cfg).save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", plan="hf-eval")
    assert type(ours).__name__ == "BigBirdPegasusForConditionalGeneration" and not ours.training
    assert ours.attention_spec.plan == "hf-eval"
    with torch.no_grad():
        ours.model.shared.weight.add_(0.01)
    theirs = transformers.BigBirdPegasusForConditionalGeneration.from_pretrained(
        save_pretrained(ours, tmp_path / "saved")
    ).eval()
    assert torch.equal(theirs.model.shared.weight, ours.model.shared.weight)
    assert torch.equal(theirs.lm_head.weight, ours.model.shared.weight)
