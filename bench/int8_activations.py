"""How close an int8 model's outputs stay to its own weights run with float activations: one
activation scale per tensor (`quantize_dynamic`'s graph) against one per row (what `longdoc export`
writes, export/quantization.py). A script, not a test.

The int8 weights are the same in all three graphs: "float" dequantizes them and runs every MatMul
in fp32 (the reference: no activation is quantized), "per-tensor" is `quantize_dynamic` of that
float graph (it gives back the same int8 weights), "per-row" is the per-row pass over it. Inputs
are real pages of a JSONL data set (`longdoc eval`'s format), each row alone, then all rows as one
batch (per-tensor: every row's scale is the batch's; per-row: the same bits as alone).

    .venv/bin/python bench/int8_activations.py models/qa --data data/cache/manpages/qa_test.jsonl \
        --limit 48 --length 1024 --json docs/results/int8-activations-qa.json

Prints and saves, per graph: mean |diff| of the task outputs against "float", the rows whose
argmax (QA: best start and end token; classify: label) matches "float", and the rows whose
outputs change when the row runs in the batch instead of alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np


def float_graph(quantized):
    """`quantized` (a per-tensor or per-row int8 graph) with every MatMulInteger whose right-hand
    side is a constant replaced by a float MatMul over its dequantized weights."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(quantized)
    graph = model.graph
    init = {t.name: t for t in graph.initializer}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    drop, nodes = set(), []
    for node in graph.node:
        if node.op_type != "MatMulInteger" or node.input[1] not in init:
            continue
        cast = consumers[node.output[0]][0]
        rescale = consumers[cast.output[0]][0]  # Mul(product, x_scale * w_scale)
        scale_mul = next(n for n in graph.node if n.output[0] in rescale.input and n.op_type == "Mul")
        w_scale = next(i for i in scale_mul.input if i in init)
        weights = numpy_helper.to_array(init[node.input[1]]).astype(np.float32)
        zero = numpy_helper.to_array(init[node.input[3]]).astype(np.float32) if len(node.input) > 3 else 0.0
        dequantized = numpy_helper.from_array((weights - zero) * numpy_helper.to_array(init[w_scale]),
                                              f"{node.input[1]}/float")
        graph.initializer.append(dequantized)
        source = quantizer_input(graph, node.input[0])
        nodes.append((rescale, helper.make_node("MatMul", [source, dequantized.name], [rescale.output[0]],
                                                name=f"{node.name}/float")))
        drop |= {node.name, cast.name, rescale.name}
    kept = [n for n in graph.node if n.name not in drop]
    for rescale, matmul in nodes:
        kept.insert(next(i for i, n in enumerate(kept) if rescale.output[0] in n.input), matmul)
    while True:  # the activations' quantization, now read by nobody
        read = {name for n in kept for name in n.input} | {o.name for o in graph.output}
        live = [n for n in kept if any(out in read for out in n.output)]
        if len(live) == len(kept):
            break
        kept = live
    del graph.node[:]
    graph.node.extend(kept)
    return model


def quantizer_input(graph, quantized: str) -> str:
    """The float tensor that the node producing `quantized` quantized (walking back through it)."""
    producers = {out: n for n in graph.node for out in n.output}
    node = producers[quantized]
    while node.op_type not in ("DynamicQuantizeLinear",) and node.name.find("/per_row/") < 0:
        node = producers[node.input[0]]
    if node.op_type == "DynamicQuantizeLinear":
        return node.input[0]
    scope = node.name.split("/per_row/")[0] + "/per_row/"
    first = next(n for n in graph.node if n.name.startswith(scope))
    return first.input[0]


def model_copy(source: Path, target: Path, encoder) -> Path:
    """A copy of the model directory `source` whose encoder.onnx is `encoder`."""
    from longdoc.export.graph import save_model
    from longdoc.export.manifest import Manifest, file_checksums

    shutil.copytree(source, target)
    save_model(encoder, target / "encoder.onnx")
    manifest = Manifest.load(target)
    replace(manifest, files=file_checksums(target, list(manifest.files))).save(target)
    return target


def markdown_table(results: dict) -> str:
    """The results as docs/benchmarks.md shows them (a test compares the two)."""
    n = results["rows"]
    lines = ["| activation scales | mean abs diff vs float activations | argmax as float | rows changed in a batch of "
             f"{n} |", "|---|---:|---:|---:|"]
    for name, r in results["graphs"].items():
        lines.append(f"| {name} | {r['mean_abs_diff']:.4f} | {r['argmax_same']}/{n} | {r['changed_in_batch']}/{n} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir", type=Path, help="an int8 model directory (QA or classify)")
    p.add_argument("--data", type=Path, required=True, help="JSONL pages (`longdoc eval`'s format)")
    p.add_argument("--limit", type=int, default=48, help="pages read (default: 48)")
    p.add_argument("--length", type=int, default=1024, help="tokens of each page's first window (default: 1024)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default: 2)")
    p.add_argument("--json", type=Path, help="write the results here (default: none, print only)")
    args = p.parse_args(argv)

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from longdoc.export.quantization import per_row_activations
    from longdoc.export.runtime import OnnxModel

    records = [json.loads(line) for line in args.data.read_text().splitlines()[: args.limit]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shipped = onnx.load(str(args.model_dir / "encoder.onnx"))
        onnx.save(float_graph(shipped), str(tmp / "float.onnx"))
        quantize_dynamic(str(tmp / "float.onnx"), str(tmp / "per-tensor.onnx"), weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul"], per_channel=any(
                             t.name.endswith("_scale") and len(t.dims) == 1 for t in shipped.graph.initializer))
        graphs = {"float": onnx.load(str(tmp / "float.onnx")), "per-tensor": onnx.load(str(tmp / "per-tensor.onnx"))}
        graphs["per-row"] = per_row_activations(onnx.load(str(tmp / "per-tensor.onnx")))
        models = {name: OnnxModel(model_copy(args.model_dir, tmp / name, g), threads=args.threads)
                  for name, g in graphs.items()}
        m = models["float"]
        ids = []
        for r in records:
            text = r.get("context") or r.get("document") or r.get("text")
            encoded = m.tokenizer.encode(r["question"], text) if "question" in r else m.tokenizer.encode(text)
            ids.append(encoded.ids[: args.length])
        S = max(len(x) for x in ids)
        batch = np.full((len(ids), S), m.manifest.special_tokens.get("pad") or 0, np.int64)
        mask = np.zeros_like(batch)
        for i, x in enumerate(ids):
            batch[i, : len(x)], mask[i, : len(x)] = x, 1
        outputs = {name: [model.run_encoder(batch[i:i + 1], mask[i:i + 1]) for i in range(len(ids))]
                   for name, model in models.items()}
        batched = {name: model.run_encoder(batch, mask) for name, model in models.items()}
    per_token = m.manifest.per_token_outputs
    lengths = mask.sum(axis=1)

    def row(out: dict, i: int, alone: bool) -> dict:
        """Row i's outputs, its padding cut off (`alone`: out holds that row only)."""
        r = 0 if alone else i
        return {k: v[r, : lengths[i]] if k in per_token else v[r] for k, v in out.items()}

    results = {"model_dir": str(args.model_dir), "data": str(args.data), "rows": len(ids), "length": S, "graphs": {}}
    for name in ("per-tensor", "per-row"):
        diffs, same, moved = [], 0, 0
        for i in range(len(ids)):
            got, want = row(outputs[name][i], i, True), row(outputs["float"][i], i, True)
            diffs.append(float(np.mean([np.abs(got[k] - want[k]).mean() for k in want])))
            same += all(got[k].argmax() == want[k].argmax() for k in want)
            in_batch = row(batched[name], i, False)
            moved += not all(np.array_equal(in_batch[k], got[k]) for k in want)
        results["graphs"][name] = {"mean_abs_diff": float(np.mean(diffs)), "argmax_same": same,
                                   "changed_in_batch": moved}
        print(f"{name:>10}: mean |diff| vs float activations {np.mean(diffs):.4f}; argmax as float on {same}/{len(ids)} "
              f"rows; outputs changed in a batch of {len(ids)}: {moved}/{len(ids)} rows")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
