"""`longdoc warmstart --encoder-decoder` (model/warmstart.py, the BERT2BERT recipe) and
`longdoc train --task summarize` on its output, tiny models on the CPU."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

from tests.model.test_train import WORDS, _tiny_encoder, write_jsonl

transformers = pytest.importorskip("transformers")


@pytest.fixture
def bert(tmp_path):
    return _tiny_encoder("bert", tmp_path / "bert", 16)  # a bare BertModel: no MLM head


def test_encoder_and_decoder_both_come_from_the_source(tmp_path, bert):
    from longdoc.model import load_pretrained
    from longdoc.model.warmstart import warm_start_encoder_decoder

    record = warm_start_encoder_decoder(tmp_path / "bert", tmp_path / "b2b", 64, block_size=8, num_random_blocks=1)
    ours = load_pretrained(tmp_path / "b2b")
    assert type(ours).__name__ == "EncoderDecoderModel"
    assert record["decoder_max_length"] == 16 and record["max_length"] == 64
    old = bert.embeddings.position_embeddings.weight
    enc_pos = ours.encoder.embeddings.position_embeddings.weight
    dec_pos = ours.decoder.bert.embeddings.position_embeddings.weight
    assert enc_pos.shape == (64, 32) and dec_pos.shape == (16, 32)
    assert all(torch.equal(enc_pos[i], old[i % 16]) for i in range(64))
    assert torch.equal(dec_pos, old)
    for i, layer in enumerate(ours.decoder.bert.encoder.layer):  # self-attention and FFN: the source's
        src = bert.encoder.layer[i]
        assert torch.equal(layer.attention.self.query.weight, src.attention.self.query.weight)
        assert torch.equal(layer.output.dense.weight, src.output.dense.weight)
        assert torch.equal(ours.encoder.encoder.layer[i].attention.self.key.weight, src.attention.self.key.weight)
        # cross-attention is new: BERT init (std initializer_range), not a copy of self-attention
        cross = layer.crossattention.self.query.weight
        assert not torch.equal(cross, src.attention.self.query.weight)
        assert 0.01 < cross.std().item() < 0.03 and torch.equal(layer.crossattention.self.query.bias,
                                                               torch.zeros(32))
    assert "decoder.bert.encoder.layer.0.crossattention.self.query.weight" in record["initialised_keys"]
    assert not any(".attention.self." in k for k in record["initialised_keys"])
    config = json.loads((tmp_path / "b2b" / "config.json").read_text())
    assert config["model_type"] == "encoder-decoder" and config["architectures"] == ["EncoderDecoderModel"]
    assert (config["decoder_start_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 0)  # CLS SEP PAD
    assert config["decoder"]["is_decoder"] and config["decoder"]["add_cross_attention"]
    # the same model for transformers: same encoder output, same logits, same greedy tokens
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        hf = transformers.EncoderDecoderModel.from_pretrained(tmp_path / "b2b").eval()
    ids = torch.randint(7, 47, (2, 60))  # block-sparse (> (5 + 2) * 8)
    with torch.no_grad():
        a = hf(input_ids=ids, decoder_input_ids=ids[:, :5])
        b = ours(ids, decoder_input_ids=ids[:, :5])
        ref = bert(ids[:, :12]).last_hidden_state  # short: full attention, BigBird = the BERT it came from
        mine = ours.encode(ids[:, :12]).last_hidden_state
    assert (a.logits - b.logits).abs().max() <= 1e-5
    assert (ref - mine).abs().max() <= 1e-5


def test_cross_attention_can_start_as_the_layers_self_attention(tmp_path, bert, capsys):
    """--cross-attention self: each decoder layer's cross-attention is a copy of its self-attention
    (the default summarizer's init: a fresh one stayed unused in training), nothing else changes,
    and transformers reads the checkpoint to the same logits."""
    from longdoc.cli import main
    from longdoc.model import load_pretrained

    assert main(["warmstart", str(tmp_path / "bert"), str(tmp_path / "b2b"), "--encoder-decoder", "--max-length", "64",
                 "--block-size", "8", "--num-random-blocks", "1", "--cross-attention", "self"]) == 0
    ours = load_pretrained(tmp_path / "b2b")
    for layer in ours.decoder.bert.encoder.layer:
        for name in ("self.query", "self.key", "self.value", "output.dense", "output.LayerNorm"):
            for part in ("weight", "bias"):
                own = layer.attention.get_submodule(name).get_parameter(part)
                assert torch.equal(layer.crossattention.get_submodule(name).get_parameter(part), own)
    record = json.loads((tmp_path / "b2b" / "warmstart.json").read_text())
    assert record["cross_attention"] == "self"
    assert not any("crossattention" in k for k in record["initialised_keys"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        hf = transformers.EncoderDecoderModel.from_pretrained(tmp_path / "b2b").eval()
    ids = torch.randint(7, 47, (2, 60))
    with torch.no_grad():
        assert (hf(input_ids=ids, decoder_input_ids=ids[:, :5]).logits
                - ours(ids, decoder_input_ids=ids[:, :5]).logits).abs().max() <= 1e-5
    with pytest.raises(SystemExit):
        main(["warmstart", str(tmp_path / "bert"), str(tmp_path / "x"), "--encoder-decoder", "--cross-attention", "copy"])


def test_roberta_source_and_the_cli(tmp_path, capsys):
    from longdoc.cli import main
    from longdoc.model import load_pretrained

    roberta = _tiny_encoder("roberta", tmp_path / "rob", 18)  # 16 usable positions + 2 offset rows
    assert main(["warmstart", str(tmp_path / "rob"), str(tmp_path / "b2b"), "--encoder-decoder",
                 "--max-length", "64", "--block-size", "8", "--decoder-max-length", "24"]) == 0
    assert "encoder-decoder" in capsys.readouterr().out
    ours = load_pretrained(tmp_path / "b2b")
    old = roberta.roberta.embeddings.position_embeddings.weight[2:]
    dec_pos = ours.decoder.bert.embeddings.position_embeddings.weight
    assert dec_pos.shape[0] == 24 and all(torch.equal(dec_pos[i], old[i % 16]) for i in range(24))
    # RoBERTa's MLM head becomes the decoder's LM head, tied to its word embedding
    assert torch.equal(ours.decoder.cls.predictions.transform.dense.weight, roberta.lm_head.dense.weight)
    assert ours.decoder.cls.predictions.decoder.weight is ours.decoder.bert.embeddings.word_embeddings.weight
    assert main(["warmstart", str(tmp_path / "rob"), str(tmp_path / "x"), "--decoder-max-length", "8"]) == 1
    assert "--decoder-max-length needs --encoder-decoder" in capsys.readouterr().err


def test_train_summarize_accepts_the_encoder_decoder(tmp_path, bert):
    from longdoc.model import load_pretrained
    from longdoc.model.train import TrainConfig, train
    from longdoc.model.warmstart import warm_start_encoder_decoder

    warm_start_encoder_decoder(tmp_path / "bert", tmp_path / "b2b", 128, block_size=8, num_random_blocks=1)
    rng = random.Random(0)
    rows = []
    for _ in range(8):
        doc = [rng.choice(WORDS) for _ in range(rng.randrange(60, 100))]
        rows.append({"document": " ".join(doc), "summary": " ".join(doc[:3])})
    data = write_jsonl(tmp_path / "summarize.jsonl", rows)
    with pytest.raises(ValueError, match="max_target_length 32 exceeds the decoder's max_position_embeddings 16"):
        train(TrainConfig(task="summarize", model=str(tmp_path / "b2b"), train=str(data), output=str(tmp_path / "x"),
                          max_target_length=32, quiet=True))
    result = train(TrainConfig(task="summarize", model=str(tmp_path / "b2b"), train=str(data),
                               output=str(tmp_path / "out"), max_length=128, max_target_length=8, batch_size=4,
                               lr=3e-3, warmup_steps=1, max_steps=3, log_every=1000, save_every=0, quiet=True))
    assert result.step == 3 and all(r["loss"] > 0 for r in result.history)
    trained = load_pretrained(tmp_path / "out")
    before = load_pretrained(tmp_path / "b2b")
    assert type(trained).__name__ == "EncoderDecoderModel"
    # the fresh cross-attention was trained
    key = "decoder.bert.encoder.layer.0.crossattention.self.query.weight"
    assert not torch.equal(trained.state_dict()[key], before.state_dict()[key])


def test_freeze_encoder_trains_the_decoder_only(tmp_path, bert):
    """--freeze-encoder (the trained MiniLM encoder collapsed): after training the encoder's
    weights are the warm start's, the decoder's and the cross-attention's are not; other tasks
    are refused."""
    from safetensors.torch import load_file

    from longdoc.cli import main
    from longdoc.model.warmstart import warm_start_encoder_decoder

    warm_start_encoder_decoder(tmp_path / "bert", tmp_path / "b2b", 128, block_size=8, num_random_blocks=1)
    rng = random.Random(0)
    rows = [{"document": " ".join(rng.choice(WORDS) for _ in range(80)), "summary": "w1 w2 w3"} for _ in range(8)]
    data = write_jsonl(tmp_path / "summarize.jsonl", rows)
    assert main(["train", "--task", "summarize", "--model", str(tmp_path / "b2b"), "--train", str(data),
                 "--output", str(tmp_path / "out"), "--max-length", "128", "--max-target-length", "8",
                 "--batch-size", "4", "--lr", "3e-3", "--max-steps", "2", "--save-every", "0", "--quiet",
                 "--freeze-encoder"]) == 0
    before, after = load_file(str(tmp_path / "b2b" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    encoder = [k for k in before if k.startswith("encoder.")]
    assert encoder and all(torch.equal(before[k], after[k]) for k in encoder)
    for k in ("decoder.bert.encoder.layer.0.crossattention.self.query.weight",
              "decoder.bert.encoder.layer.0.attention.self.query.weight"):
        assert not torch.equal(before[k], after[k])
    with pytest.raises(ValueError, match="freeze_encoder is for --task summarize"):
        from longdoc.model.train import TrainConfig, train

        train(TrainConfig(task="mlm", model=str(tmp_path / "b2b"), train=str(data), output=str(tmp_path / "x"),
                          freeze_encoder=True, quiet=True))


def test_freeze_encoder_keeps_pegasus_shared_table_trained():
    """Pegasus ties the word table between encoder and decoder: freezing the encoder leaves it trained."""
    from longdoc.model.pegasus import BigBirdPegasusConfig, BigBirdPegasusForConditionalGeneration
    from longdoc.model.train import freeze_encoder
    from tests.model.test_train import PEGASUS

    model = BigBirdPegasusForConditionalGeneration(BigBirdPegasusConfig.from_dict(PEGASUS))
    n = freeze_encoder(model)
    assert n > 0 and model.model.shared.weight.requires_grad
    assert not any(p.requires_grad for name, p in model.model.encoder.named_parameters() if "embed_tokens" not in name)
    assert all(p.requires_grad for p in model.model.decoder.parameters())
