"""bench/graph_ab.py (two exports, interleaved) runs on the tests' tiny export, and docs/export.md's
key-bias and query-chunk tables are its results files (docs/results/key-bias-fold-*.json,
docs/results/query-chunks-*.json)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]


def test_graph_ab_runs_and_compares_outputs(tiny_qa_dir, tmp_path):
    out = tmp_path / "ab.json"
    args = [str(tiny_qa_dir), str(tiny_qa_dir), "--length", "300", "--batch", "2", "--rounds", "2",
            "--threads", "1", "--json", str(out)]
    assert load_bench("graph_ab").main(args) == 0
    results = json.loads(out.read_text())
    assert set(results["max_abs_diff"]) == {"start_logits", "end_logits"}
    assert max(results["max_abs_diff"].values()) == 0.0  # the same graph
    assert len(results["seconds"]["a"]) == len(results["seconds"]["b"]) == 2 and results["b_over_a"] > 0


def test_the_key_bias_table_is_its_results_files():
    text = (ROOT / "docs" / "export.md").read_text()
    for name in ("int8-4096", "int8-4096-batch4", "fp32-4096"):
        r = json.loads((ROOT / "docs" / "results" / f"key-bias-fold-{name}.json").read_text())
        figures = (f"| {r['batch']} | {r['median_s']['a']:.3f} | {r['median_s']['b']:.3f} | {r['b_over_a']:.3f} | "
                   f"{max(r['max_abs_diff'].values()):.1e} |")
        assert figures in text and r["command"] in text, name


def test_the_query_chunks_table_is_its_results_files():
    text = (ROOT / "docs" / "export.md").read_text()
    files = sorted((ROOT / "docs" / "results").glob("query-chunks-run*.json"))
    assert len(files) == 9
    for path in files:
        r = json.loads(path.read_text())
        run, dtype = path.stem.split("-")[2][-1], path.stem.split("-")[3]
        figures = (f"| {run} | {dtype} | {r['length']} | {len(r['seconds']['a'])} | {r['median_s']['a']:.3f} | "
                   f"{r['median_s']['b']:.3f} | {r['b_over_a']:.3f} | {max(r['max_abs_diff'].values()):.1e} |")
        assert figures in text, path.name
        assert max(r["max_abs_diff"].values()) == 0.0  # exact
