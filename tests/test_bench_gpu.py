"""The GPU lease's CPU dry run: bench/gpu_lease.sh runs its whole sequence (bench/gpu.py's phases
on tiny models with `--tiny --device cpu`, then the host path) here, so the script a lease runs
(docs/gpu.md, "The next lease") is known to work, file by file, before the lease starts; and the
phases of bench/gpu.py the lease does not run; and the steps that keep every lease call under the
device tool's 64 MiB (`aside`, `size`, `back`), on a checkout of their own."""

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
    assert "every lease call fits in 64 MiB" in run.stdout  # the dry run checks what the calls send first


LEASE = ["bash", str(ROOT / "bench" / "gpu_lease.sh")]


def checkout(path: Path) -> Path:
    """A git checkout with the shape of this one: shipped models (their graphs tracked), ignored
    lease folders."""
    for name, text in {"README.md": "r", ".gitignore": "/.ortgpu/\n/.whl/\n", "models/qa/manifest.json": "{}",
                       "models/qa/encoder.onnx": "graph qa", "models/sum/decoder.onnx": "graph sum"}.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "models"], check=True)
    return path


def lease(step: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*LEASE, step], cwd=cwd, capture_output=True, text=True, timeout=60)


def git_status(path: Path) -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=path, capture_output=True, text=True, check=True).stdout


def test_aside_and_back_move_the_graphs_out_of_the_checkout_and_back_without_clobbering(tmp_path):
    co = checkout(tmp_path / "co")
    aside = tmp_path / "co.models-aside"
    run = lease("aside", co)
    assert run.returncode == 0, run.stderr
    assert not (co / "models/qa/encoder.onnx").exists() and (co / "models/qa/manifest.json").exists()
    assert (aside / "models/qa/encoder.onnx").read_text() == "graph qa"
    assert (aside / "models/sum/decoder.onnx").read_text() == "graph sum"
    assert "the graphs are aside" in run.stdout and "every lease call fits in 64 MiB" in run.stdout

    again = lease("aside", co)  # the aside folder holds graphs already: never overwritten
    assert again.returncode == 1 and "refused" in again.stderr
    assert (aside / "models/qa/encoder.onnx").read_text() == "graph qa"

    (co / "models/qa/encoder.onnx").write_text("a new export")  # back would overwrite it
    clash = lease("back", co)
    assert clash.returncode == 1 and "models/qa/encoder.onnx" in clash.stderr
    assert (co / "models/qa/encoder.onnx").read_text() == "a new export"
    assert (aside / "models/qa/encoder.onnx").read_text() == "graph qa"
    assert (co / "models/sum/decoder.onnx").exists() is False  # nothing moved back before the refusal

    (co / "models/qa/encoder.onnx").unlink()
    back = lease("back", co)
    assert back.returncode == 0, back.stderr
    assert git_status(co) == "" and not aside.exists()
    assert (co / "models/qa/encoder.onnx").read_text() == "graph qa"
    assert lease("back", co).returncode == 1  # nothing aside now


def test_aside_refuses_changed_graphs(tmp_path):
    co = checkout(tmp_path / "co")
    (co / "models/qa/encoder.onnx").write_text("re-exported, not committed")
    run = lease("aside", co)
    assert run.returncode == 1 and "commit or restore" in run.stderr
    assert (co / "models/qa/encoder.onnx").exists() and not (tmp_path / "co.models-aside").exists()


def test_size_counts_what_a_call_sends_and_fails_over_64_mib(tmp_path):
    co = checkout(tmp_path / "co")

    def sparse(rel: str, mib: float) -> None:  # its size without the disk space
        (co / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(co / rel, "wb") as f:
            f.truncate(int(mib * 2**20))

    sparse("models/qa/encoder.onnx", 100)  # a tracked graph: left out (it goes aside)
    sparse(".whl/big.whl", 100)  # ignored and not carried by the main call
    run = lease("size", co)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "call `main`: 0.0 MiB" in run.stdout and "still here: run `aside`" in run.stdout

    sparse("notes/untracked.bin", 30)  # untracked, not ignored: it travels
    sparse(".ortgpu/part0/chunk.0", 30)  # carried by the call of part 0 with .whl
    sparse(".ortgpu/part1/chunk.1", 30)
    run = lease("size", co)
    assert run.returncode == 1
    assert "call `part 0` carrying .ortgpu/part0, .whl: 160.0 MiB" in run.stdout
    assert "call `part 1` carrying .ortgpu/part1: 60.0 MiB" in run.stdout
    assert "over the device tool's 64 MiB a call: part 0" in run.stderr

    (co / ".whl/big.whl").unlink()
    sparse("notes/untracked.bin", 34.5)
    run = lease("size", co)
    assert run.returncode == 1 and "call `part 0` carrying .ortgpu/part0, .whl: 64.5 MiB" in run.stdout
    assert "over the device tool's 64 MiB a call: part 0, part 1" in run.stderr


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
