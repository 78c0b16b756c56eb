"""longdoc.model.led against transformers' LEDForConditionalGeneration on tiny random models: same
weights (saved by transformers, loaded by longdoc.model.checkpoint), same encoder states, logits
and loss to 1e-5 (fp32), the same generated tokens (greedy and beam search); per-layer windows that
differ, lengths that are and are not window multiples, global tokens at several positions and
counts (per row), only the first token, none; padded batches."""

from __future__ import annotations

import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longdoc.model.checkpoint import LoadError, load_pretrained, save_pretrained  # noqa: E402
from longdoc.model.led import LEDConfig, LEDForConditionalGeneration  # noqa: E402
from longdoc.testing.tiny_models import nudge_vectors  # noqa: E402

TOL = 1e-5
VOCAB = 60
BOS, PAD, EOS, START = 0, 1, 2, 2  # transformers' LED defaults (BART's ids; decoder_start = eos)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_hf(seed=0, **kw):
    """A random-init transformers LED, every dropout 0, a large init_std (so outputs differ
    clearly between tokens, positions and windows), non-zero biases and final_logits_bias."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_encoder_position_embeddings=512,
               max_decoder_position_embeddings=64, attention_window=[8, 16], dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, init_std=0.2)
    cfg.update(kw)
    hf = transformers.LEDForConditionalGeneration(transformers.LEDConfig(**cfg)).eval()
    nudge_vectors(hf, 0.05)
    with torch.no_grad():
        hf.final_logits_bias.normal_(std=0.5)
    return hf


@pytest.fixture
def hf_and_ours(tmp_path):
    def make(**kw):
        hf = tiny_hf(**kw)
        hf.save_pretrained(tmp_path / "hf")
        return hf, load_pretrained(tmp_path / "hf")

    return make


def batch(B, L, seed=1, pad_tail=(0,)):
    """Random ids (B, L) in [3, VOCAB); row b has pad_tail[b] trailing pad tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    mask = torch.ones_like(ids)
    for b, n in enumerate(pad_tail):
        if n:
            ids[b, L - n:] = PAD
            mask[b, L - n:] = 0
    return ids, mask


def global_mask(B, L, positions):
    """positions: None (no global tokens) or one list of positions per row."""
    if positions is None:
        return None
    g = torch.zeros(B, L, dtype=torch.long)
    for b, row in enumerate(positions):
        g[b, row] = 1
    return g


def test_state_dict_keys_and_shapes_equal_transformers():
    for tie in (True, False):
        hf = tiny_hf(tie_word_embeddings=tie)
        ours = LEDForConditionalGeneration(LEDConfig.from_dict(hf.config.to_dict()))
        assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
            {k: tuple(v.shape) for k, v in hf.state_dict().items()}
        assert (ours.lm_head.weight is ours.led.shared.weight) == tie
        assert (ours.led.encoder.embed_tokens is ours.led.decoder.embed_tokens) == tie


# (config overrides, length, global positions per row (None = none), rows' padded tails)
CASES = [
    ({}, 64, None, (0, 0)),  # a window multiple, no global tokens
    ({}, 50, [[0], [0]], (0, 14)),  # only the first token (LED's recipe); padded
    ({}, 150, [[0, 5, 40, 41, 149], [77]], (0, 33)),  # counts differ per row
    ({}, 130, [[3, 64, 100], []], (0, 70)),  # a row without global tokens
    ({"attention_window": [16, 8], "activation_function": "gelu_new"}, 97, [[10, 11, 12], [0, 96]], (0, 1)),
    ({"attention_window": 32, "d_model": 32, "encoder_attention_heads": 4}, 200, [[0, 1, 2, 3], [0]], (0, 50)),
    ({"attention_window": [8, 24]}, 100, [[0, 99], [50]], (0, 9)),  # transformers pads to 24, we to 12's multiples
    ({}, 7, [[0, 6], [1]], (0, 3)),  # shorter than a window
    ({"tie_word_embeddings": False}, 90, [[0], [0, 45]], (0, 20)),  # four embedding tables
]


@pytest.mark.parametrize("overrides,L,positions,pads", CASES)
def test_encoder_states_and_logits_match_transformers(hf_and_ours, overrides, L, positions, pads):
    hf, ours = hf_and_ours(**overrides)
    ids, mask = batch(2, L, pad_tail=pads)
    g = global_mask(2, L, positions)
    dec, _ = batch(2, 7, seed=2)
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask, global_attention_mask=g, decoder_input_ids=dec)
        b = ours(ids, mask, decoder_input_ids=dec, global_attention_mask=g)
    assert b.encoder_last_hidden_state.shape == a.encoder_last_hidden_state.shape
    real = mask.bool()
    assert (a.encoder_last_hidden_state - b.encoder_last_hidden_state).abs()[real].max() <= TOL
    assert (a.logits - b.logits).abs().max() <= TOL
    # rows differ, so a wrong mask, window or global token would show
    assert (a.logits[0] - a.logits[1]).abs().max() > 1e-2


def test_global_tokens_and_windows_change_the_answer(hf_and_ours):
    """The parity above can fail: the global tokens and each layer's window change the outputs."""
    hf, ours = hf_and_ours()
    ids, mask = batch(1, 120)
    dec, _ = batch(1, 5, seed=2)
    with torch.no_grad():
        none = ours(ids, mask, decoder_input_ids=dec).logits
        first = ours(ids, mask, decoder_input_ids=dec, global_attention_mask=global_mask(1, 120, [[0]])).logits
        assert (none - first).abs().max() > 1e-2
        hf2 = tiny_hf(attention_window=[8, 8])  # same weights, another window in layer 1
        other = hf2(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        assert (other - none).abs().max() > 1e-2


def test_loss_and_decoder_mask_match_transformers(hf_and_ours):
    hf, ours = hf_and_ours()
    ids, mask = batch(2, 70, pad_tail=(0, 11))
    g = global_mask(2, 70, [[0], [0, 3]])
    labels, _ = batch(2, 6, seed=3)
    labels[1, 4:] = -100
    dec_mask = torch.ones_like(labels)
    dec_mask[1, 4:] = 0
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask, global_attention_mask=g, labels=labels, decoder_attention_mask=dec_mask)
        b = ours(ids, mask, labels=labels, decoder_attention_mask=dec_mask, global_attention_mask=g)
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    assert (a.logits - b.logits).abs().max() <= TOL


def test_kv_cache_steps_equal_full_pass(hf_and_ours):
    _, ours = hf_and_ours()
    ids, mask = batch(2, 60, pad_tail=(0, 10))
    dec, _ = batch(2, 6, seed=4)
    with torch.no_grad():
        full = ours(ids, mask, decoder_input_ids=dec)
        cross = ours.cross_attention_kv(full.encoder_last_hidden_state)
        past, steps = None, []
        for start, end in [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]:
            pos = torch.arange(start, end).expand(2, -1)
            logits, past = ours.decoder_step(dec[:, start:end], pos, torch.ones(2, end, dtype=torch.long), cross, mask, past)
            steps.append(logits)
    assert (torch.cat(steps, dim=1) - full.logits).abs().max() <= TOL


# ----------------------------------------------------------------------------------------------
# generation


@pytest.fixture(scope="module")
def gen_models(tmp_path_factory):
    """(transformers model, ours); eos gets a logit bias so that hypotheses end at different lengths."""
    hf = tiny_hf(max_decoder_position_embeddings=64)
    with torch.no_grad():
        hf.final_logits_bias[0, EOS] = 2.5
    d = tmp_path_factory.mktemp("led")
    hf.save_pretrained(d)
    return hf, load_pretrained(d)


def gen_inputs(L, seed=1):
    ids, mask = batch(3, L, seed=seed, pad_tail=(0, 25, 0))
    return ids, mask, global_mask(3, L, [[0], [0, 9], [0, L // 2, L - 1]])


def hf_generate(hf, ids, mask, g, **kw):
    with torch.no_grad():
        return hf.generate(input_ids=ids, attention_mask=mask, global_attention_mask=g, do_sample=False, **kw)


GREEDY = [dict(num_beams=1, no_repeat_ngram_size=n) for n in (0, 2, 3)]
BEAM = [dict(num_beams=nb, length_penalty=lp, no_repeat_ngram_size=n, early_stopping=es)
        for nb, lp, n, es in itertools.product((2, 4), (0.6, 2.0), (0, 3), (False, True, "never"))]


@pytest.mark.parametrize("L", [48, 77])  # a window multiple / not
def test_generate_matches_transformers(gen_models, L):
    hf, ours = gen_models
    ids, mask, g = gen_inputs(L)
    ended_early = runs = 0
    seen_widths = set()
    for kw in GREEDY + BEAM:
        a = hf_generate(hf, ids, mask, g, max_new_tokens=12, **kw)
        b = ours.generate(ids, mask, global_attention_mask=g, max_new_tokens=12, **kw)
        assert b.tolist() == a.tolist(), kw
        ended_early += int((a[:, 1:] == EOS).any(dim=1).sum())
        seen_widths.add(a.shape[1])
        runs += 1
    assert ended_early > runs and len(seen_widths) >= 3  # eos handling and several lengths were exercised


def test_min_length_and_forced_bos_eos_match_transformers(gen_models):
    """What LED checkpoints set: min_length, forced_bos_token_id (BART's <s> first),
    forced_eos_token_id, no_repeat_ngram_size with beams."""
    hf, ours = gen_models
    ids, mask, g = gen_inputs(90, seed=3)
    for kw in [dict(num_beams=1, min_length=6), dict(num_beams=3, min_length=8, length_penalty=0.8),
               dict(num_beams=1, forced_bos_token_id=BOS), dict(num_beams=4, forced_bos_token_id=BOS, no_repeat_ngram_size=3),
               dict(num_beams=2, forced_eos_token_id=EOS), dict(num_beams=4, forced_bos_token_id=BOS, forced_eos_token_id=EOS,
                                                             min_length=5, length_penalty=2.0, no_repeat_ngram_size=3)]:
        a = hf_generate(hf, ids, mask, g, max_new_tokens=10, **kw)
        b = ours.generate(ids, mask, global_attention_mask=g, max_new_tokens=10, **kw)
        assert b.tolist() == a.tolist(), kw
        if "forced_bos_token_id" in kw:
            assert (b[:, 1] == BOS).all()
        if "min_length" in kw:
            assert not (b[:, 1:kw["min_length"]] == EOS).any()


def test_generation_defaults_come_from_the_checkpoint(tmp_path):
    """generation_config.json's settings (led-large-16384-arxiv style) are what generate() uses,
    as in transformers; the first token is global unless the caller says otherwise."""
    hf = tiny_hf()
    with torch.no_grad():
        hf.final_logits_bias[0, EOS] = 2.5
    hf.generation_config.update(num_beams=3, length_penalty=2.0, no_repeat_ngram_size=3, min_length=4,
                                max_length=12, forced_bos_token_id=BOS, early_stopping=True)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids, mask, _ = gen_inputs(60, seed=4)
    first = global_mask(3, 60, [[0], [0], [0]])
    a = hf_generate(hf, ids, mask, first)
    assert a.shape[1] > 2 and (a[:, 1] == BOS).all()
    assert ours.generate(ids, mask).tolist() == a.tolist()  # default globals: the first token
    assert ours.generate(ids, mask, global_attention_mask=torch.zeros_like(ids)).tolist() == \
        hf_generate(hf, ids, mask, None).tolist()


# ----------------------------------------------------------------------------------------------
# checkpoints and inputs


def test_save_pretrained_round_trips_through_transformers(hf_and_ours, tmp_path):
    for tie in (True, False):
        _, ours = hf_and_ours(tie_word_embeddings=tie, attention_window=[16, 8])
        save_pretrained(ours, tmp_path / f"ours-{tie}")
        back = transformers.LEDForConditionalGeneration.from_pretrained(tmp_path / f"ours-{tie}").eval()
        again = load_pretrained(tmp_path / f"ours-{tie}")
        ids, mask = batch(2, 75, pad_tail=(0, 10))
        g = global_mask(2, 75, [[0, 30], [0]])
        with torch.no_grad():
            a = back(input_ids=ids, attention_mask=mask, global_attention_mask=g, decoder_input_ids=ids[:, :5])
            b = ours(ids, mask, decoder_input_ids=ids[:, :5], global_attention_mask=g)
            c = again(ids, mask, decoder_input_ids=ids[:, :5], global_attention_mask=g)
        assert (a.logits - b.logits).abs().max() <= TOL
        assert torch.equal(b.logits, c.logits)


def test_config_round_trip_keeps_unknown_keys_and_aliases():
    d = transformers.LEDConfig(d_model=16, encoder_attention_heads=2, decoder_attention_heads=2,
                               attention_window=[8, 8], encoder_layers=2).to_dict()
    d["some_future_field"] = [1, 2]
    cfg = LEDConfig.from_dict(d)
    assert cfg.d_model == 16 and cfg.attention_window == [8, 8]
    assert cfg.to_dict()["some_future_field"] == [1, 2] and cfg.to_dict()["model_type"] == "led"
    assert LEDConfig.from_dict({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                                "attention_window": 8, "decoder_attention_heads": 4}).encoder_attention_heads == 4
    with pytest.raises(ValueError, match="model_type"):
        LEDConfig.from_dict({**d, "model_type": "bigbird_pegasus"})
    with pytest.raises(ValueError, match="attention_window"):
        LEDConfig.from_dict({**d, "attention_window": [8, 7]})


def test_wrong_checkpoint_is_refused(hf_and_ours, tmp_path):
    """An LED config over Longformer-encoder weights (LongformerModel keys) fails by name."""
    torch.manual_seed(0)
    lf = transformers.LongformerModel(transformers.LongformerConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        attention_window=[8, 16]))
    lf.save_pretrained(tmp_path / "lf")
    cfg = tiny_hf().config.to_dict()
    (tmp_path / "lf" / "config.json").write_text(__import__("json").dumps(cfg))
    with pytest.raises(LoadError, match="missing keys"):
        load_pretrained(tmp_path / "lf")


def test_input_longer_than_the_position_tables_is_refused(hf_and_ours):
    _, ours = hf_and_ours(max_encoder_position_embeddings=96, max_decoder_position_embeddings=16)
    with torch.no_grad():
        ours.encode(*batch(1, 96))  # exactly the table
        with pytest.raises(ValueError, match="position table"):
            ours.encode(*batch(1, 97))
        ids, mask = batch(1, 40)
        with pytest.raises(ValueError, match="position table"):
            ours.generate(ids, mask, max_new_tokens=17, min_length=100)
        assert ours.generate(ids, mask, max_new_tokens=16, min_length=100).shape[1] == 17
        dec, _ = batch(1, 17, seed=2)
        assert ours(ids, mask, decoder_input_ids=dec[:, :16]).logits.shape == (1, 16, VOCAB)
        with pytest.raises(ValueError, match="position table"):
            ours(ids, mask, decoder_input_ids=dec)
