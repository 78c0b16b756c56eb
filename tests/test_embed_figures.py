"""The embedding model's figures in docs/models.md and models/embed/MODEL_CARD.md come from the results
files their commands wrote (issue 39): recall@1 of whole pages against their first window
(data/embed_retrieval.py, docs/results/embed-retrieval.json) and throughput against
sentence-transformers (bench/embed_throughput.py, docs/results/embed-throughput.json), each with
its command."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS_MD, CARD = ROOT / "docs" / "models.md", ROOT / "models" / "embed" / "MODEL_CARD.md"


def results(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / name).read_text())


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def test_retrieval_figures_are_the_measured_ones():
    r = results("embed-retrieval.json")
    assert r["pooled"] == r["recall_at_1"]["service"] and r["truncated"] == r["recall_at_1"]["first window (truncate)"]
    assert r["pooled"] > r["truncated"]
    for doc in (MODELS_MD, CARD):
        text = doc.read_text()
        assert f"**{pct(r['pooled'])}**" in text or pct(r["pooled"]) in text, doc
        assert r["command"] in text, doc
        for value in r["recall_at_1"].values():
            assert f"| {pct(value)} |" in text, (doc, value)
        for key in ("pages", "queries", "min_tokens"):
            assert str(r[key]) in text, (doc, key)
    # the service's pooling is the best measured one (how it was chosen)
    assert r["recall_at_1"]["service"] == max(r["recall_at_1"].values())


def test_throughput_figures_are_the_measured_ones():
    r = results("embed-throughput.json")
    for doc in (MODELS_MD, CARD):
        text = doc.read_text()
        assert r["command"] in text, doc
        for row in r["results"].values():
            assert f"| {row['docs_per_s']:.2f} | {row['tokens_per_s']:.0f} | {row['speedup']:.2f}x |" in text, doc
