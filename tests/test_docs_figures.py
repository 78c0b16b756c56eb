"""The headline figures of README.md, docs/models.md and the model cards come from the results files
that `longdoc eval --json` wrote (docs/results/*.json), with the command that wrote them: a figure
cannot outlive its measurement (issue 27; STYLE.md "Figures are measurements, kept with their command")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
README, MODELS_MD = ROOT / "README.md", ROOT / "docs" / "models.md"
SUMMARIZE_CARD, QA_CARD = ROOT / "models" / "summarize" / "MODEL_CARD.md", ROOT / "models" / "qa" / "MODEL_CARD.md"
CLASSIFY_CARD = ROOT / "models" / "classify" / "MODEL_CARD.md"


def results(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def row(report: dict, system: str, subset: str) -> dict:
    (found,) = [r for r in report["rows"] if r["system"] == system and r["subset"] == subset]
    return found


def rouge(r: dict) -> str:
    """ROUGE-1/2/L as the docs write them: "28.4 / 7.8 / 26.5"."""
    return " / ".join(f"{100 * r[k]:.1f}" for k in ("rouge1", "rouge2", "rougeL"))


def em_f1(r: dict) -> str:
    return f"{100 * r['exact_match']:.1f} / {100 * r['f1']:.1f}"


def accuracy(r: dict) -> str:
    return f"{100 * r['accuracy']:.1f}"


# (results file, system, subset, format, documents that state the figure)
FIGURES = [
    ("summarize-pkg-test.json", "model", "all", rouge, (README, MODELS_MD, SUMMARIZE_CARD)),
    ("summarize-pkg-test.json", "lead-description", "all", rouge, (README, MODELS_MD, SUMMARIZE_CARD)),
    ("summarize-pkg-test.json", "model", "beyond-window", rouge, (README, MODELS_MD, SUMMARIZE_CARD)),
    ("summarize-pkg-test.json", "lead-description", "beyond-window", rouge, (README, MODELS_MD, SUMMARIZE_CARD)),
    ("summarize-page-test.json", "model", "all", rouge, (README, SUMMARIZE_CARD)),
    ("summarize-page-test.json", "lead-description", "all", rouge, (README, SUMMARIZE_CARD)),
    ("summarize-aclsum.json", "model", "all", rouge, (README, MODELS_MD, SUMMARIZE_CARD)),
    ("summarize-aclsum.json", "lead", "all", rouge, (README, MODELS_MD, SUMMARIZE_CARD)),
    ("qa-pkg-test.json", "model", "all", em_f1, (README, MODELS_MD, QA_CARD)),
    ("qa-pkg-test.json", "model", "beyond-512", em_f1, (MODELS_MD,)),
    ("qa-pkg-test.json", "first-512", "all", em_f1, (README, MODELS_MD)),
    ("qa-page-test.json", "model", "all", em_f1, (README, MODELS_MD)),
    ("qa-page-test.json", "model", "beyond-512", em_f1, (MODELS_MD,)),
    ("qa-page-test.json", "model", "within-512", em_f1, (MODELS_MD,)),
    ("qa-page-test.json", "first-window", "all", em_f1, (MODELS_MD,)),
    ("qa-page-test.json", "first-window", "beyond-512", em_f1, (MODELS_MD,)),
    ("qa-page-test.json", "first-512", "all", em_f1, (README, MODELS_MD)),
    ("qa-page-test.json", "first-512", "beyond-512", em_f1, (MODELS_MD,)),
    ("qa-page-test.json", "first-512", "within-512", em_f1, (MODELS_MD,)),
    ("classify-test.json", "model", "all", accuracy, (README, MODELS_MD, CLASSIFY_CARD)),
    ("classify-test.json", "majority (3)", "all", accuracy, (README, MODELS_MD, CLASSIFY_CARD)),
]


@pytest.mark.parametrize("name, system, subset, fmt, documents", FIGURES,
                         ids=[f"{f[0]}:{f[1]}:{f[2]}" for f in FIGURES])
def test_docs_state_the_measured_figure(name, system, subset, fmt, documents):
    figure = fmt(row(results(name), system, subset))
    for document in documents:
        assert figure in document.read_text(), f"{document.relative_to(ROOT)} does not state {system} {subset} {figure} of {name}"


@pytest.mark.parametrize("name", sorted({f[0] for f in FIGURES}))
def test_docs_give_the_command_that_measured_it(name):
    report = results(name)
    assert report["command"] and report["command"].startswith("longdoc eval ") and f"--json docs/results/{name}" in report["command"]
    assert report["command"] in MODELS_MD.read_text(), f"docs/models.md does not give the command of {name}"
    if report["task"] == "summarize":
        assert report["metric"].startswith("rouge-score ") and "use_stemmer=True" in report["metric"]


def test_distinct_and_repeat_figures_are_the_measured_ones():
    """The package-disjoint test's distinct summaries and word repeats, as the model card states them."""
    r = row(results("summarize-pkg-test.json"), "model", "all")
    card = SUMMARIZE_CARD.read_text()
    assert f"{100 * r['distinct']:.1f}% distinct" in card and f"{100 * r['repeat3']:.1f}% repeat a word" in card
