"""`longdoc export` and `longdoc verify` (heavy imports inside the commands)."""

from __future__ import annotations

import argparse
import dataclasses

from longdoc.export.manifest import INT8_ATTENTION, INT8_WEIGHTS, SPARSE_GATHER
from longdoc.export.verify import Agreement


def add_commands(subparsers) -> None:
    from longdoc.model.registry import REGISTRY  # NumPy only: the architectures, one record each

    families = ", ".join(REGISTRY)
    p = subparsers.add_parser("export", help=f"export a checkpoint ({families}) to an ONNX model directory",
                              description=f"Export a Hugging Face-format checkpoint directory whose config.json's "
                                          f"model_type is one of {families} to a self-contained ONNX model "
                                          f"directory.")
    p.add_argument("checkpoint_dir", help="directory with config.json, model.safetensors|pytorch_model.bin, "
                                          "tokenizer.json; --task embed: a sentence-transformers folder as shipped "
                                          "(modules.json, 1_Pooling/)")
    p.add_argument("output_dir", help="model directory to write (manifest.json, encoder.onnx, ...)")
    p.add_argument("--task", required=True, choices=["qa", "classify", "mlm", "summarize", "embed"],
                   help="what the model directory serves (required; must match the checkpoint's architecture); "
                        "embed: one vector per text, pooled and normalized as the folder's sentence-transformers "
                        "modules say")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "int8"],
                   help="weights of the graphs; int8: dynamic quantization of the MatMul weights (default: fp32)")
    p.add_argument("--int8-attention", default="off",
                   choices=INT8_ATTENTION,
                   help="with --dtype int8, also run the encoder attention's two products (Q.K^T, P.V) as "
                        "MatMulInteger: dynamic = uint8 per tensor; dynamic-s8 = keys/values symmetric int8; "
                        "per-row = as dynamic-s8 with a scale per probability row; static-p = as dynamic-s8 "
                        "with the fixed probability scale 1/255 (docs/export.md, dtypes; default: off)")
    p.add_argument("--int8-weights", default="per-tensor", choices=INT8_WEIGHTS,
                   help="with --dtype int8, the dense layers' weight scales: one per matrix, or one per output "
                        "column (closer to fp32; the shipped summarizer uses it, docs/models.md) "
                        "(default: %(default)s)")
    p.add_argument("--sparse-gather", default="gather", choices=SPARSE_GATHER,
                   help="BigBird's block-sparse attention (BigBird, BigBird-Pegasus, BERT2BERT): how each query "
                        "block's key/value blocks are gathered, all exact: gather = one Gather per group of 4 "
                        "heads; all-heads = one Gather of all heads; onehot = a product with a one-hot table "
                        "(a GEMM); window = the 3-block window as slices of a shifted copy, only the other "
                        "blocks gathered (docs/gpu.md, \"The encoder's gathers\"; default: gather)")
    p.add_argument("--attention", default="sparse", choices=["sparse", "full"],
                   help="Longformer only: sparse = the checkpoint's window and global tokens; full = a benchmark "
                        "baseline, every token attends to every token with the ordinary projections (what a plain "
                        "ONNX export of Longformer runs), equal to the checkpoint's outputs only when the window "
                        "covers the whole input (docs/export.md, Longformer; default: sparse)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty output directory (default: off, a non-empty one is an error)")
    p.add_argument("--plan", default="hf-train", choices=["hf-train", "hf-eval", "seeded"],
                   help="random-block plan of the layout the runtime builds (default: hf-train, what the "
                        "public checkpoints were trained with)")
    p.set_defaults(func=_export)

    v = subparsers.add_parser("verify", help="check an exported model against PyTorch",
                              description="Run the exported graphs with ONNX Runtime and the PyTorch reference "
                                          "on random inputs; exit 1 on a mismatch.")
    v.add_argument("output_dir", help="exported model directory")
    v.add_argument("--checkpoint", required=True, help="the checkpoint directory it was exported from")
    v.add_argument("--against", default="model", choices=["model", "transformers"],
                   help="reference: our PyTorch model (default) or transformers")
    v.add_argument("--lengths", type=_lengths, default=None, metavar="N,N,...",
                   help="comma-separated sequence lengths (default: min, threshold, non-multiples, max)")
    v.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: all cores)")
    v.add_argument("--device", default="cpu", type=_device, metavar="cpu|cuda|cuda:N",
                   help="where ONNX Runtime runs the export; cuda needs onnxruntime-gpu (default: cpu)")
    v.add_argument("--allow-other-checkpoint", action="store_true",
                   help="compare with a checkpoint whose weights' sha256 differs from the one the manifest "
                        "records (default: off, a different checkpoint is an error)")
    # int8 pass criteria, one flag per Agreement field (docs/export.md, "verify")
    for flag, name, metavar, what in (
        ("--min-span-agreement", "span", "FRACTION",
         "int8 QA: best span identical to the fp32 reference in at least this fraction of rows"),
        ("--min-top3-agreement", "span_in_top", "FRACTION",
         "int8 QA: the reference's best span among the int8 top 3 in at least this fraction of rows"),
        ("--min-label-agreement", "label", "FRACTION",
         "int8 classify/MLM: label (argmax token) identical in at least this fraction"),
        ("--min-token-agreement", "tokens", "FRACTION",
         "int8 summarize: rows whose reference greedy tokens (the first --token-prefix) all rank in the export's top 3, "
         "fed the reference's own prefix, at least this fraction"),
        ("--token-prefix", "tokens_prefix", "N", "int8 summarize: how many leading greedy tokens are checked"),
    ):
        default = getattr(Agreement(), name)
        v.add_argument(flag, dest=name, type=type(default), default=default, metavar=metavar,
                       help=f"{what} (default: {default})")
    v.set_defaults(func=_verify)


def _windows(m) -> str:
    """Longformer's attention_window as the manifest gives it: one number, or one per layer."""
    windows = [2 * spec.get("band", m.block_size) for spec in m.layer_attention_specs()]
    return str(windows[0]) if len(set(windows)) == 1 else str(windows)


def _layer_kinds(m) -> str:
    """Each layer's attention in a word: "band N" (a window of N tokens each side) or its pattern."""
    return ", ".join(f"band {spec['band']}" if spec.get("band") else spec.get("pattern", "?")
                     for spec in m.layer_attention_specs())


def _device(text: str) -> str:
    """`--device cuda:1` checked by the runtime's own parser (an argparse type)."""
    from longdoc.export.runtime import parse_device

    try:
        parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _lengths(text: str) -> list[int]:
    """`--lengths 512,1024` -> [512, 1024] (an argparse type: its ValueError message is shown)."""
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts, e.g. 512,1024") from None
    if any(n < 1 for n in lengths):
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be at least 1")
    return lengths


def _export(args: argparse.Namespace) -> int:
    import time

    from longdoc.export.exporter import export_model

    start = time.perf_counter()
    m = export_model(args.checkpoint_dir, args.output_dir, args.task, dtype=args.dtype, plan=args.plan,
                     progress=lambda msg: print(f"[export] {msg}", flush=True), overwrite=args.overwrite,
                     int8_attention=args.int8_attention, attention=args.attention,
                     int8_weights=args.int8_weights, sparse_gather=args.sparse_gather)
    dtype = m.dtype if m.int8_attention == "off" else f"{m.dtype}, int8 attention {m.int8_attention}"
    print(f"exported {m.architecture} ({m.task}, {dtype}) to {args.output_dir} in "
          f"{time.perf_counter() - start:.1f} s\n"
          f"  graphs: {', '.join(m.graphs.values())}; layers {m.num_layers}, heads {m.num_heads}, "
          f"hidden {m.hidden_size}\n"
          + (f"  lengths {m.min_length}..{m.max_length}; attention longformer, window {_windows(m)} "
             f"(padded to a multiple of {m.block_size}); global tokens: {m.global_tokens}"
             if m.global_tokens != "none" else
             f"  lengths {m.min_length}..{m.max_length}; attention full over every token (benchmark baseline, "
             f"not the checkpoint's window)" if args.attention == "full" else
             f"  lengths {m.min_length}..{m.max_length}; attention per layer {_layer_kinds(m)} (padded to a "
             f"multiple of {m.block_size})" if m.layer_attention is not None else
             f"  lengths {m.min_length}..{m.max_length} (block {m.block_size}; full attention up to "
             f"{m.full_attention_max_length}); attention {m.attention.get('pattern')} plan {m.attention.get('plan')}"))
    return 0


def _verify(args: argparse.Namespace) -> int:
    import sys

    from longdoc.export.verify import VerifyError, verify_model

    agreement = Agreement(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Agreement)})
    try:
        report = verify_model(args.output_dir, args.checkpoint, against=args.against, lengths=args.lengths,
                              threads=args.threads, progress=lambda msg: print(msg, flush=True),
                              agreement=agreement, allow_other_checkpoint=args.allow_other_checkpoint,
                              device=args.device)
    except (VerifyError, RuntimeError) as exc:  # RuntimeError: --device cuda without onnxruntime-gpu
        print(f"verify: error: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0 if report.ok else 1
