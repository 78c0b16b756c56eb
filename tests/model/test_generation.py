"""longdoc.model.generation: greedy and beam search give the same token ids as transformers' generate()."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from longdoc.model.checkpoint import load_pretrained  # noqa: E402
from longdoc.model.generation import SearchSettings, banned_ngram_tokens, beam_search  # noqa: E402

VOCAB, EOS, PAD, START = 60, 1, 0, 2


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, ours) with the same random weights; eos gets a logit bias so that
    hypotheses end at different lengths (otherwise every search just runs to max_new_tokens)."""
    torch.manual_seed(0)
    cfg = transformers.BigBirdPegasusConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=256,
        block_size=16, num_random_blocks=1, dropout=0.0, init_std=0.2,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=START, decoder_start_token_id=START)
    hf = transformers.BigBirdPegasusForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        hf.final_logits_bias[0, EOS] = 2.5
    d = tmp_path_factory.mktemp("pegasus")
    hf.save_pretrained(d)
    return hf, load_pretrained(d, plan="hf-eval")


def inputs(L, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, L), generator=g)
    mask = torch.ones_like(ids)
    ids[1, L - 25:] = PAD  # a padded row
    mask[1, L - 25:] = 0
    return ids, mask


def hf_generate(hf, ids, mask, **kw):
    hf.model.encoder.set_attention_type("block_sparse")  # undo transformers' sticky switch to full
    with torch.no_grad():
        return hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)


GREEDY = [dict(num_beams=1, no_repeat_ngram_size=n) for n in (0, 2, 3)]
BEAM = [dict(num_beams=nb, length_penalty=lp, no_repeat_ngram_size=n, early_stopping=es)
        for nb, lp, n, es in itertools.product((2, 3, 4), (0.6, 1.0, 2.0), (0, 2, 3), (False, True, "never"))]


@pytest.mark.parametrize("L", [60, 130])  # full attention / block-sparse encoder
def test_generate_matches_transformers(models, L):
    hf, ours = models
    ids, mask = inputs(L)
    ended_early = widths = 0
    seen_widths = set()
    for kw in GREEDY + BEAM:
        a = hf_generate(hf, ids, mask, max_new_tokens=12, **kw)
        b = ours.generate(ids, mask, max_new_tokens=12, **kw)
        assert b.dtype == torch.long
        assert b.tolist() == a.tolist(), kw
        ended_early += int((a[:, 1:] == EOS).any(dim=1).sum())
        seen_widths.add(a.shape[1])
        widths += 1
    # the settings exercised eos handling and outputs of several lengths
    assert ended_early > widths and len(seen_widths) >= 3


def test_min_length_and_forced_eos_match_transformers(models):
    hf, ours = models
    ids, mask = inputs(130, seed=3)
    for kw in [dict(num_beams=1, min_length=6), dict(num_beams=3, min_length=8, length_penalty=0.8),
               dict(num_beams=2, forced_eos_token_id=EOS), dict(num_beams=1, forced_eos_token_id=EOS)]:
        a = hf_generate(hf, ids, mask, max_new_tokens=10, **kw)
        b = ours.generate(ids, mask, max_new_tokens=10, **kw)
        assert b.tolist() == a.tolist(), kw
        if "min_length" in kw:  # eos never comes before min_length (decoder_start counts)
            assert not (b[:, 1:kw["min_length"]] == EOS).any()


def test_generate_output_layout(models):
    _, ours = models
    ids, mask = inputs(60)
    out = ours.generate(ids, mask, max_new_tokens=5, num_beams=1)
    assert out.shape[0] == 3 and 2 <= out.shape[1] <= 6
    assert (out[:, 0] == START).all()
    # after a row's eos only pad follows (greedy)
    for row in out.tolist():
        if EOS in row[1:]:
            i = row.index(EOS, 1)
            assert all(t == PAD for t in row[i + 1:])


def test_beam_search_on_a_known_distribution():
    """A hand-made next-token table: beam search must find the best finished sequence that greedy
    misses (greedy takes 'a' at p=.5, but 'b' then 'eos' has total .4*.9 > .5*.4)."""
    import math

    a, b, eos = 3, 4, EOS
    V = 6

    def table(seq):
        p = torch.full((V,), 1e-6)
        last = seq[-1]
        if last == START:
            p[a], p[b] = 0.5, 0.4
        elif last == a:
            p[eos], p[a] = 0.4, 0.3
        elif last == b:
            p[eos] = 0.9
        else:
            p[eos] = 1.0
        return torch.log(p / p.sum())

    def next_logits(seqs):
        return torch.stack([table(s) for s in seqs.tolist()])

    s = SearchSettings(max_length=6, num_beams=2, length_penalty=0.0, early_stopping=True,
                       eos_token_ids=(eos,), pad_token_id=PAD, decoder_start_token_id=START)
    out = beam_search(next_logits, lambda rows: None, 1, s)
    assert out.tolist() == [[START, b, eos]]
    assert math.log(0.4 * 0.9) > math.log(0.5 * 0.4)


def brute_force_banned(tokens, n):
    if len(tokens) < n:
        return set()
    seen = {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}
    prefix = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
    return {g[-1] for g in seen if g[:-1] == prefix}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=12), st.integers(1, 4))
def test_banned_ngrams_are_exactly_the_repeats(tokens, n):
    assert set(banned_ngram_tokens(tokens, n)) == brute_force_banned(tokens, n)
