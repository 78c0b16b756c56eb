"""Evaluate an exported model directory on a held-out JSONL file, through ONNX Runtime
(`longdoc.export.runtime.OnnxModel`: what users get), beside simple baselines. No torch.

    longdoc eval models/qa --data data/cache/manpages/qa_test.jsonl
    longdoc eval models/summarize --data data/cache/manpages/summarize_test.jsonl
    longdoc eval --baselines-only --task summarize --data data/cache/manpages/summarize_test.jsonl

QA (records {"question", "context", "answers": [{"text", "start"}]}):
    exact match and F1 with SQuAD's normalisation (lower case, no punctuation, no articles
    a/an/the, single spaces), the max over the gold answers. The model reads the page as the
    service does: every window (`[CLS] question [SEP] context[a:b] [SEP]`, the service's default
    stride) and the best span over all of them (start <= end, at most `max_answer_tokens`),
    mapped back to characters. Beside it: the same model's first window alone, and its first
    512-token window. Reported overall and on the answers that lie beyond token 512 (the
    answer's last token at index >= 512 of `[CLS] question [SEP] context`).
Summarization (records {"document", "summary"}):
    ROUGE-1/2/L F1 by the `rouge-score` package with its Porter stemmer (what the literature
    reports; ROUGE-L on the longest common subsequence of the whole text, not rougeLsum), the
    fraction of distinct outputs and the fraction that repeat a word 3 times or more. Baselines:
    "lead", the document's first sentence (heading lines skipped), and "lead-description", the
    first sentence of its DESCRIPTION section (of the document where there is none).
Classification (records {"text", "label"}): accuracy, beside the majority-label baseline. The
    model reads the text as the service does: every window (`[CLS] text[a:b] [SEP]`, the
    service's default stride), their logits averaged, then the most probable label.
"""

from __future__ import annotations

import collections
import functools
import re
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BASELINE_QA_LENGTH = 512
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]?(?=\s|$)")


# ----------------------------------------------------------------------------- QA metrics


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower, drop punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token-overlap F1 of the normalised texts (SQuAD): bag-of-tokens precision and recall."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_over_golds(metric, prediction: str, golds: list[str]) -> float:
    return max((metric(prediction, g) for g in golds), default=0.0)


# ----------------------------------------------------------------------------- ROUGE

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@functools.lru_cache(maxsize=1)
def _rouge_scorer():
    """Google's `rouge-score` (the implementation the summarization literature reports), with the
    Porter stemmer: lower-cased runs of [a-z0-9], stemmed; ROUGE-L on the whole text's longest common
    subsequence (not rougeLsum)."""
    from rouge_score import rouge_scorer  # longdoc[torch]

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F1 of one prediction against one reference (rouge-score, stemmed)."""
    scores = _rouge_scorer().score(reference, prediction)  # score(target, prediction)
    return {name: float(scores[name].fmeasure) for name in ROUGE_TYPES}


def repeats_a_word(text: str, times: int = 3) -> bool:
    """A summary that holds one word `times` times or more ("linux ip protocol protocol protocol")."""
    counts = collections.Counter(re.findall(r"[a-z0-9]+", text.lower()))
    return bool(counts) and max(counts.values()) >= times


# ----------------------------------------------------------------------------- lead baselines


def first_sentence(text: str) -> str:
    """The first sentence of a text whose heading lines (at column 0) are dropped."""
    body = " ".join(line.strip() for line in text.splitlines() if line.startswith((" ", "\t")) and line.strip())
    m = _SENTENCE_END.search(body)
    return body[: m.end()] if m else body


def lead(document: str) -> str:
    return first_sentence(document)


def lead_description(document: str) -> str:
    """First sentence of the DESCRIPTION section (man pages), else of the document."""
    m = re.search(r"^DESCRIPTION\n", document, re.M)
    return first_sentence(document[m.end() :] if m else document)


# ----------------------------------------------------------------------------- QA decoding


def answer_token_index(offsets, start: int, end: int) -> int:
    """Index among the context's tokens (offsets: their character spans) of the last token of
    context[start:end]; the number of tokens when it covers none."""
    from longdoc.model.tokenization import TokenOffsets

    tokens = TokenOffsets(offsets)
    span = tokens.token_span(start, end)
    return span[1] if span is not None else len(tokens)


def read_qa_windows(model, question: str, context: str, max_length: int, stride: int | None = None,
                    max_windows: int | None = None):
    """(windows, start logits, end logits, token offsets) of a page read as the service reads it
    (`longdoc.export.windows.qa_windows`: `[CLS] question [SEP] doc[a:b] [SEP]`), one window at a time
    through ONNX Runtime; only the first `max_windows` windows when given."""
    from longdoc.export.windows import qa_windows

    sp = model.manifest.special_tokens
    q = model.tokenizer.encode(question, add_special_tokens=False).ids
    doc = model.tokenizer.encode(context, add_special_tokens=False)
    windows = qa_windows(q, doc.ids, max_length, stride, sp["cls"], sp["sep"])[:max_windows]
    starts, ends = [], []
    for w in windows:
        out = model.run_encoder(np.array([w.input_ids]), np.ones((1, len(w.input_ids)), np.int64),
                                np.array([w.token_type_ids]))
        starts.append(out["start_logits"][0])
        ends.append(out["end_logits"][0])
    return windows, starts, ends, doc.offsets


def qa_spans(model, question: str, context: str, max_length: int, max_answer_tokens: int,
             stride: int | None = None, top_k: int = 1):
    """(the top_k answer spans, the number of windows read) as the service finds them: its
    windows and its span search (`longdoc.export.windows.best_spans`)."""
    from longdoc.export.windows import best_spans

    windows, starts, ends, offsets = read_qa_windows(model, question, context, max_length, stride)
    return best_spans(windows, starts, ends, offsets, top_k, max_answer_tokens), len(windows)


# ----------------------------------------------------------------------------- evaluation


@dataclass
class Report:
    task: str
    model: str | None
    data: str
    examples: int
    rows: list[dict] = field(default_factory=list)  # {"system", "subset", "n", metric: value}
    seconds: float = 0.0

    def table(self) -> str:
        metrics = [k for k in self.rows[0] if k not in ("system", "subset", "n")] if self.rows else []
        head = "| system | subset | n | " + " | ".join(metrics) + " |"
        lines = [head, "|" + "---|" * (3 + len(metrics))]
        for r in self.rows:
            vals = " | ".join(f"{100 * r[m]:.1f}" for m in metrics)
            lines.append(f"| {r['system']} | {r['subset']} | {r['n']} | {vals} |")
        return "\n".join(lines)


def read_records(path: str | Path, limit: int | None = None, task: str | None = None) -> list[dict]:
    """The records of a JSONL file (`longdoc.model.data.read_jsonl`: a bad line is named by file
    and line, with the task's fields checked when `task` is given); with `limit`, that many evenly
    spaced ones, so every part of the file is represented."""
    from longdoc.model.data import read_jsonl

    records = [r.fields for r in read_jsonl(path, task)]
    if limit and limit < len(records):
        step = len(records) / limit
        records = [records[int(i * step)] for i in range(limit)]
    return records


def _mean_rows(system: str, subsets: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for subset, items in subsets.items():
        if not items:
            continue
        row = {"system": system, "subset": subset, "n": len(items)}
        for key in items[0]:
            row[key] = float(np.mean([it[key] for it in items]))
        rows.append(row)
    return rows


def evaluate_qa(model, records: list[dict], max_answer_tokens: int = 128, progress=None,
                stride: int | None = None) -> tuple[list[dict], list[dict]]:
    """(report rows, per-record predictions) for three systems, all through the service's windows
    and span search (`qa_spans`): "model", every window of the page (what the service answers);
    "first-window", only the first max_length-token window; "first-512", only the first 512-token
    window. Subsets: answers whose last token lies beyond the 512-token window's document part."""
    from longdoc.export.windows import best_spans

    tok, max_length = model.tokenizer, model.manifest.max_length
    short = min(BASELINE_QA_LENGTH, max_length)
    systems = ("model", "first-window", f"first-{BASELINE_QA_LENGTH}")
    scores = {name: {"all": [], "beyond-512": [], "within-512": []} for name in systems}
    predictions = []
    for n, r in enumerate(records):
        golds = [a["text"] for a in r["answers"]]
        a = r["answers"][0]
        windows, starts, ends, offsets = read_qa_windows(model, r["question"], r["context"], max_length, stride)
        last = answer_token_index(offsets, a["start"], a["start"] + len(a["text"]))
        q_len = len(tok.encode(r["question"], add_special_tokens=False).ids)
        subset = "beyond-512" if q_len + 2 + last >= BASELINE_QA_LENGTH else "within-512"
        pred_row = {"id": r.get("id", n), "answer_token": last}
        short_read = read_qa_windows(model, r["question"], r["context"], short, stride, max_windows=1)
        reads = {"model": (windows, starts, ends, offsets),  # every window: the service's answer
                 "first-window": (windows[:1], starts[:1], ends[:1], offsets),  # the same first window
                 f"first-{BASELINE_QA_LENGTH}": short_read}
        for name, read in reads.items():
            spans = best_spans(*read, 1, max_answer_tokens)
            text = r["context"][spans[0].start : spans[0].end] if spans else ""
            m = {"exact_match": best_over_golds(exact_match, text, golds), "f1": best_over_golds(f1_score, text, golds)}
            scores[name]["all"].append(m)
            scores[name][subset].append(m)
            pred_row[name] = text
        predictions.append(pred_row)
        if progress:
            progress(n + 1, len(records))
    rows = []
    for name in systems:
        rows += _mean_rows(name, scores[name])
    return rows, predictions


def evaluate_summarize(model, records: list[dict], max_new_tokens: int = 32, num_beams: int | None = None,
                       progress=None) -> tuple[list[dict], list[dict]]:
    """(report rows, per-record predictions): the model through the service's input window, search
    settings and output tokens, beside the lead baselines. Subsets: "all" and, with a model,
    "beyond-window": the pages longer than its one encoder window (cut, as the service cuts them).
    Each row also gives `distinct`, the fraction of distinct outputs (a model that writes one
    sentence for every page has ROUGE but no reading), and `repeat3`, the fraction of outputs that
    hold one word three times or more."""
    from longdoc.export.generation import generate, generated_tokens, settings_for
    from longdoc.export.windows import summarize_window
    from longdoc.model.tokenization import summary_text

    systems = {"lead": lead, "lead-description": lead_description}
    names = [name for name in ["model", *systems] if name != "model" or model is not None]
    scores = {name: {"all": [], "beyond-window": []} for name in names}
    texts = {name: {"all": [], "beyond-window": []} for name in names}
    predictions = []
    for n, r in enumerate(records):
        row = {"id": r.get("id", n)}
        outputs = {name: fn(r["document"]) for name, fn in systems.items()}
        subsets = ["all"]
        if model is not None:
            # the service's input window, search settings and output tokens
            tok, special = model.tokenizer, model.manifest.special_tokens
            doc = tok.encode(r["document"], add_special_tokens=False).ids
            ids, cut = summarize_window(doc, model.manifest.max_length, special, model.manifest.summarize_input)
            settings = settings_for(model.manifest, max_new_tokens=max_new_tokens, num_beams=num_beams)
            out = generate(model, np.array([ids]), np.ones((1, len(ids)), np.int64), settings=settings)[0]
            outputs = {"model": summary_text(tok, generated_tokens(out, settings)), **outputs}
            row["document_tokens"] = len(doc)
            if cut:
                subsets.append("beyond-window")
        for name, text in outputs.items():
            for subset in subsets:
                scores[name][subset].append(rouge_scores(text, r["summary"]))
                texts[name][subset].append(text)
            row[name] = text
        predictions.append(row)
        if progress:
            progress(n + 1, len(records))
    rows = []
    for name in names:
        for row in _mean_rows(name, scores[name]):
            outputs = texts[name][row["subset"]]
            rows.append({**row, "distinct": len(set(outputs)) / len(outputs),
                         "repeat3": sum(map(repeats_a_word, outputs)) / len(outputs)})
    return rows, predictions


def classify_probs(model, text: str, stride: int | None = None) -> tuple[np.ndarray, int]:
    """(label probabilities, the number of windows read) of a document as the service answers it:
    its windows (`longdoc.export.windows.classify_windows`; stride None is the service's default
    `classify_stride`, a whole window), each run alone through ONNX Runtime, then their logits
    pooled (`longdoc.export.windows.pool_logits`)."""
    from longdoc.export.windows import classify_windows, pool_logits

    sp = model.manifest.special_tokens
    ids = model.tokenizer.encode(text, add_special_tokens=False).ids
    windows = classify_windows(ids, model.manifest.max_length, stride, sp["cls"], sp["sep"])
    logits = [model.run_encoder(np.array([w]), np.ones((1, len(w)), np.int64))["logits"][0] for w in windows]
    return pool_logits(logits), len(windows)


def evaluate_classify(model, records: list[dict], progress=None, stride: int | None = None
                      ) -> tuple[list[dict], list[dict]]:
    """(report rows, per-record predictions): the model's label as the service answers it (every
    window of the text, `classify_probs`), beside the majority label."""
    labels = [str(r["label"]) for r in records]
    majority = collections.Counter(labels).most_common(1)[0][0]
    items, base, predictions = [], [], []
    for n, r in enumerate(records):
        if model is not None:
            probs, n_windows = classify_probs(model, r["text"], stride)
            names = model.manifest.labels or [f"LABEL_{i}" for i in range(len(probs))]  # the service's names
            pred = names[int(np.argmax(probs))]  # the service's first label (ties: the lower index)
            items.append({"accuracy": float(pred == str(r["label"]))})
            predictions.append({"id": r.get("id", n), "model": pred, "windows": n_windows})
        base.append({"accuracy": float(majority == str(r["label"]))})
        if progress:
            progress(n + 1, len(records))
    rows = _mean_rows("model", {"all": items}) if items else []
    return rows + _mean_rows(f"majority ({majority})", {"all": base}), predictions


def evaluate(model_dir: str | Path | None, data: str | Path, task: str | None = None, limit: int | None = None,
             threads: int | None = None, max_new_tokens: int = 32, num_beams: int | None = None,
             max_answer_tokens: int = 128, quiet: bool = False) -> tuple[Report, list[dict]]:
    model = None
    if model_dir is not None:
        from longdoc.export.runtime import OnnxModel

        model = OnnxModel(model_dir, threads=threads)
        if task is not None and task != model.manifest.task:
            raise ValueError(f"--task {task} but {model_dir} is a {model.manifest.task!r} model")
        task = model.manifest.task
    if task is None:
        raise ValueError("give a model directory or --task")
    records = read_records(data, limit, task)

    def progress(done, total):
        if not quiet and (done == total or done % 10 == 0):
            print(f"\r{task}: {done}/{total} examples", end="\n" if done == total else "", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    if task == "qa":
        if model is None:
            raise ValueError("QA has no model-free baseline here: give a model directory")
        rows, preds = evaluate_qa(model, records, max_answer_tokens, progress)
    elif task == "summarize":
        rows, preds = evaluate_summarize(model, records, max_new_tokens, num_beams, progress)
    elif task == "classify":
        rows, preds = evaluate_classify(model, records, progress)
    else:
        raise ValueError(f"no evaluation for task {task!r} (qa, summarize, classify)")
    report = Report(task, str(model_dir) if model_dir else None, str(data), len(records), rows,
                    time.perf_counter() - t0)
    return report, preds
