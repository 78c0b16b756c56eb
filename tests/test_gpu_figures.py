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
