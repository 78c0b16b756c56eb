"""What the benchmark scripts share (imported as a sibling, like `load`): a timestamped log line,
this process's memory from /proc, and the CPU's name for a results file."""

from __future__ import annotations

import platform
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
