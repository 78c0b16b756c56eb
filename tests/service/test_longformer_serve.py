"""A Longformer brought as one's own checkpoint (README, "Bringing your own checkpoint"): tiny
LongformerForQuestionAnswering and LongformerForSequenceClassification checkpoints saved by
transformers, exported and verified by the `longdoc export` / `longdoc verify` commands, served by a
real `longdoc serve` subprocess through the unchanged /v1/qa and /v1/classify endpoints.

The answers are checked against the same export run offline one window at a time (what batching
and padding must not change) and, for one window, against transformers itself with the
question as its global tokens (what the manifest's `global_tokens` must give)."""

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
from longdoc.testing.tiny_models import CLASSIFY_LABELS, make_tiny_longformer


def longdoc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longdoc", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("longformer-serve")
    dirs = {}
    for task in ("qa", "classify"):
        checkpoint = make_tiny_longformer(root / f"{task}-checkpoint", task)
        out = root / "models" / f"my{task}"
        done = longdoc("export", str(checkpoint), str(out), "--task", task)
        assert done.returncode == 0, done.stderr
        done = longdoc("verify", str(out), "--checkpoint", str(checkpoint))
        assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
        dirs[task] = (checkpoint, out)
    args = ["--model", f"lqa={dirs['qa'][1]}", "--model", f"lcls={dirs['classify'][1]}", "--qa-stride", "100"]
    with ServeProcess(args, root / "serve.log") as server:  # with warm-up: a QA window with no question
        yield server, dirs


def offline(directory):
    from longdoc.export.runtime import OnnxModel

    return OnnxModel(directory, threads=1)


def test_models_are_listed_with_their_window(served):
    server, _ = served
    models = {m["name"]: m for m in httpx.get(server.url + "/v1/models").json()["models"]}
    assert models["lqa"]["block_size"] == 8 and models["lqa"]["max_length"] == 512
    assert models["lcls"]["labels"] == CLASSIFY_LABELS


def test_qa_matches_offline_and_transformers(served):
    server, dirs = served
    question = "where is the gold"
    docs = [text_of(1300, seed=1), text_of(120, seed=2)]  # several windows + one
    r = httpx.post(server.url + "/v1/qa", json={"model": "lqa", "question": question, "documents": docs,
                                                "top_k": 3}, timeout=120)
    assert r.status_code == 200, r.text
    model = offline(dirs["qa"][1])
    for doc, result in zip(docs, r.json()["results"]):
        expected, n_windows = qa_spans(model, question, doc, 512, 30, stride=100, top_k=3)
        assert result["usage"]["windows"] == n_windows
        assert [(a["start"], a["end"]) for a in result["answers"]] == [(s.start, s.end) for s in expected]
        assert np.allclose([a["score"] for a in result["answers"]], [s.score for s in expected], atol=1e-4)
    assert r.json()["results"][0]["usage"]["windows"] > 3 and n_windows == 1

    import transformers

    windows, starts, ends, _ = read_qa_windows(model, question, docs[1], 512, stride=100)
    ids = torch.tensor([windows[0].input_ids])
    global_mask = torch.zeros_like(ids)
    global_mask[0, : windows[0].offset - 1] = 1  # [CLS] question; the separator stays local
    hf = transformers.LongformerForQuestionAnswering.from_pretrained(str(dirs["qa"][0])).eval()
    with torch.no_grad():
        want = hf(input_ids=ids, global_attention_mask=global_mask)
    assert np.abs(starts[0] - want.start_logits[0].numpy()).max() < 1e-4
    assert np.abs(ends[0] - want.end_logits[0].numpy()).max() < 1e-4


def test_classification_matches_offline_and_transformers(served):
    server, dirs = served
    doc = text_of(1100, seed=3)
    r = httpx.post(server.url + "/v1/classify", json={"model": "lcls", "document": doc}, timeout=120)
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

    hf = transformers.LongformerForSequenceClassification.from_pretrained(str(dirs["classify"][0])).eval()
    with torch.no_grad():  # transformers' default global token: the first
        want = hf(input_ids=torch.tensor([windows[-1]])).logits[0].numpy()
    assert np.abs(logits[-1] - want).max() < 1e-4
