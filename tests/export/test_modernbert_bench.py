"""bench/modernbert.py (issue 28 item 5) runs end to end on the tests' tiny ModernBERT (`--quick`):
its results file has every system at every length, each measured or failed with a reason, ours
agree with transformers, and the table of docs/benchmarks.md is what `markdown_table` makes from
docs/modernbert.json (a figure cannot outlive its measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "modernbert.py"


def bench_module():
    return load_bench("modernbert")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("mb-bench")
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work", str(work), "--lengths", "32,64"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return work, out.stdout, json.loads((work / "modernbert.json").read_text())


def test_quick_run_has_every_system_and_length(quick_run):
    work, stdout, results = quick_run
    bench = bench_module()
    assert results["lengths"] == [32, 64] and results["config"] == "tiny"
    assert set(results["systems"]) == set(bench.SYSTEMS)
    for system, by_length in results["systems"].items():
        assert set(by_length) == {"32", "64"}, system
        for n, row in by_length.items():
            assert row["seconds"] is None and row["failed"] or row["seconds"] > 0 and row["peak_gib"] > 0, (system, n)
    for system in ("ours-fp32", "ours-int8", "ours-int8-attn", "hf-eager", "hf-sdpa"):  # these never fail
        assert all(row["seconds"] for row in results["systems"][system].values()), system
    for n in ("32", "64"):
        assert results["systems"]["ours-fp32"][n]["max_diff"] < 1e-4
        assert results["systems"]["ours-int8"][n]["max_diff"] < 0.5
        assert results["systems"]["ours-int8-attn"][n]["max_diff"] < 0.5
    assert results["hf_onnx_export"]  # exported, or the error is recorded
    assert set(results["goal"]) == {"length", "target", "speedup", "system", "met"} and results["goal"]["length"] == 64
    assert bench.markdown_table(results) in stdout
    assert (work / "modernbert.png").stat().st_size > 0


def test_every_option_shows_its_default():
    for action in bench_module().parser()._actions:
        if action.option_strings and action.dest != "help":
            assert "(default:" in (action.help or ""), action.option_strings


def test_the_table_in_the_docs_is_the_results_file():
    results = json.loads((ROOT / "docs" / "modernbert.json").read_text())
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert bench_module().markdown_table(results) in doc
    assert results["command"] in doc and results["config"] == "base"
    assert results["lengths"] == [2048, 4096, 8192]
