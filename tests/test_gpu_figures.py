"""The GPU figures in docs/gpu.md are the ones in the results files the lease wrote
(docs/gpu-runs/): a document that disagrees with its measurement fails here."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "gpu-runs" / "2026-11-26"


def load(name: str) -> dict:
    return json.loads((RUNS / name).read_text())


def test_the_gpu_doc_states_the_measured_figures():
    first, second, again = load("gpu-lease1-b.json"), load("gpu-lease2.json"), load("gpu-lease2-summarize-again.json")
    doc = (ROOT / "docs" / "gpu.md").read_text()
    summaries = f"{second['summarize']['greedy']['throughput_rps']:.1f}"
    qa = f"{second['service']['throughput_rps']:.1f}"
    share = f"{100 * second['service']['throughput_rps'] / second['ours']['32']['docs_per_s']:.0f}%"
    assert summaries in doc and qa in doc and share in doc
    assert f"{again['summarize']['greedy']['throughput_rps']:.1f}" in doc
    assert f"{first['summarize']['greedy']['throughput_rps']:.1f}" in doc
    assert f"{first['summarize']['clients32']['throughput_rps']:.1f}" in doc
    host = load("host_path_gpu.json")
    assert f"{max(p['docs_per_s'] for p in host['summary'] if p['mode'] == 'pool'):.1f}" in doc


def test_the_next_lease_table_is_the_report_of_its_results_files():
    """docs/gpu.md's goals table is `bench/gpu.py --report docs/gpu-runs/next-lease`: all "-" until the
    lease's files are copied there, then the doc must show the figures they hold."""
    from tests.bench_scripts import load_bench

    report = load_bench("gpu").lease_report(ROOT / "docs" / "gpu-runs" / "next-lease")
    assert report in (ROOT / "docs" / "gpu.md").read_text()


def test_the_sparse_gather_cpu_tables_are_their_results_files():
    """docs/gpu.md, "The encoder's gathers": `bench/bench_export.py`'s table of each run's results file."""
    from tests.bench_scripts import load_bench

    table = load_bench("bench_export").markdown_table
    doc = (ROOT / "docs" / "gpu.md").read_text()
    for dtype in ("fp32", "int8"):
        run = json.loads((ROOT / "docs" / "results" / f"sparse-gather-{dtype}" / "bench_export.json").read_text())
        assert table(run["results"]) in doc, dtype
