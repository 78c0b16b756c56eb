"""What the benchmark scripts share (imported as a sibling, like `load`): a timestamped log line,
this process's memory from /proc, the CPU's name, the command line and load average a results file
records, and the axes of a latency/memory-against-length plot."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def status_gib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in GiB; nan where there is none."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command a results file records: `.venv/bin/python bench/SCRIPT ARGS` (argv: main's
    arguments when called from a test, else this process's)."""
    return f".venv/bin/python bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv)


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded as the results files keep them."""
    return [round(x, 2) for x in os.getloadavg()]


def length_axes(axes) -> None:
    """(latency, peak memory) axes against the length in tokens: log-log, titled, gridded."""
    for ax, title in zip(axes, ("latency, batch 1 (s)", "peak RSS (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()


def time_it(run, reps: int, warmups: int = 2) -> float:
    """Median seconds of `reps` runs after `warmups` (run() returns when the result is on the host)."""
    for _ in range(warmups):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
