"""longdoc.model.pegasus against transformers' BigBirdPegasusForConditionalGeneration on tiny random models:
same weights (saved by transformers, loaded by longdoc.model.checkpoint), same outputs to 1e-5."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longdoc.model.checkpoint import load_pretrained, save_pretrained  # noqa: E402
from longdoc.model.pegasus import BigBirdPegasusConfig, BigBirdPegasusForConditionalGeneration  # noqa: E402

TOL = 1e-5
VOCAB = 60


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_hf(attention_type="block_sparse", block_size=16, num_random_blocks=2, max_pos=512, seed=0, **kw):
    """A random-init transformers model with every dropout 0 (so train mode is deterministic) and
    a large init_std (so outputs differ clearly between tokens and positions)."""
    torch.manual_seed(seed)
    cfg = transformers.BigBirdPegasusConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=max_pos,
        block_size=block_size, num_random_blocks=num_random_blocks, attention_type=attention_type,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.2, **kw)
    hf = transformers.BigBirdPegasusForConditionalGeneration(cfg)
    with torch.no_grad():  # a non-zero bias so that a missing final_logits_bias shows
        hf.final_logits_bias.normal_(std=0.5)
    return hf


def hf_and_ours(tmp_path, plan, **kw):
    hf = tiny_hf(**kw)
    hf.save_pretrained(tmp_path / "hf")
    return hf, load_pretrained(tmp_path / "hf", plan=plan)


def batch(B, L, seed=1, pad_last=0):
    """Random ids (B, L) in [3, VOCAB); the last row has `pad_last` trailing pad tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    mask = torch.ones_like(ids)
    if pad_last:
        ids[-1, L - pad_last:] = 0
        mask[-1, L - pad_last:] = 0
    return ids, mask


def run_hf(hf, attention_type, **inputs):
    # transformers switches its encoder to full attention on short inputs and stays switched;
    # put it back so that every call sees the configured attention type
    hf.model.encoder.set_attention_type(attention_type)
    with torch.no_grad():
        return hf(**inputs)


def test_state_dict_keys_and_shapes_equal_transformers():
    hf = tiny_hf()
    cfg = BigBirdPegasusConfig.from_dict(hf.config.to_dict())
    ours = BigBirdPegasusForConditionalGeneration(cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mine == theirs
    # the embedding is one tensor under four names, as in transformers
    assert ours.lm_head.weight is ours.model.shared.weight
    assert ours.model.encoder.embed_tokens is ours.model.shared is ours.model.decoder.embed_tokens


# (attention_type, block_size, r, L, pad_last, transformers mode / our plan)
# threshold (5 + 2r) * block_size: r=1, bs=16 -> 112; r=2, bs=16 -> 144; r=3, bs=16 -> 176; r=2, bs=32 -> 288
CASES = [
    ("original_full", 16, 2, 37, 9, "eval"),
    ("block_sparse", 16, 1, 112, 20, "eval"),  # at the threshold: full attention
    ("block_sparse", 16, 1, 113, 20, "eval"),  # one past: sparse, padded to 128
    ("block_sparse", 16, 1, 113, 20, "train"),
    ("block_sparse", 16, 2, 160, 40, "train"),  # a block multiple
    ("block_sparse", 16, 3, 200, 50, "eval"),
    ("block_sparse", 16, 3, 200, 50, "train"),
    ("block_sparse", 32, 2, 288, 30, "train"),  # at the threshold
    ("block_sparse", 32, 2, 330, 70, "eval"),
    ("block_sparse", 32, 3, 450, 0, "train"),
]


@pytest.mark.parametrize("attention_type,block_size,r,L,pad_last,mode", CASES)
def test_encoder_and_decoder_match_transformers(tmp_path, attention_type, block_size, r, L, pad_last, mode):
    hf, ours = hf_and_ours(tmp_path, "hf-train" if mode == "train" else "hf-eval",
                           attention_type=attention_type, block_size=block_size, num_random_blocks=r)
    hf.train(mode == "train")
    ours.train(mode == "train")  # every dropout is 0: train mode must give the same numbers
    ids, mask = batch(2, L, pad_last=pad_last)
    dec, _ = batch(2, 7, seed=2)
    a = run_hf(hf, attention_type, input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    with torch.no_grad():
        b = ours(ids, mask, decoder_input_ids=dec)
    assert b.encoder_last_hidden_state.shape == a.encoder_last_hidden_state.shape == (2, L, 16)
    real = mask.bool()
    enc_diff = (a.encoder_last_hidden_state - b.encoder_last_hidden_state).abs()
    assert enc_diff[real].max() <= TOL
    assert enc_diff.max() <= TOL  # padded positions too
    assert (a.logits - b.logits).abs().max() <= TOL
    # the encoder output differs between rows, so a wrong mask or layout would show
    assert (a.encoder_last_hidden_state[0] - a.encoder_last_hidden_state[1]).abs().max() > 1e-2


def test_wrong_plan_is_detected(tmp_path):
    """The parity test can fail: transformers' train-mode random blocks differ from hf-eval's."""
    hf, ours = hf_and_ours(tmp_path, "hf-eval", block_size=16, num_random_blocks=2)
    hf.train()
    ids, mask = batch(1, 160)
    a = run_hf(hf, "block_sparse", input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3])
    with torch.no_grad():
        b = ours(ids, mask, decoder_input_ids=ids[:, :3])
    assert (a.encoder_last_hidden_state - b.encoder_last_hidden_state).abs().max() > 1e-3


def test_legacy_length_1024_train_plan(tmp_path):
    """transformers draws the random blocks of padded length 1024 from the paper's old plan."""
    hf, ours = hf_and_ours(tmp_path, "hf-train", block_size=16, num_random_blocks=2, max_pos=1024)
    hf.train()
    ids, mask = batch(1, 1020)
    a = run_hf(hf, "block_sparse", input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :4])
    with torch.no_grad():
        b = ours(ids, mask, decoder_input_ids=ids[:, :4])
    assert (a.encoder_last_hidden_state - b.encoder_last_hidden_state).abs().max() <= TOL
    assert (a.logits - b.logits).abs().max() <= TOL


def test_labels_loss_and_decoder_mask_match_transformers(tmp_path):
    hf, ours = hf_and_ours(tmp_path, "hf-eval", attention_type="original_full")
    hf.eval()
    ids, mask = batch(2, 40, pad_last=5)
    labels, _ = batch(2, 6, seed=3)
    labels[1, 4:] = -100
    dec_mask = torch.ones_like(labels)
    dec_mask[1, 4:] = 0  # right padding
    dec_mask[0, :2] = 0  # left padding: the first query row sees nothing
    a = run_hf(hf, "original_full", input_ids=ids, attention_mask=mask, labels=labels, decoder_attention_mask=dec_mask)
    with torch.no_grad():
        b = ours(ids, mask, labels=labels, decoder_attention_mask=dec_mask)
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    assert (a.logits - b.logits).abs().max() <= TOL


def test_kv_cache_steps_equal_full_pass(tmp_path):
    _, ours = hf_and_ours(tmp_path, "hf-eval", block_size=16, num_random_blocks=1)
    ids, mask = batch(2, 150, pad_last=30)
    dec, _ = batch(2, 6, seed=4)
    with torch.no_grad():
        full = ours(ids, mask, decoder_input_ids=dec)
        cross = ours.cross_attention_kv(full.encoder_last_hidden_state)
        past, steps = None, []
        # first two tokens at once, then one at a time
        for start, end in [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]:
            pos = torch.arange(start, end).expand(2, -1)
            logits, past = ours.decoder_step(dec[:, start:end], pos, torch.ones(2, end, dtype=torch.long), cross,
                                             mask, past)
            steps.append(logits)
    assert past[0][0].shape == (2, 2, 6, 8)  # (B, H, P+T, D)
    assert (torch.cat(steps, dim=1) - full.logits).abs().max() <= TOL


def test_decoder_step_mixes_sequences_of_different_ages(tmp_path):
    """Iteration-level batching: row 0 has 4 past tokens, row 1 has 2 (its cache is left-padded and
    masked); one step over both equals each row decoded on its own."""
    _, ours = hf_and_ours(tmp_path, "hf-eval", attention_type="original_full")
    ids, mask = batch(2, 30, pad_last=6)
    dec, _ = batch(2, 5, seed=5)
    lengths = [4, 2]
    with torch.no_grad():
        enc = ours.encode(ids, mask).last_hidden_state
        cross = ours.cross_attention_kv(enc)
        alone, pasts = [], []
        for b, n in enumerate(lengths):  # each row alone: prefill n tokens, then one step
            cross_b = [(k[b:b + 1], v[b:b + 1]) for k, v in cross]
            _, past = ours.decoder_step(dec[b:b + 1, :n], torch.arange(n)[None], torch.ones(1, n, dtype=torch.long),
                                        cross_b, mask[b:b + 1])
            logits, _ = ours.decoder_step(dec[b:b + 1, n:n + 1], torch.tensor([[n]]),
                                          torch.ones(1, n + 1, dtype=torch.long), cross_b, mask[b:b + 1], past)
            alone.append(logits)
            pasts.append(past)
        # both rows in one step: row 1's cache is left-padded with 2 garbage slots, masked out
        P = max(lengths)
        joint_past = []
        for layer in range(len(pasts[0])):
            ks, vs = [], []
            for b, n in enumerate(lengths):
                k, v = pasts[b][layer]
                junk = torch.randn(1, k.shape[1], P - n, k.shape[3])
                ks.append(torch.cat([junk, k], dim=2))
                vs.append(torch.cat([junk, v], dim=2))
            joint_past.append((torch.cat(ks), torch.cat(vs)))
        self_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
        tokens = torch.stack([dec[b, n] for b, n in enumerate(lengths)])[:, None]
        joint, present = ours.decoder_step(tokens, torch.tensor([[4], [2]]), self_mask, cross, mask, joint_past)
    assert present[0][0].shape[2] == P + 1
    assert (joint - torch.cat(alone)).abs().max() <= TOL


def test_save_pretrained_round_trips_through_transformers(tmp_path):
    _, ours = hf_and_ours(tmp_path, "hf-eval", block_size=16, num_random_blocks=1)
    save_pretrained(ours, tmp_path / "ours")
    back = transformers.BigBirdPegasusForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    ids, mask = batch(2, 130, pad_last=10)
    a = run_hf(back, "block_sparse", input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5])
    with torch.no_grad():
        b = ours(ids, mask, decoder_input_ids=ids[:, :5])
    assert (a.logits - b.logits).abs().max() <= TOL


def test_config_round_trip_keeps_unknown_keys():
    d = transformers.BigBirdPegasusConfig(d_model=16, encoder_attention_heads=2).to_dict()
    d["num_beams"] = 5
    d["some_future_field"] = [1, 2]
    cfg = BigBirdPegasusConfig.from_dict(d)
    assert cfg.num_beams == 5 and cfg.d_model == 16
    out = cfg.to_dict()
    assert out["some_future_field"] == [1, 2] and out["model_type"] == "bigbird_pegasus"
    with pytest.raises(ValueError, match="model_type"):
        BigBirdPegasusConfig.from_dict({**d, "model_type": "big_bird"})


def test_untied_embeddings_are_four_tables_as_in_transformers(tmp_path):
    """tie_word_embeddings=False: transformers 5 keeps shared, the encoder's and the decoder's
    embed_tokens and lm_head as four tables; the stacks use their own. Loading the shared table
    into all three (one tensor under three names) changes the logits."""
    hf, ours = hf_and_ours(tmp_path, "hf-eval", attention_type="original_full", tie_word_embeddings=False)
    hf.eval()
    assert hf.model.encoder.embed_tokens.weight is not hf.model.shared.weight
    assert ours.model.encoder.embed_tokens is not ours.model.decoder.embed_tokens
    assert ours.lm_head.weight is not ours.model.shared.weight
    ids, mask = batch(2, 40, pad_last=5)
    dec, _ = batch(2, 6, seed=2)
    a = run_hf(hf, "original_full", input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    with torch.no_grad():
        b = ours(ids, mask, decoder_input_ids=dec)
    assert (a.encoder_last_hidden_state - b.encoder_last_hidden_state).abs().max() <= TOL
    assert (a.logits - b.logits).abs().max() <= TOL
    # and back: transformers reads what we write
    save_pretrained(ours, tmp_path / "ours")
    back = transformers.BigBirdPegasusForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    c = run_hf(back, "original_full", input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    assert (c.logits - b.logits).abs().max() <= TOL


def test_input_longer_than_the_position_table_is_refused(tmp_path):
    """Real tokens beyond max_position_embeddings have no position (transformers fails on the
    lookup); the encoder must not silently give them the last position."""
    _, ours = hf_and_ours(tmp_path, "hf-eval", block_size=16, num_random_blocks=1, max_pos=128)
    ids, mask = batch(1, 128)
    with torch.no_grad():
        ours.encode(ids, mask)  # exactly the table: fine
        with pytest.raises(ValueError, match="position table"):
            ours.encode(*batch(1, 129))
        with pytest.raises(ValueError, match="position table"):
            # the 129th token is fed at position 128, past the table
            ours.generate(ids[:, :20], max_new_tokens=129, min_length=200)
        # the 128th new token is computed from position 127, the table's last
        assert ours.generate(ids[:, :20], max_new_tokens=128, min_length=200).shape[1] == 129
