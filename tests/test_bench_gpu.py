"""The GPU lease's CPU dry run: bench/gpu_lease.sh runs its whole sequence (bench/gpu.py's phases
on tiny models with `--tiny --device cpu`, then the host path) here, so the script a lease runs
(docs/gpu.md, "The next lease") is known to work, file by file, before the lease starts; and the
phases of bench/gpu.py the lease does not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEASE_FILES = ("verify", "encoder", "qa_service", "steps", "summarize", "host_path")


def results(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_lease_runs_every_measurement_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # python3 = this venv's
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_lease.sh"), "dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1400)
    out = tmp_path / "out"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAILED" not in run.stdout, run.stdout[-5000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(["lease.log", *(f"{n}.json" for n in LEASE_FILES)])
    assert len(list(out.iterdir())) <= 8  # what comes back from a lease
    for name in LEASE_FILES[:-1]:
        phases = {k: v for k, v in results(out, name).items() if k not in ("device", "command", "config")}
        assert phases and not [p for p, v in phases.items() if "error" in v], phases
    verify = results(out, "verify")["verify"]
    assert set(verify) == {"all-heads", "onehot", "window"} and all(v["ok"] for v in verify.values())
    encoder = results(out, "encoder")
    assert encoder["variants"]["gather"]["max_abs_diff"] == 0.0 and encoder["peak"]["matmul_peak_tflops"] > 0
    assert max(v["max_abs_diff"] for v in encoder["variants"].values() if isinstance(v, dict)) < 1e-2  # fp16
    assert set(encoder["kernels"]) == {"gather", "window"} and encoder["gathers"]["max_abs_diff"] == 0.0
    qa = results(out, "qa_service")["service"]
    assert qa["ok"] == qa["requests"] == 16 and qa["consistency"]["documents"] == 16
    steps = results(out, "steps")["steps"]
    assert all(steps[f"{v}_batch{b}_ms_per_token"] > 0 for v in ("new", "baseline") for b in (1, 8))
    summaries = results(out, "summarize")["summarize"]
    for variant in ("new", "baseline"):
        s = summaries[variant]
        assert s["alone"]["ok"] == 8 and s["clients8"]["ok"] == 64 and s["clients32"]["requests"] == 128
        # a request queued past max_queue_wait_s (10 s) is answered 503: on an oversubscribed CPU a few are
        assert s["clients32"]["ok"] >= 96
        assert s["consistency"]["documents"] == 16
    assert results(out, "host_path")["summary"]  # whatever serving design main has, at the cores given
    assert "QA service, 32 clients" in run.stdout and "greedy decode step" in run.stdout


@pytest.mark.slow
def test_the_other_gpu_phases_run_on_the_cpu(tmp_path):
    """The phases a lease may ask for by name (`bench/gpu.py --phases`), beside the lease's own."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--tiny", "--device", "cpu", "--work",
                          str(tmp_path / "work"), "--out", str(tmp_path), "--gathers", "gather",
                          "--phases", "make,hf,pegasus,encoder_opts"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = results(tmp_path, "gpu")
    assert not [p for p in ("make", "hf", "pegasus", "encoder_opts") if "error" in result[p]], result
    assert {v["max_abs_diff"] for v in result["encoder_opts"].values()} == {0.0}  # CPU: every level exact here
    assert "ms per generated token" in out.stdout
