"""docs/benchmarks.md states the figures of the results files its commands wrote: each table is the
benchmark script's own table of its results file (or, for the decode runs, each run's row), and the
command that measured it is on the page. A figure cannot outlive its measurement.

(ModernBERT's table: tests/export/test_modernbert_bench.py; the README's figures:
tests/test_readme_figures.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGE = (DOCS / "benchmarks.md").read_text()


def results(name: str) -> dict:
    return json.loads((DOCS / name).read_text())


def test_the_export_table_is_its_results_file():
    assert load_bench("bench_export").markdown_table(results("bench_export.json")["results"]) in PAGE


def test_the_head_to_head_tables_are_its_results_file():
    run = results("head_to_head.json")
    assert run["command"] in PAGE
    for system, r in run["results"].items():
        for p in r["points"]:
            row = (f"| {system} | {p['concurrency']} | {p['ok']}/{p['sent']} | {p['seconds']:.0f} | "
                   f"{p['throughput_rps']:.4f} | {p['p50_s']:.1f} | {p['p99_s']:.1f} | {r['peak_rss_gib']:.2f} |")
            assert row in PAGE, row


def test_the_real_size_tables_are_its_results_file():
    run = results("real_size.json")
    assert load_bench("real_size").table(run["results"]) in PAGE and run["command"] in PAGE


def test_the_host_path_table_is_its_results_file():
    bench = load_bench("host_path")
    assert bench.markdown_table(results("host_path.json")["summary"]) in PAGE
    rows = {(r["mode"], r["cores"]): r for r in results("host_path.json")["summary"]}
    one, fe = rows["one-process", 2], rows["front-ends", 2]
    flat = " ".join(PAGE.split())
    assert (f"On two quiet cores the front ends reach {fe['vs_1_core']:.2f}x one core "
            f"and one process {one['vs_1_core']:.2f}x") in flat
    assert f"about {one['loop_cpu_ms_per_doc']:.0f} ms of CPU per document" in flat
    assert f"spends about {fe['loop_cpu_ms_per_doc']:.1f} ms per document" in flat


def test_the_decode_rows_are_their_results_files():
    files = sorted((DOCS / "decode").glob("decode_concurrency-*.json"))
    assert files
    for i, f in enumerate(files, 1):
        r = json.loads(f.read_text())
        row = (f"| {i} | {r['one_token_s']:.3f} | {r['alone']['rps']:.3f} | {r['concurrent']['rps']:.3f} | "
               f"{100 * r['share_of_bound']:.0f}% |")
        assert row in PAGE, (f.name, row)
        assert r["concurrent"]["ok"] == r["concurrent"]["requests"] == 32


def test_the_battery_table_is_its_results_file():
    run = results("battery.json")
    assert load_bench("battery").markdown_table(run["rows"]) in PAGE and run["command"] in PAGE


def test_the_battery_ran_every_part():
    """The results file on the page is a whole run (issue 38): the floods from several addresses and
    from the probes' own, the slow bodies, the over-token senders, header sizes, the overload with
    Retry-After obeyed and ignored, and the kill -9 of an engine and of a front end."""
    parts = " / ".join(r["part"] for r in results("battery.json")["rows"])
    for words in ("idle connections from 127.0.0.1 (the probes' own)", "idle connections from 5 addresses",
                  "slow-body (1 byte/s) connections from 5 addresses", "over-token documents",
                  "a header of 1 kB to 1 MB", "client obeys Retry-After", "client ignores Retry-After",
                  "Retry-After R vs time A until the next admission", "4x overload", "kill -9 of the engine",
                  "kill -9 of one of two front ends", "SIGTERM", "SIGINT twice", "protocol errors"):
        assert words in parts, words


def test_every_benchmark_script_is_on_the_page():
    """bench/ holds the scripts a figure comes from (and their helpers): each is named here."""
    helpers = {"common.py"}  # imported by the others
    for script in sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "bench").glob("*.sh")):
        if script.name not in helpers:
            assert f"bench/{script.name}" in PAGE or f"`{script.name}`" in PAGE, script.name


def test_the_decode_steps_tables_are_their_results_files():
    for name in ("decode/steps.json", "decode/steps-1100.json"):
        run = results(name)
        table = load_bench("decode_steps").markdown_table(run)
        assert table in PAGE and run["command"] in PAGE, name
        assert f"--tokens {run['tokens']}" in run["command"] and f"{run['tokens']:,} tokens" in PAGE
    from longdoc.service.workers import DEFAULT_DECODER_STEPS

    # whatever they cost: on the CPU only fixed-shape steps keep a summary independent of the load
    assert DEFAULT_DECODER_STEPS["cpu"] == "fixed"


def test_the_int8_scale_tables_are_their_results_files():
    speed = results("results/int8-per-row/bench_export.json")["results"]
    assert load_bench("bench_export").markdown_table(speed) in PAGE
    cpu = {r["kind"]: r["median_cpu"] for r in speed}
    assert f"takes {cpu['ours-int8'] / cpu['ours-int8-per-tensor']:.2f}x the CPU time" in PAGE
    for task in ("qa", "classify"):
        assert load_bench("int8_activations").markdown_table(results(f"results/int8-activations-{task}.json")) in PAGE


def test_export_md_states_the_int8_scale_figures():
    export_md = " ".join((DOCS / "export.md").read_text().split())
    cpu = {r["kind"]: r["median_cpu"] for r in results("results/int8-per-row/bench_export.json")["results"]}
    closer = {t: results(f"results/int8-activations-{t}.json")["graphs"] for t in ("classify", "qa")}
    ratio = {t: g["per-tensor"]["mean_abs_diff"] / g["per-row"]["mean_abs_diff"] for t, g in closer.items()}
    assert (f"{cpu['ours-int8'] / cpu['ours-int8-per-tensor']:.2f}x the CPU time of the int8 encoder at 4096 tokens, "
            f"and outputs {ratio['classify']:.0f}x (classify) to {ratio['qa']:.1f}x (QA) closer") in export_md
