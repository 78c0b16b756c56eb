"""Window splitting, span merging across windows, offset mapping, pooling."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longdoc.export.windows import (best_spans, classify_windows, pool_logits, qa_room, qa_windows, summarize_window,
                                    window_spans)
from longdoc.testing.fake_worker import fake_tokenizer


def test_window_spans_examples():
    assert window_spans(0, 4, 2) == [(0, 0)]
    assert window_spans(4, 4, 2) == [(0, 4)]
    assert window_spans(5, 4, 2) == [(0, 4), (2, 5)]
    assert window_spans(10, 4, 4) == [(0, 4), (4, 8), (8, 10)]
    assert window_spans(5, 4, 100) == [(0, 4), (4, 5)]  # stride capped at the window: no gap


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), st.integers(1, 64), st.integers(1, 64))
def test_windows_cover_everything_and_overlap_by_window_minus_stride(n, window, stride):
    spans = window_spans(n, window, stride)
    covered = set()
    for a, b in spans:
        assert 0 <= a <= b <= n and b - a <= window
        covered |= set(range(a, b))
    assert covered == set(range(n)) and spans[-1][1] == n
    for (a1, b1), (a2, b2) in zip(spans, spans[1:]):
        assert a2 - a1 == min(stride, window) and a2 <= b1  # overlapping or adjacent, never a gap


def test_qa_windows_layout():
    ws = qa_windows([10, 11], list(range(100, 120)), max_length=12, stride=3, cls=2, sep=3)
    room = 12 - 2 - 3
    assert all(len(w.input_ids) <= 12 for w in ws)
    w = ws[1]
    assert w.input_ids[:4] == (2, 10, 11, 3) and w.input_ids[-1] == 3 and w.offset == 4
    assert w.input_ids[4 : 4 + room] == tuple(range(103, 103 + room))
    assert w.token_type_ids == (0,) * 4 + (1,) * (room + 1)
    assert ws[-1].doc_end == 20


def test_best_span_across_windows_maps_to_characters():
    text = "w1 w2 w3  gold  w4 w5 w6 w7"
    enc = fake_tokenizer().encode(text, add_special_tokens=False)
    ws = qa_windows([20], enc.ids, max_length=7, stride=2, cls=2, sep=3)  # 3 doc tokens per window
    gold = enc.ids.index(fake_tokenizer().token_to_id("gold"))
    starts, ends = [], []
    for w in ws:
        s = np.zeros(len(w.input_ids))
        e = np.zeros(len(w.input_ids))
        if w.doc_start <= gold < w.doc_end:
            s[w.offset + gold - w.doc_start] = 5.0
            e[w.offset + gold - w.doc_start + (1 if gold + 1 < w.doc_end else 0)] = 4.0
        s[0] = e[0] = 100.0  # [CLS] and the question are never answers
        s[1] = e[1] = 100.0
        starts.append(s)
        ends.append(e)
    spans = best_spans(ws, starts, ends, enc.offsets, top_k=1, max_answer_tokens=5)
    assert text[spans[0].start : spans[0].end] == "gold  w4"
    assert spans[0].score == 9.0


def test_best_spans_merges_duplicates_and_respects_max_answer_tokens():
    offsets = [(i * 3, i * 3 + 2) for i in range(6)]
    ws = qa_windows([], list(range(6)), max_length=7, stride=2, cls=2, sep=3)  # windows of 4, overlapping
    starts = [np.arange(len(w.input_ids), dtype=float) * 0 + 1 for w in ws]
    ends = [np.ones(len(w.input_ids)) for w in ws]
    spans = best_spans(ws, starts, ends, offsets, top_k=100, max_answer_tokens=2)
    keys = [(s.start, s.end) for s in spans]
    assert len(keys) == len(set(keys))  # one entry per character span
    assert all(s.token_end - s.token_start + 1 <= 2 for s in spans)
    assert len(spans) == 6 + 5  # every 1- and 2-token span of the 6 tokens


def test_classify_windows_and_mean_pooling():
    ws = classify_windows(list(range(10)), max_length=6, stride=None, cls=1, sep=2)
    assert [w[1:-1] for w in ws] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    p = pool_logits([np.array([2.0, 0.0]), np.array([0.0, 0.0])])
    assert np.allclose(p, np.exp([1, 0]) / np.exp([1, 0]).sum())


@pytest.mark.parametrize("seed", range(5))
def test_best_span_is_the_exact_best_when_the_best_starts_and_ends_lie_apart(seed):
    """Flat, noisy logits (a random-init model's): the best starts and the best ends are rarely
    within max_answer_tokens of each other, so the best valid span is not made of them. The
    answer must still be the best valid span (transformers' QA pipeline scores every pair)."""
    rng = np.random.default_rng(seed)
    n, max_answer = 3000, 30
    ws = qa_windows([7, 8], list(range(n)), max_length=n + 5, stride=None, cls=2, sep=3)  # one window
    s, e = rng.normal(0, 1, len(ws[0].input_ids)), rng.normal(0, 1, len(ws[0].input_ids))
    ds, de = s[ws[0].offset : ws[0].offset + n], e[ws[0].offset : ws[0].offset + n]
    # (n, max_answer) scores of span (i, i + j) by a sliding window; -inf past the end
    ends = np.arange(n)[:, None] + np.arange(max_answer)[None, :]
    exact = np.where(ends < n, ds[:, None] + de[np.minimum(ends, n - 1)], -np.inf)
    i, j = np.unravel_index(np.argmax(exact), exact.shape)
    offsets = [(3 * t, 3 * t + 2) for t in range(n)]
    top = best_spans(ws, [s], [e], offsets, top_k=3, max_answer_tokens=max_answer)
    assert (top[0].token_start, top[0].token_end) == (i, i + j)
    assert top[0].score == pytest.approx(exact[i, j])
    assert [sp.score for sp in top] == pytest.approx(sorted(exact.ravel(), reverse=True)[:3])


def test_summarize_window_follows_the_manifests_template():
    special = {"bos": 0, "eos": 2}
    doc = list(range(10, 20))
    assert summarize_window(doc, 8, special) == ([10, 11, 12, 13, 14, 15, 16, 2], True)
    assert summarize_window(doc, 8, special, "bos-doc-eos") == ([0, 10, 11, 12, 13, 14, 15, 2], True)
    assert summarize_window(doc[:6], 8, special, "bos-doc-eos") == ([0, *doc[:6], 2], False)
    assert summarize_window(doc[:3], 8, {"cls": 101, "eos": 102}, "cls-doc-eos") == ([101, *doc[:3], 102], False)


def test_manifest_refuses_a_bos_template_without_a_bos_id():
    from longdoc.export.manifest import Manifest, ManifestError

    fields = dict(task="summarize", architecture="LEDForConditionalGeneration", dtype="fp32",
                  graphs={"encoder": "encoder.onnx", "decoder": "decoder.onnx"}, attention={"pattern": "longformer"},
                  num_layers=1, num_heads=1, hidden_size=8, block_size=8, min_length=1, max_length=64,
                  full_attention_max_length=0, special_tokens={"pad": 1, "eos": 2, "decoder_start": 2, "bos": None},
                  decoder={"num_layers": 1, "num_heads": 1, "head_dim": 8, "max_positions": 16})
    with pytest.raises(ManifestError, match="bos-doc-eos' needs a bos id"):
        Manifest(**fields, summarize_input="bos-doc-eos")
    with pytest.raises(ManifestError, match="summarize_input 'bos' is not one of"):
        Manifest(**fields, summarize_input="bos")


def test_the_qa_window_template_is_one_function():
    """`[CLS] question [SEP] doc [SEP]`: qa_room (model/tokenization.py) sizes the document part of
    the service's windows, training's and data/qa_windows.py's; a full window is max_length tokens."""
    question, doc = [10, 11, 12], list(range(100, 200))
    assert qa_room(40, len(question)) == 40 - 3 - 3
    ws = qa_windows(question, doc, max_length=40, stride=None, cls=2, sep=3)
    assert ws[0].doc_end - ws[0].doc_start == qa_room(40, len(question))
    assert all(len(w.input_ids) == 40 for w in ws[:-1]) and len(ws[-1].input_ids) <= 40
    with pytest.raises(ValueError, match="no room"):
        qa_windows(list(range(37)), doc, max_length=40, stride=None, cls=2, sep=3)  # qa_room(40, 37) == 0
