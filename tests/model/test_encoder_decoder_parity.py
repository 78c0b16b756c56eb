"""longdoc.model.encoder_decoder against transformers' EncoderDecoderModel (big_bird encoder, bert
decoder with cross-attention) on tiny random models: same weights (saved by transformers, loaded
by longdoc.model.checkpoint), same hidden states, logits and loss to 1e-5, same generated tokens."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longdoc.model.checkpoint import LoadError, load_pretrained, save_pretrained  # noqa: E402
from longdoc.model.encoder_decoder import EncoderDecoderConfig, EncoderDecoderModel  # noqa: E402

TOL = 1e-5
VOCAB = 80
START, PAD, EOS = 1, 0, 2


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_hf(attention_type="block_sparse", block_size=16, num_random_blocks=2, seed=0, tie=True, **generation):
    """A random-init transformers EncoderDecoderModel, every dropout 0, a large init std (so a
    wrong weight, position or mask shows far above TOL)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.2)
    enc = transformers.BigBirdConfig(**common, max_position_embeddings=1024, block_size=block_size,
                                     num_random_blocks=num_random_blocks, attention_type=attention_type)
    dec = transformers.BertConfig(**common, max_position_embeddings=64, is_decoder=True, add_cross_attention=True,
                                  tie_word_embeddings=tie)
    cfg = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = START, PAD, EOS
    hf = transformers.EncoderDecoderModel(cfg)
    for k, v in generation.items():  # written to generation_config.json
        setattr(hf.generation_config, k, v)
    with torch.no_grad():  # a non-zero output bias, so that a missing one shows
        hf.decoder.cls.predictions.bias.normal_(std=0.5)
    return hf


def hf_and_ours(tmp_path, plan="hf-eval", **kw):
    hf = tiny_hf(**kw)
    hf.save_pretrained(tmp_path / "hf")
    return hf, load_pretrained(tmp_path / "hf", plan=plan)


def batch(B, L, seed=1, pad_last=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    mask = torch.ones_like(ids)
    if pad_last:
        ids[-1, L - pad_last:] = PAD
        mask[-1, L - pad_last:] = 0
    return ids, mask


def run_hf(hf, attention_type, **inputs):
    # transformers' BigBird switches itself to full attention on short inputs and stays switched
    hf.encoder.set_attention_type(attention_type)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*padded from", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' loss deprecation note
        return hf(**inputs)


def hf_generate(hf, attention_type, ids, mask, **kw):
    hf.encoder.set_attention_type(attention_type)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        return hf.generate(input_ids=ids, attention_mask=mask, **kw)


def test_state_dict_keys_and_shapes_equal_transformers():
    for tie in (True, False):
        hf = tiny_hf(tie=tie)
        ours = EncoderDecoderModel(EncoderDecoderConfig.from_dict(hf.config.to_dict()))
        assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
               {k: tuple(v.shape) for k, v in hf.state_dict().items()}
        tied = ours.decoder.cls.predictions.decoder.weight is ours.decoder.bert.embeddings.word_embeddings.weight
        assert tied == tie


# (attention_type, block_size, r, L, pad_last, transformers mode / our plan);
# full attention up to (5 + 2r) * block_size: r=1 -> 112, r=2 -> 144 at block_size 16
CASES = [
    ("original_full", 16, 2, 37, 9, "eval"),
    ("block_sparse", 16, 1, 112, 20, "eval"),  # at the threshold: full attention
    ("block_sparse", 16, 1, 113, 20, "eval"),  # one past: sparse, padded to 128
    ("block_sparse", 16, 2, 200, 50, "eval"),
    ("block_sparse", 16, 2, 200, 50, "train"),
    ("block_sparse", 32, 2, 330, 70, "train"),
]


@pytest.mark.parametrize("attention_type,block_size,r,L,pad_last,mode", CASES)
def test_hidden_states_and_logits_match_transformers(tmp_path, attention_type, block_size, r, L, pad_last, mode):
    hf, ours = hf_and_ours(tmp_path, "hf-train" if mode == "train" else "hf-eval", attention_type=attention_type,
                           block_size=block_size, num_random_blocks=r)
    hf.train(mode == "train")
    ours.train(mode == "train")  # every dropout is 0: train mode gives the same numbers
    ids, mask = batch(2, L, pad_last=pad_last)
    dec, _ = batch(2, 7, seed=2)
    a = run_hf(hf, attention_type, input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    with torch.no_grad():
        b = ours(ids, mask, decoder_input_ids=dec)
    assert b.encoder_last_hidden_state.shape == (2, L, 16)
    assert (a.encoder_last_hidden_state - b.encoder_last_hidden_state).abs().max() <= TOL
    assert (a.logits - b.logits).abs().max() <= TOL
    assert (a.encoder_last_hidden_state[0] - a.encoder_last_hidden_state[1]).abs().max() > 1e-2


def test_wrong_plan_is_detected(tmp_path):
    """The parity test can fail: transformers' train-mode random blocks are not hf-eval's."""
    hf, ours = hf_and_ours(tmp_path, "hf-eval")
    hf.train()
    ids, mask = batch(1, 200)
    a = run_hf(hf, "block_sparse", input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3])
    with torch.no_grad():
        b = ours(ids, mask, decoder_input_ids=ids[:, :3])
    assert (a.encoder_last_hidden_state - b.encoder_last_hidden_state).abs().max() > 1e-3


@pytest.mark.parametrize("tie", [True, False])
def test_labels_loss_and_decoder_mask_match_transformers(tmp_path, tie):
    """labels only: transformers shifts them right and masks the decoder where the shifted ids
    are pad; an explicit decoder mask with right padding too."""
    hf, ours = hf_and_ours(tmp_path, tie=tie)
    hf.eval()
    ids, mask = batch(2, 150, pad_last=20)
    labels, _ = batch(2, 6, seed=3)
    labels[1, 3] = PAD  # a pad inside the labels: its shifted position is masked by transformers' rule
    labels[1, 5:] = -100
    a = run_hf(hf, "block_sparse", input_ids=ids, attention_mask=mask, labels=labels)
    with torch.no_grad():
        b = ours(ids, mask, labels=labels)
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    assert (a.logits - b.logits).abs().max() <= TOL
    dec_mask = torch.ones_like(labels)
    dec_mask[1, 4:] = 0
    a = run_hf(hf, "block_sparse", input_ids=ids, attention_mask=mask, labels=labels,
               decoder_input_ids=labels.clamp(min=0), decoder_attention_mask=dec_mask)
    with torch.no_grad():
        b = ours(ids, mask, labels=labels, decoder_input_ids=labels.clamp(min=0), decoder_attention_mask=dec_mask)
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    assert (a.logits - b.logits).abs().max() <= TOL


def test_kv_cache_steps_equal_full_pass(tmp_path):
    _, ours = hf_and_ours(tmp_path)
    ids, mask = batch(2, 150, pad_last=30)
    dec, _ = batch(2, 6, seed=4)
    with torch.no_grad():
        full = ours(ids, mask, decoder_input_ids=dec)
        cross = ours.cross_attention_kv(full.encoder_last_hidden_state)
        past, steps = None, []
        for start, end in [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]:
            pos = torch.arange(start, end).expand(2, -1)
            logits, past = ours.decoder_step(dec[:, start:end], pos, torch.ones(2, end, dtype=torch.long), cross,
                                             mask, past)
            steps.append(logits)
    assert past[0][0].shape == (2, 2, 6, 8)  # (B, H, P+T, D)
    assert (torch.cat(steps, dim=1) - full.logits).abs().max() <= TOL


# (L, pad_last, generation options): full and block-sparse encoder lengths, padded rows
GENERATE_CASES = [
    (40, 10, dict(num_beams=1)),
    (200, 50, dict(num_beams=1)),
    (200, 50, dict(num_beams=3)),
    (113, 0, dict(num_beams=4, length_penalty=0.6, no_repeat_ngram_size=2, early_stopping=True)),
    (200, 0, dict(num_beams=2, min_length=8)),
]


@pytest.mark.parametrize("L,pad_last,options", GENERATE_CASES)
def test_generated_tokens_equal_transformers(tmp_path, L, pad_last, options):
    hf, ours = hf_and_ours(tmp_path)
    hf.eval()
    ids, mask = batch(3, L, seed=7, pad_last=pad_last)
    a = hf_generate(hf, "block_sparse", ids, mask, max_new_tokens=12, **options)
    b = ours.generate(ids, mask, max_new_tokens=12, **options)
    assert torch.equal(a, b), (a, b)
    assert a[:, 0].eq(START).all() and a.shape[1] > 2


def test_generation_defaults_come_from_the_checkpoint(tmp_path):
    """num_beams / no_repeat_ngram_size in generation_config.json reach our search."""
    hf, ours = hf_and_ours(tmp_path, num_beams=3, no_repeat_ngram_size=2)
    assert ours.config.num_beams == 3
    hf.eval()
    ids, mask = batch(2, 60, seed=8)
    a = hf_generate(hf, "block_sparse", ids, mask, max_new_tokens=10)
    assert torch.equal(a, ours.generate(ids, mask, max_new_tokens=10))
    assert not torch.equal(a, ours.generate(ids, mask, max_new_tokens=10, num_beams=1, no_repeat_ngram_size=0))


def test_save_pretrained_round_trips_through_transformers(tmp_path):
    _, ours = hf_and_ours(tmp_path, tie=False)
    save_pretrained(ours, tmp_path / "ours")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        back = transformers.EncoderDecoderModel.from_pretrained(tmp_path / "ours").eval()
    ids, mask = batch(2, 130, pad_last=10)
    a = run_hf(back, "block_sparse", input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5])
    with torch.no_grad():
        b = ours(ids, mask, decoder_input_ids=ids[:, :5])
    assert (a.logits - b.logits).abs().max() <= TOL
    assert load_pretrained(tmp_path / "ours").config.to_dict()["decoder"]["tie_word_embeddings"] is False


def test_unsupported_configs_are_refused_by_name(tmp_path):
    hf = tiny_hf()
    d = hf.config.to_dict()
    with pytest.raises(ValueError, match="tie_encoder_decoder"):
        EncoderDecoderConfig.from_dict({**d, "tie_encoder_decoder": True})
    with pytest.raises(ValueError, match="'big_bird' encoder and a 'bert' decoder"):
        EncoderDecoderConfig.from_dict({**d, "encoder": {**d["encoder"], "model_type": "roberta"}})
    with pytest.raises(ValueError, match="is_decoder"):
        EncoderDecoderConfig.from_dict({**d, "decoder": {**d["decoder"], "is_decoder": False}})
    hf.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "hf" / "model.safetensors")
    del state["decoder.bert.encoder.layer.1.crossattention.self.key.weight"]
    save_file(state, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(LoadError, match="crossattention.self.key.weight"):
        load_pretrained(tmp_path / "hf")
