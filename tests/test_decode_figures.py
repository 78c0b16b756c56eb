"""docs/decode_concurrency.md states the figures of its results files (docs/decode/)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_decode_table_is_its_results_files():
    doc = (ROOT / "docs" / "decode_concurrency.md").read_text()
    files = sorted((ROOT / "docs" / "decode").glob("decode_concurrency-*.json"))
    assert len(files) == 7
    for f in files:
        r = json.loads(f.read_text())
        row = (f"| {r['one_token_s']:.3f} | {r['alone']['rps']:.3f} | {r['concurrent']['rps']:.3f} | "
               f"{100 * r['share_of_bound']:.0f}% |")
        assert row in doc, (f.name, row)
        assert r["concurrent"]["ok"] == r["concurrent"]["requests"] == 32
