"""bench/head_to_head.py and bench/hf_pipeline_app.py: the parts whose mistakes would make the
head-to-head compare different things (windows, span choice, answer comparison), not timings."""

from pathlib import Path

import numpy as np
import pytest

from tests.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    return load_bench(name)


h2h = _load("head_to_head")
app = _load("hf_pipeline_app")


def _pipeline_probs(logits, allowed, cls_index=0):
    """transformers' QA pipeline per window: -10000 outside allowed, softmax, [CLS] zeroed."""
    x = np.where(allowed, logits, -10000.0)
    p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    p[cls_index] = 0.0
    return p


@pytest.mark.parametrize("seed", range(20))
def test_best_window_span_is_the_best_allowed_span(seed):
    rng = np.random.default_rng(seed)
    S, max_len = 40, 4
    start, end = rng.normal(0, 3, S), rng.normal(0, 3, S)
    context = np.zeros(S, bool)
    context[7:39] = True  # [CLS] q... [SEP] context [SEP]
    allowed = context.copy()
    allowed[0] = True
    ps, pe = _pipeline_probs(start, allowed), _pipeline_probs(end, allowed)
    brute = max((ps[s] * pe[e], s, e) for s in range(S) for e in range(s, min(S, s + max_len))
                if context[s] and context[e])
    s, e, score = app.best_window_span(start, end, context, 0, max_len)
    assert (s, e) == brute[1:] and score == pytest.approx(brute[0])
    assert 0 <= e - s < max_len


def test_pipeline_windows_are_the_services_windows():
    """doc_stride = half the context room gives exactly longdoc.export.windows.qa_windows' windows."""
    import tokenizers

    from longdoc.export.windows import qa_windows

    tokenizer = app.load_tokenizer(ROOT / "models/qa")
    raw = tokenizers.Tokenizer.from_file(str(ROOT / "models/qa/tokenizer.json"))
    question = "What does the -r option do?"
    document = " ".join(f"word{i} runs, quickly" for i in range(120))
    for max_seq_len in (64, 97, 200):
        enc = app.windows(tokenizer, question, document, max_seq_len)
        ours = qa_windows(raw.encode(question, add_special_tokens=False).ids,
                          raw.encode(document, add_special_tokens=False).ids, max_seq_len, None,
                          raw.token_to_id("[CLS]"), raw.token_to_id("[SEP]"))
        assert len(ours) > 2
        assert [tuple(x) for x in enc["input_ids"]] == [w.input_ids for w in ours]
        assert [tuple(x) for x in enc["token_type_ids"]] == [w.token_type_ids for w in ours]


def test_one_window_answers_agree_with_the_service(tmp_path):
    """A tiny transformers checkpoint: the app (transformers) and the service's span search on the
    export (longdoc.export.evaluate.qa_spans, fp32, plan hf-eval) pick the same characters on one-window
    documents, where the two rankings (per-window probabilities vs logits) cannot differ."""
    from fastapi.testclient import TestClient

    from longdoc.export.evaluate import qa_spans
    from longdoc.export.runtime import OnnxModel
    from longdoc.testing.tiny_models import TINY_WORDS, make_tiny_checkpoint, make_tiny_export

    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "qa", source="transformers")
    model = OnnxModel(make_tiny_export(tmp_path / "fp32", "qa", checkpoint_dir=checkpoint, plan="hf-eval"), threads=1)
    client = TestClient(app.create_app(checkpoint, model.manifest.max_length))
    words = [w for w in TINY_WORDS if w.isalpha()]
    rng = np.random.default_rng(0)
    for n in (200, 300, 450):  # past the full-attention threshold: block-sparse on both sides
        document = " ".join(words[i] for i in rng.integers(0, len(words), n))
        question = " ".join(words[:5])
        spans, n_windows = qa_spans(model, question, document, model.manifest.max_length, 30)
        r = client.post("/qa", json={"question": question, "document": document, "max_answer_len": 30})
        assert r.status_code == 200 and r.json()["windows"] == n_windows == 1
        answer = r.json()["answer"]
        assert (answer["start"], answer["end"]) == (spans[0].start, spans[0].end)


def test_same_answer_fraction():
    ours = {"a": ((1, 5), 1), "b": ((2, 3), 2), "c": (None, 1), "d": ((0, 1), 1)}
    theirs = {"a": ((1, 5), 1), "b": ((2, 4), 2), "c": (None, 1), "e": ((0, 1), 1)}
    assert h2h.same_answer_fraction(ours, theirs) == (2 / 3, 3)
    assert np.isnan(h2h.same_answer_fraction(ours, {})[0])


def test_latency_stats():
    stats = h2h.latency_stats([1.0, 2.0, 3.0, 4.0], wall_s=8.0)
    assert stats["throughput_rps"] == 0.5 and stats["p50_s"] == 2.5
    assert stats["p99_s"] == pytest.approx(3.97)
    assert h2h.latency_stats([], 1.0)["throughput_rps"] == 0.0


def test_write_results_keeps_the_prose(tmp_path):
    doc = tmp_path / "h.md"
    doc.write_text(f"# T\n\nprose\n\n{h2h.RESULTS_BEGIN}\nold\n{h2h.RESULTS_END}\n\nmore prose\n")
    h2h.write_results(doc, "| new |")
    assert doc.read_text() == f"# T\n\nprose\n\n{h2h.RESULTS_BEGIN}\n| new |\n{h2h.RESULTS_END}\n\nmore prose\n"
    doc.write_text("no markers")
    with pytest.raises(SystemExit):
        h2h.write_results(doc, "x")
