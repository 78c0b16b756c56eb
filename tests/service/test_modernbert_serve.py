"""A ModernBERT brought as one's own checkpoint (issue 28, "Served"): tiny ModernBertForQuestionAnswering
and ModernBertForSequenceClassification (mean pooling) checkpoints saved by transformers, exported and
verified against transformers by the `longdoc export` / `longdoc verify` commands, served by a real
`longdoc serve` subprocess through the unchanged /v1/qa and /v1/classify endpoints: the manifest
carries everything (per-layer band / dense attention, block size, lengths), the service asks no
architecture question.

The answers are checked against the same export run offline one window at a time and, for one
window, against transformers itself."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from longdoc.export.evaluate import qa_spans, read_qa_windows
from longdoc.export.windows import pool_logits
from tests.service.conftest import ServeProcess
from tests.service.test_e2e import text_of
from longdoc.testing.tiny_models import CLASSIFY_LABELS, make_tiny_modernbert


def longdoc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longdoc", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("modernbert-serve")
    dirs = {}
    for task, overrides in (("qa", {}), ("classify", {"classifier_pooling": "mean"})):
        checkpoint = make_tiny_modernbert(root / f"{task}-checkpoint", task, **overrides)
        out = root / "models" / f"mb{task}"
        done = longdoc("export", str(checkpoint), str(out), "--task", task)
        assert done.returncode == 0, done.stderr
        done = longdoc("verify", str(out), "--checkpoint", str(checkpoint), "--against", "transformers",
                       "--lengths", "7,37,100,512")
        assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
        dirs[task] = (checkpoint, out)
    args = ["--model", f"mbqa={dirs['qa'][1]}", "--model", f"mbcls={dirs['classify'][1]}", "--qa-stride", "100"]
    with ServeProcess(args, root / "serve.log") as server:
        yield server, dirs


def offline(directory):
    from longdoc.export.runtime import OnnxModel

    return OnnxModel(directory, threads=1)


def test_models_are_listed(served):
    server, _ = served
    models = {m["name"]: m for m in httpx.get(server.url + "/v1/models").json()["models"]}
    assert models["mbqa"]["block_size"] == 8 and models["mbqa"]["max_length"] == 512
    assert models["mbcls"]["labels"] == CLASSIFY_LABELS


def test_qa_matches_offline_and_transformers(served):
    server, dirs = served
    question = "where is the gold"
    docs = [text_of(1300, seed=1), text_of(120, seed=2)]  # several windows + one
    r = httpx.post(server.url + "/v1/qa", json={"model": "mbqa", "question": question, "documents": docs,
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
    hf = transformers.ModernBertForQuestionAnswering.from_pretrained(str(dirs["qa"][0])).eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([windows[0].input_ids]))
    assert np.abs(starts[0] - want.start_logits[0].numpy()).max() < 1e-4
    assert np.abs(ends[0] - want.end_logits[0].numpy()).max() < 1e-4


def test_classification_matches_offline_and_transformers(served):
    server, dirs = served
    doc = text_of(1100, seed=3)
    r = httpx.post(server.url + "/v1/classify", json={"model": "mbcls", "document": doc}, timeout=120)
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

    hf = transformers.ModernBertForSequenceClassification.from_pretrained(str(dirs["classify"][0])).eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([windows[-1]])).logits[0].numpy()
    assert np.abs(logits[-1] - want).max() < 1e-4
