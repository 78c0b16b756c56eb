"""bench/NAME.py as a module, for the tests that read a benchmark's functions (its table, its
results): a bench script imports its siblings (common, load, real_size) from its own folder, which is
on sys.path when it runs as a script; here bench/ is on sys.path only while it loads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
