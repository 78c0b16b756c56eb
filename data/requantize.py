"""Give a shipped int8 model directory one activation scale per row, in place (issue 40).

    .venv/bin/python -m data.requantize models/qa models/summarize models/classify

The shipped models were exported while `longdoc export` kept `quantize_dynamic`'s one activation
scale per tensor, under which an answer depended on what else was in its batch; their training
checkpoints are not kept. This applies the export's own per-row pass
(`longdoc.export.quantization.per_row_activations`) to each graph: the int8 weights, their scales
and every other tensor stay as they are, bit for bit, so the result is what `longdoc export`
writes today from the same checkpoint (with data/ship_model.py's fp16 embedding tables). The
manifest records the graphs' new checksums.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx

from data.ship_model import _record_checksum
from longdoc.export.graph import save_model
from longdoc.export.manifest import Manifest
from longdoc.export.quantization import per_row_activations


def requantize(model_dir: Path) -> list[str]:
    """Rewrite the graphs of an int8 model directory that still quantize per tensor -> their names."""
    manifest = Manifest.load(model_dir)
    if manifest.dtype != "int8":
        raise SystemExit(f"{model_dir}: a {manifest.dtype} model has no int8 activations")
    done = []
    for filename in manifest.graphs.values():
        path = model_dir / filename
        model = onnx.load(str(path))
        if not any(node.op_type == "DynamicQuantizeLinear" for node in model.graph.node):
            continue
        save_model(per_row_activations(model), path)
        _record_checksum(path)
        done.append(filename)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dirs", type=Path, nargs="+", metavar="MODEL_DIR", help="int8 model directories")
    args = parser.parse_args(argv)
    for model_dir in args.model_dirs:
        done = requantize(model_dir)
        print(f"{model_dir}: {', '.join(done) if done else 'already one scale per row'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
