"""Metrics of `longdoc eval` on hand-computed examples, and the QA windowing/decoding logic
against a stand-in model that can only answer what it sees."""

import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from longdoc.export import evaluate as E


def test_squad_normalisation_and_scores():
    assert E.normalize_answer("The  Cat, sat!") == "cat sat"
    assert E.exact_match("the cat sat.", "Cat sat") == 1.0
    assert E.exact_match("cat sat down", "cat sat") == 0.0
    # pred {cat, sat, on, mat}, gold {cat, on, mat}: P = 3/4, R = 1
    assert E.f1_score("the cat sat on the mat", "cat on mat") == pytest.approx(6 / 7)
    assert E.f1_score("dog", "cat") == 0.0
    assert E.f1_score("a", "the") == 1.0  # both normalise to empty
    assert E.best_over_golds(E.f1_score, "cat", ["dog", "cat"]) == 1.0


def test_rouge_on_known_examples():
    """rouge-score's F1s, hand-computed: clipped n-gram overlap, LCS for ROUGE-L."""
    ref, pred = "the cat was under the bed", "the cat was found under the bed"
    scores = E.rouge_scores(pred, ref)
    assert scores["rouge1"] == pytest.approx(12 / 13)  # P 6/7, R 6/6
    assert scores["rouge2"] == pytest.approx(16 / 22)  # 4 of 6 and of 5 bigrams
    assert scores["rougeL"] == pytest.approx(12 / 13)  # LCS 6
    # LCS is order-aware where ROUGE-1 is not: "bed the under" vs "under the bed"
    swapped = E.rouge_scores("bed the under", "under the bed")
    assert swapped["rouge1"] == 1.0 and swapped["rougeL"] == pytest.approx(1 / 3)
    assert E.rouge_scores("", "x") == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    # lower-cased [a-z0-9] runs: punctuation and case do not count
    assert E.rouge_scores("Open() a FILE, v2!", "open a file v2")["rouge2"] == 1.0


def test_rouge_stems_as_the_literature_does():
    """Issue 27: ROUGE as rouge-score computes it with use_stemmer=True (the papers' figures); the
    former hand-written ROUGE did not stem and scored these 0."""
    assert E.rouge_scores("runs the listed files", "run the list file") == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert E.rouge_scores("manipulates sockets", "manipulate socket options")["rouge1"] == pytest.approx(0.8)


def test_repeats_a_word():
    assert E.repeats_a_word("linux ip protocol protocol protocol")
    assert E.repeats_a_word("The file, the FILE and the file")
    assert not E.repeats_a_word("get and set options on sockets and files")  # "and" twice
    assert not E.repeats_a_word("")


def test_lead_baselines_skip_headings():
    doc = "SYNOPSIS\n       int f(void);\n\nDESCRIPTION\n       f() frobs.  It also bars.\n"
    assert E.lead(doc) == "int f(void); f() frobs."
    assert E.lead_description(doc) == "f() frobs."


def word_tokenizer(words):
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


class OracleModel:
    """Scores the span of the gold answer's words highest, if the input reaches them."""

    def __init__(self, tokenizer, answer_ids, max_length):
        self.tokenizer, self.answer_ids = tokenizer, answer_ids
        self.manifest = SimpleNamespace(max_length=max_length, special_tokens={"cls": 2, "sep": 3, "pad": 0})
        self.lengths = []

    def run_encoder(self, input_ids, attention_mask, token_type_ids):
        ids = input_ids[0]
        self.lengths.append(len(ids))
        assert token_type_ids[0][0] == 0 and token_type_ids[0][-1] == 1
        start, end = np.zeros(len(ids)), np.zeros(len(ids))
        where = [i for i in range(len(ids)) if ids[i] in self.answer_ids]
        if where:
            start[where[0]], end[where[-1]] = 10.0, 10.0
        return {"start_logits": start[None], "end_logits": end[None]}


def test_qa_eval_reads_every_window_as_the_service_does():
    tok = word_tokenizer(["what", "does", "X", "do", "filler", "alpha", "beta", "gamma"])
    near = "filler " * 10 + "alpha beta . " + "filler " * 10
    far = "filler " * 900 + "alpha beta gamma . " + "filler " * 5
    past_window = "filler " * 1500 + "alpha beta . " + "filler " * 5  # beyond the first 1024-token window
    records = [
        {"id": "near", "question": "what does X do", "context": near, "answers": [{"text": "alpha beta", "start": near.index("alpha")}]},
        {"id": "far", "question": "what does X do", "context": far, "answers": [{"text": "alpha beta gamma", "start": far.index("alpha")}]},
        {"id": "past", "question": "what does X do", "context": past_window,
         "answers": [{"text": "alpha beta", "start": past_window.index("alpha")}]},
    ]
    model = OracleModel(tok, {tok.token_to_id(w) for w in ("alpha", "beta", "gamma")}, max_length=1024)
    rows, preds = E.evaluate_qa(model, records)
    by = {(r["system"], r["subset"]): r for r in rows}
    assert by[("model", "all")]["exact_match"] == 1.0
    assert by[("model", "beyond-512")]["n"] == 2 and by[("model", "beyond-512")]["f1"] == 1.0
    assert by[("first-window", "beyond-512")]["f1"] == 0.5  # the first window holds "far" only
    assert by[("first-512", "within-512")]["exact_match"] == 1.0
    assert by[("first-512", "beyond-512")]["f1"] == 0.0
    assert max(model.lengths) <= 1024 and 512 in model.lengths  # the baseline window is 512 tokens
    assert preds[1]["model"] == "alpha beta gamma" and preds[1]["answer_token"] >= 512


class VotingClassifier:
    """Logits (bad, good): how often each word occurs in the window; it labels what it sees."""

    def __init__(self, tokenizer, max_length):
        self.tokenizer = tokenizer
        self.manifest = SimpleNamespace(max_length=max_length, labels=["bad", "good"],
                                        special_tokens={"cls": 2, "sep": 3, "pad": 0})
        self.windows = []

    def run_encoder(self, input_ids, attention_mask):
        ids = list(input_ids[0])
        self.windows.append(ids)
        return {"logits": np.array([[ids.count(self.tokenizer.token_to_id(w)) for w in ("bad", "good")]], np.float32)}


def service_labels(model, texts):
    """What the service answers: its host path (service/host.py prepare_classify, with the stride the
    service's settings default to), every window run, the classify route's pooling and first label."""
    from longdoc.export.windows import pool_logits
    from longdoc.service.host import prepare_classify
    from longdoc.service.settings import Settings

    info = SimpleNamespace(tokenizer=model.tokenizer, max_length=model.manifest.max_length,
                           special_tokens=model.manifest.special_tokens)
    job = SimpleNamespace(common=SimpleNamespace(documents=texts))
    out = []
    for windows, _ in prepare_classify(info, job, Settings().classify_stride, 10**6):
        probs = pool_logits([model.run_encoder(w[None], np.ones((1, len(w)), np.int64))["logits"][0] for w in windows])
        out.append((model.manifest.labels[int(np.argmax(probs))], len(windows)))
    return out


def test_classify_eval_answers_what_the_service_answers_from_every_window():
    """Issue 26: eval scored the first window alone while the service averages every window's
    logits; on a text whose first window says "bad" and whose other windows say "good", eval
    answered "bad" and the service "good"."""
    tok = word_tokenizer(["bad", "good", "filler"])
    model = VotingClassifier(tok, max_length=66)  # 64 text tokens a window
    long_text = "bad " + "filler " * 63 + ("good filler " * 32) * 2 + "good"  # 4 windows, one "bad", 65 "good"
    records = [{"id": "long", "text": long_text, "label": "good"},
               {"id": "short", "text": "bad filler good bad", "label": "bad"}]
    rows, preds = E.evaluate_classify(model, records)
    assert [p["model"] for p in preds] == ["good", "bad"]
    assert [p["windows"] for p in preds] == [4, 1]
    assert [(p["model"], p["windows"]) for p in preds] == service_labels(model, [r["text"] for r in records])
    assert {r["system"]: r["accuracy"] for r in rows} == {"model": 1.0, "majority (good)": 0.5}
    assert all(len(w) <= 66 for w in model.windows)


def test_classify_eval_of_an_exported_model_is_the_service_path(tiny_classify_dir):
    """The tiny exported classifier through ONNX Runtime: eval's label and window count for texts of
    one to several windows are the service host path's."""
    from longdoc.export.runtime import OnnxModel
    from longdoc.testing.tiny_models import TINY_WORDS

    model = OnnxModel(tiny_classify_dir, threads=1)
    texts = [" ".join(TINY_WORDS[(n * 13 + i * 7) % 200] for i in range(words))
             for n, words in enumerate((5, 300, 2 * model.manifest.max_length, 3 * model.manifest.max_length + 9))]
    records = [{"id": n, "text": t, "label": "neutral"} for n, t in enumerate(texts)]
    _, preds = E.evaluate_classify(model, records)
    expected = service_labels(model, texts)
    assert [p["model"] for p in preds] == [label for label, _ in expected]
    assert [(p["model"], p["windows"]) for p in preds] == expected
    assert max(p["windows"] for p in preds) >= 3


def test_read_records_limit_is_evenly_spaced(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("".join(f'{{"i": {i}}}\n' for i in range(10)))
    assert [r["i"] for r in E.read_records(path, limit=5)] == [0, 2, 4, 6, 8]
    assert len(E.read_records(path)) == 10


def test_summarize_eval_reports_pages_beyond_the_window_and_distinct_outputs(tiny_summarize_dir):
    """Issue 14 asks for ROUGE on the pages longer than the encoder's window and the fraction of
    distinct summaries: the `beyond-window` subset holds exactly the pages the service cuts, and
    `distinct` counts the model's distinct outputs."""
    from longdoc.export.runtime import OnnxModel
    from longdoc.testing.tiny_models import TINY_WORDS

    model = OnnxModel(tiny_summarize_dir, threads=1)
    max_length = model.manifest.max_length
    records = [{"id": f"p{n}", "document": " ".join(TINY_WORDS[(n * 7 + i) % 200] for i in range(words)),
                "summary": " ".join(TINY_WORDS[n:n + 3])}
               for n, words in enumerate((20, 60, max_length + 50, 2 * max_length))]
    rows, preds = E.evaluate_summarize(model, records, max_new_tokens=6)
    by = {(r["system"], r["subset"]): r for r in rows}
    long_pages = [p for p in preds if p["document_tokens"] > max_length - 1]
    assert len(long_pages) == 2 and by[("model", "beyond-window")]["n"] == 2
    assert by[("model", "all")]["n"] == 4 and ("lead", "beyond-window") in by
    model_texts = [p["model"] for p in preds]
    assert by[("model", "all")]["distinct"] == len(set(model_texts)) / 4
    assert by[("model", "beyond-window")]["distinct"] == len({p["model"] for p in long_pages}) / 2
    assert by[("model", "all")]["repeat3"] == sum(map(E.repeats_a_word, model_texts)) / 4
    assert by[("model", "all")]["rouge1"] == sum(E.rouge_scores(t, r["summary"])["rouge1"]
                                                 for t, r in zip(model_texts, records)) / 4


def test_summarize_eval_uses_the_models_search_settings_by_default(tiny_summarize_dir, tmp_path):
    """`longdoc eval` scores what the service answers: with no --num-beams, the manifest's generation
    defaults (here num_beams 3) decide the search, not a greedy default of its own."""
    import shutil

    from longdoc.export.eval_cli import add_commands
    from longdoc.export.runtime import OnnxModel
    from longdoc.testing.tiny_models import TINY_WORDS

    model_dir = tmp_path / "beam3"
    shutil.copytree(tiny_summarize_dir, model_dir)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    manifest["decoder"]["generation"]["num_beams"] = 3
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    records = [{"id": f"p{n}", "document": " ".join(TINY_WORDS[(n * 11 + i) % 200] for i in range(30 + 9 * n)),
                "summary": " ".join(TINY_WORDS[n:n + 3])} for n in range(8)]
    data = tmp_path / "pages.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    model = OnnxModel(model_dir, threads=1)
    beam = [p["model"] for p in E.evaluate_summarize(model, records, max_new_tokens=6, num_beams=3)[1]]
    greedy = [p["model"] for p in E.evaluate_summarize(model, records, max_new_tokens=6, num_beams=1)[1]]
    assert beam != greedy  # the two searches differ on these pages, so the default is observable
    _, predictions = E.evaluate(model_dir, data, max_new_tokens=6, threads=1, quiet=True)
    assert [p["model"] for p in predictions] == beam
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["eval", str(model_dir), "--data", str(data)]).num_beams is None


def test_eval_data_is_read_by_the_one_reader_and_a_bad_record_is_named(tmp_path):
    """`longdoc eval` reads its file as training does (`longdoc.model.data.read_jsonl`): a record
    without the task's fields is refused with its file and line, before any model runs."""
    from longdoc.model.data import DataError

    path = tmp_path / "pages.jsonl"
    path.write_text('{"document": "a page.", "summary": "a"}\n\n{"document": "another page."}\n')
    with pytest.raises(DataError, match=r"pages.jsonl:3: missing field\(s\) 'summary' for task 'summarize'"):
        E.evaluate(None, path, task="summarize", quiet=True)
    path.write_text('\ufeff{"document": "a page. More.", "summary": "a page"}\n')  # a byte-order mark is fine
    report, _ = E.evaluate(None, path, task="summarize", quiet=True)
    assert report.examples == 1
