"""docs/decode_concurrency.md states the figures of its results files (docs/decode/)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_decode_table_is_its_results_files():
    doc = (ROOT / "docs" / "decode_concurrency.md").read_text()
    files = sorted((ROOT / "docs" / "decode").glob("decode_concurrency-*.json"))
    assert len(files) == 13
    for f in files:
        r = json.loads(f.read_text())
        row = (f"| {r['one_token_s']:.3f} | {r['alone']['rps']:.3f} | {r['concurrent']['rps']:.3f} | "
               f"{100 * r['share_of_bound']:.0f}% |")
        assert row in doc, (f.name, row)
        assert r["concurrent"]["ok"] == r["concurrent"]["requests"] == 32


def test_the_costs_table_is_its_results_file():
    doc = (ROOT / "docs" / "decode_concurrency.md").read_text()
    r = json.loads((ROOT / "docs" / "decode" / "costs.json").read_text())
    enc, join, step = r["encode_ms_per_doc"], r["join_ms"], r["step_ms"]
    full = step[f"batch_{r['batch']}"]
    for row in (f"| encode, {r['group']} documents in one batch, per document | {enc['one_batch']:.0f} |",
                f"| encode, one at a time, per document | {enc['one_at_a_time']:.0f} |",
                f"| join: one copy of the whole batch of {r['batch']} | {join['copy_whole_batch']:.1f} |",
                f"| join: the newcomer's row | {join['write_newcomer_row']:.1f} |",
                f"| decoder step, batch 1 | {step['batch_1']:.1f} |",
                f"| decoder step, batch {r['batch']} | {full:.1f} |"):
        assert row in doc, row
    assert r["command"] in doc
