"""The README's speed figures are read from the results files of the benchmarks that measured them
(docs/bench_export.json: bench/bench_export.py; docs/head_to_head.json: bench/head_to_head.py;
docs/real_size.json: bench/real_size.py), so a figure cannot outlive its run (issue 26)."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TEXT = " ".join(README.split())  # figures may wrap across lines


def test_export_speed_figures_are_the_bench_export_run():
    rows = json.loads((ROOT / "docs" / "bench_export.json").read_text())["results"]
    at = {(r["kind"], r["length"]): r for r in rows}
    fp32, int8 = at[("ours-fp32", 4096)], at[("ours-int8", 4096)]
    torch_, traced = at[("hf-torch", 4096)], at[("hf-traced", 4096)]
    long, full = at[("ours-fp32", 16384)], at[("full-onnx", 16384)]
    stated = [
        f"at 4096 tokens {fp32['median']:.1f} s fp32 and {int8['median']:.1f} s int8",
        f"against {torch_['median']:.1f} s for transformers' block-sparse PyTorch and {traced['median']:.1f} s",
        f"at {fp32['peak_gib'] / traced['peak_gib']:.2f}x its peak memory "
        f"({fp32['peak_gib']:.2f} against {traced['peak_gib']:.2f} GiB)",
        # ratios of the medians as docs/benchmarks.md's table rounds them (to 0.01 s)
        f"16384 tokens take {long['median']:.1f} s fp32, {round(long['median'], 2) / round(fp32['median'], 2):.2f}x "
        "the time of 4096",
        f"are {round(full['median'], 2) / round(long['median'], 2):.2f}x faster than a full-attention export",
    ]
    for figure in stated:
        assert figure in TEXT, figure


def test_head_to_head_figures_are_its_results_file():
    results = json.loads((ROOT / "docs" / "head_to_head.json").read_text())["results"]
    rps = {k: [p["throughput_rps"] for p in v["points"]] for k, v in results.items()}

    def span(ours: str) -> str:
        ratios = [a / b for a, b in zip(rps[ours], rps["hf-torch"])]
        return f"{min(ratios):.1f}-{max(ratios):.1f}x"

    assert f"int8 answers **{span('ours-int8')} the requests per second**" in TEXT
    assert f"fp32 {span('ours-fp32')}" in TEXT
    memory = f"{results['ours-int8']['peak_rss_gib']:.2f} GiB against {results['hf-torch']['peak_rss_gib']:.2f} GiB"
    assert memory in TEXT, memory


def test_real_size_figures_are_its_results_file():
    """The README's generation figure is docs/real_size.json's bigbird-pegasus-large greedy row
    (docs/benchmarks.md's tables of that file: tests/test_benchmark_figures.py)."""
    run = json.loads((ROOT / "docs" / "real_size.json").read_text())
    generate = run["results"]["pegasus-large-summarize"]["generate"]
    ours, theirs = generate["ours_beam1_s_per_token"], generate["transformers_beam1_s_per_token"]
    figure = f"generates a token in {1000 * ours:.0f} ms greedy, {theirs / ours:.1f}x faster than transformers'"
    assert figure in TEXT, figure
