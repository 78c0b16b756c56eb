"""A Longformer and a ModernBERT brought as one's own checkpoint (README, "Bringing your own
checkpoint"; issue 28, "Served"): tiny question-answering and classification checkpoints (ModernBERT's
with mean pooling) saved by transformers, exported and verified by the `longdoc export` / `longdoc
verify` commands, served by a real `longdoc serve` subprocess through the unchanged /v1/qa and
/v1/classify endpoints: the manifest carries everything (Longformer's window and global tokens,
ModernBERT's per-layer band / dense attention, block size, lengths), the service asks no
architecture question.

The answers are checked against the same export run offline one window at a time (what batching
and padding must not change) and, for one window, against transformers itself (for Longformer with
the question as its global tokens: what the manifest's `global_tokens` must give)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
import torch

from longdoc.export.evaluate import qa_spans, read_qa_windows
from longdoc.export.windows import pool_logits
from longdoc.testing.tiny_models import CLASSIFY_LABELS, make_tiny_longformer, make_tiny_modernbert
from tests.service.conftest import ServeProcess
from tests.service.test_e2e import text_of


@dataclass(frozen=True)
class Family:
    make: object  # tiny_models' builder: (directory, task, **config overrides) -> checkpoint
    hf_prefix: str  # transformers' class names: PREFIXForQuestionAnswering, PREFIXForSequenceClassification
    classify_config: dict = field(default_factory=dict)
    verify: tuple[str, ...] = ()  # `longdoc verify` options
    question_is_global: bool = False  # transformers is given the question as global tokens


FAMILIES = {
    "longformer": Family(make_tiny_longformer, "Longformer", question_is_global=True),
    "modernbert": Family(make_tiny_modernbert, "ModernBert", {"classifier_pooling": "mean"},
                         ("--against", "transformers", "--lengths", "7,37,100,512")),
}


def longdoc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longdoc", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    family = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(f"{request.param}-serve")
    dirs = {}
    for task, overrides in (("qa", {}), ("classify", family.classify_config)):
        checkpoint = family.make(root / f"{task}-checkpoint", task, **overrides)
        out = root / "models" / f"my{task}"
        done = longdoc("export", str(checkpoint), str(out), "--task", task)
        assert done.returncode == 0, done.stderr
        done = longdoc("verify", str(out), "--checkpoint", str(checkpoint), *family.verify)
        assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
        dirs[task] = (checkpoint, out)
    args = ["--model", f"myqa={dirs['qa'][1]}", "--model", f"mycls={dirs['classify'][1]}", "--qa-stride", "100"]
    with ServeProcess(args, root / "serve.log") as server:  # with warm-up: a QA window with no question
        yield server, dirs, family


def offline(directory):
    from longdoc.export.runtime import OnnxModel

    return OnnxModel(directory, threads=1)


def test_models_are_listed_with_their_window(served):
    server, _, _ = served
    models = {m["name"]: m for m in httpx.get(server.url + "/v1/models").json()["models"]}
    assert models["myqa"]["block_size"] == 8 and models["myqa"]["max_length"] == 512
    assert models["mycls"]["labels"] == CLASSIFY_LABELS


def test_qa_matches_offline_and_transformers(served):
    server, dirs, family = served
    question = "where is the gold"
    docs = [text_of(1300, seed=1), text_of(120, seed=2)]  # several windows + one
    r = httpx.post(server.url + "/v1/qa", json={"model": "myqa", "question": question, "documents": docs,
                                                "top_k": 3}, timeout=120)
    assert r.status_code == 200, r.text
    model = offline(dirs["qa"][1])
    for doc, result in zip(docs, r.json()["results"]):
        expected, n_windows = qa_spans(model, question, doc, 512, 30, stride=100, top_k=3)
        assert result["usage"]["windows"] == n_windows
        assert result["answers"] and [(a["start"], a["end"]) for a in result["answers"]] == [
            (s.start, s.end) for s in expected]
        assert np.allclose([a["score"] for a in result["answers"]], [s.score for s in expected], atol=1e-4)
    assert r.json()["results"][0]["usage"]["windows"] > 3 and n_windows == 1

    import transformers

    windows, starts, ends, _ = read_qa_windows(model, question, docs[1], 512, stride=100)
    ids = torch.tensor([windows[0].input_ids])
    inputs = {"input_ids": ids}
    if family.question_is_global:
        inputs["global_attention_mask"] = torch.zeros_like(ids)
        inputs["global_attention_mask"][0, : windows[0].offset - 1] = 1  # [CLS] question; the separator stays local
    hf = getattr(transformers, f"{family.hf_prefix}ForQuestionAnswering").from_pretrained(str(dirs["qa"][0])).eval()
    with torch.no_grad():
        want = hf(**inputs)
    assert np.abs(starts[0] - want.start_logits[0].numpy()).max() < 1e-4
    assert np.abs(ends[0] - want.end_logits[0].numpy()).max() < 1e-4


def test_classification_matches_offline_and_transformers(served):
    server, dirs, family = served
    doc = text_of(1100, seed=3)
    r = httpx.post(server.url + "/v1/classify", json={"model": "mycls", "document": doc}, timeout=120)
    assert r.status_code == 200, r.text
    model = offline(dirs["classify"][1])
    ids = model.tokenizer.encode(doc, add_special_tokens=False).ids
    cls, sep = model.manifest.special_tokens["cls"], model.manifest.special_tokens["sep"]
    windows = [[cls, *ids[a : a + 510], sep] for a in range(0, len(ids), 510)]
    logits = [model.run_encoder(np.array([w]))["logits"][0] for w in windows]
    got = {x["label"]: x["score"] for x in r.json()["results"][0]["labels"]}
    assert r.json()["results"][0]["usage"]["windows"] == 3
    assert np.allclose([got[k] for k in CLASSIFY_LABELS], pool_logits(logits), atol=1e-5)

    import transformers

    hf = getattr(transformers, f"{family.hf_prefix}ForSequenceClassification").from_pretrained(
        str(dirs["classify"][0])).eval()
    with torch.no_grad():  # Longformer: transformers' default global token, the first
        want = hf(input_ids=torch.tensor([windows[-1]])).logits[0].numpy()
    assert np.abs(logits[-1] - want).max() < 1e-4
