"""bench/gpu.py's CPU dry run (`--tiny --device cpu`): every phase of the GPU script runs on tiny
shapes, so the script a GPU lease runs (docs/gpu.md) is known to work before the lease starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_script_runs_every_phase_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--tiny", "--device", "cpu",
                          "--work", str(tmp_path / "work"), "--out", str(tmp_path), "--requests", "16"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    phases = ("make", "verify", "ours", "encoder_opts", "kernels", "gathers", "hf", "service", "pegasus", "summarize")
    assert all(p in result for p in phases), sorted(result)
    assert not [p for p in phases if "error" in result[p]], {p: result[p] for p in phases if "error" in result[p]}
    assert result["verify"]["ok"] and result["service"]["ok"] == result["service"]["requests"]
    assert {v["max_abs_diff"] for v in result["encoder_opts"].values()} == {0.0}  # CPU: every level exact here
    assert result["gathers"]["max_abs_diff"] == 0.0  # the one-hot product is the gather, exactly
    s = result["summarize"]
    assert s["greedy"]["ok"] == 64 and s["clients32"]["ok"] == 128 and [b["status"] for b in s["beam4"]] == [200] * 4
    assert s["no_overlap"]["greedy"]["ok"] == 64 and s["no_overlap"]["alone"]["ok"] == 8
    assert "without --overlap-encoding" in out.stdout
    assert "service, 32 clients" in out.stdout and "encoder settings" in out.stdout
    assert "key-block gather" in out.stdout
