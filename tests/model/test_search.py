"""longdoc.model.search, the one NumPy greedy / beam search: torch-free, `should_stop`, settings
resolution, and the two drivers' primitives (NumPy's vs torch's log_softmax / topk) agreeing
on well-separated scores. Parity with transformers is tests/model/test_generation.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
import pytest

from longdoc.model.search import GenerationStopped, SearchSettings, beam_search, greedy_search, resolve_settings

EOS, PAD, START, V = 1, 0, 2, 23


def table_decoder(seed: int):
    """next_logits for a fixed random next-token table keyed by the whole prefix (so reorder has
    nothing to do); eos gets a bias so hypotheses end at different lengths."""

    def next_logits(sequences: np.ndarray) -> np.ndarray:
        rows = []
        for row in sequences.tolist():
            g = np.random.default_rng([seed, *row])
            x = g.standard_normal(V).astype(np.float32) * 2
            x[EOS] += 1.0
            rows.append(x)
        return np.stack(rows)

    return next_logits


def settings(**kw) -> SearchSettings:
    return SearchSettings(**{**dict(max_length=9, eos_token_ids=(EOS,), pad_token_id=PAD,
                                    decoder_start_token_id=START), **kw})


def test_search_imports_without_torch():
    code = ("import sys, longdoc.model.search, longdoc.export.generation; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("num_beams", [1, 3])
def test_should_stop_is_checked_before_every_decoder_step(num_beams):
    next_logits = table_decoder(0)
    steps = []

    def counting(sequences):
        steps.append(sequences.shape[1])
        return next_logits(sequences)

    def run(should_stop=None):
        s = settings(num_beams=num_beams, max_length=12)
        if num_beams == 1:
            return greedy_search(counting, 2, s, should_stop)
        return beam_search(counting, lambda rows: None, 2, s, should_stop)

    plain = run()
    n_steps = len(steps)
    assert n_steps >= 3
    steps.clear()
    assert run(lambda: False).tolist() == plain.tolist()
    calls = []

    def stop_at_third():
        calls.append(len(steps))  # decoder steps taken before this check
        return len(calls) == 3

    steps.clear()
    with pytest.raises(GenerationStopped):
        run(stop_at_third)
    assert calls == [0, 1, 2] and len(steps) == 2


def test_resolve_settings_given_then_defaults_then_transformers():
    s = resolve_settings({"num_beams": 4, "length_penalty": None, "max_length": 30, "eos_token_id": [1, 5],
                          "forced_eos_token_id": 1, "decoder_start_token_id": 7},
                         num_beams=2, min_length=3)
    assert s == SearchSettings(max_length=30, num_beams=2, length_penalty=1.0, early_stopping=False,
                               no_repeat_ngram_size=0, min_length=3, eos_token_ids=(1, 5), pad_token_id=None,
                               decoder_start_token_id=7, forced_eos_token_ids=(1,))
    assert resolve_settings({}, max_new_tokens=5).max_length == 6
    assert resolve_settings({}) == SearchSettings(max_length=20)


def test_numpy_and_torch_primitives_agree_on_separated_scores():
    """The ONNX driver uses NumPy's log_softmax / topk, the PyTorch driver torch's: they differ
    only in the last bit and in tie order, so on these random tables (no near-ties) the tokens
    are the same, and the searches did run to different lengths."""
    torch = pytest.importorskip("torch")
    from longdoc.model import generation

    widths = set()
    for seed in range(4):
        next_logits = table_decoder(seed)
        for nb, lp, es, ng in [(2, 1.0, False, 0), (3, 0.6, True, 2), (4, 2.0, "never", 0), (3, 1.0, False, 3)]:
            s = settings(num_beams=nb, length_penalty=lp, early_stopping=es, no_repeat_ngram_size=ng)
            a = beam_search(next_logits, lambda rows: None, 3, s)
            b = generation.beam_search(lambda seq: torch.from_numpy(next_logits(seq.numpy())), lambda rows: None, 3, s)
            assert b.dtype == torch.long
            assert b.tolist() == a.tolist(), (seed, nb, lp, es, ng)
            widths.add(a.shape[1])
    assert len(widths) >= 2


def test_one_row_at_a_time_with_its_own_settings_equals_greedy_search():
    """The service's decoding batch steps each sequence alone, with its own length and settings
    (greedy_tokens on a (1, cur_len) row, is_finished), rows joining at different steps: the
    same tokens as greedy_search for each."""
    from longdoc.model.search import greedy_tokens, is_finished

    next_logits = table_decoder(5)
    variants = [settings(), settings(min_length=6), settings(forced_eos_token_ids=(EOS,), max_length=7),
                settings(no_repeat_ngram_size=1, max_length=12), settings(min_length=4, no_repeat_ngram_size=2)]
    rows, live, step = [], [], 0
    while live or step < len(variants):
        if step < len(variants):  # row `step` joins now
            rows.append([START])
            live.append(step)
        still = []
        for i in live:
            s = variants[i]
            tok = int(greedy_tokens(np.array([rows[i]]), next_logits(np.array([rows[i]])), s)[0])
            rows[i].append(tok)
            if not is_finished(len(rows[i]), tok, s):
                still.append(i)
        live, step = still, step + 1
    for row, s in zip(rows, variants):
        assert greedy_search(next_logits, 1, s)[0].tolist() == row, s
    assert len({len(r) for r in rows}) >= 3  # the settings made a difference
    assert rows[2][-1] == EOS and len(rows[2]) == 7  # forced at the last position


@given(st.integers(1, 3), st.integers(1, 40), st.integers(0, 2000), st.integers(2, 6), st.integers(0, 10**6))
def test_topk_is_the_head_of_a_stable_descending_sort(rows, k, m, levels, seed):
    """The partial top-k (a partition, then a sort of the entries at or above the k-th value) picks
    exactly what a full stable sort does, ties in index order included (few distinct values: many
    ties at the k-th), with -inf and NaN among them."""
    from longdoc.model.search import topk

    rng = np.random.default_rng(seed)
    x = rng.integers(0, levels, (rows, k + m)).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = -np.inf
    if seed % 7 == 0:
        x[0, rng.integers(0, x.shape[1])] = np.nan
    want_idx = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    values, idx = topk(x, k)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(values, np.take_along_axis(x, want_idx, axis=-1))


@given(st.lists(st.integers(0, 6), min_size=0, max_size=12), st.integers(0, 3), st.integers(0, 8),
       st.sampled_from([None, 4]), st.sampled_from([(), (EOS,), (EOS, 5)]), st.integers(0, 10**6))
def test_step_constraints_give_greedy_tokens_choice(tail, ngram, min_length, bos, forced_eos, seed):
    """The service's device greedy applies `step_constraints` (banned tokens, forced ones) instead
    of `process_scores`: their argmax is the same token for every row, setting and tie (logits
    drawn from a few values, so that maxima repeat)."""
    from longdoc.model.search import constrained_argmax, greedy_tokens, step_constraints

    row = [START, *tail]
    s = settings(no_repeat_ngram_size=ngram, min_length=min_length, forced_bos_token_id=bos,
                 forced_eos_token_ids=forced_eos, max_length=len(row) + np.random.default_rng(seed).integers(1, 3))
    logits = np.random.default_rng(seed).integers(-2, 3, V).astype(np.float32)
    want = int(greedy_tokens(np.array([row]), logits[None], s)[0])
    assert constrained_argmax(logits, step_constraints(row, s)) == want
