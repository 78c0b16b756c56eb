"""`longdoc eval`: held-out metrics of an exported model through ONNX Runtime, beside baselines
(export/evaluate.py). Imports nothing heavy at module level."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate an exported model dir on a JSONL test set (QA: EM/F1 vs its first-512-token "
        "restriction; summarize: ROUGE vs lead baselines; classify: accuracy vs majority)",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("model_dir", nargs="?", help="exported model directory (manifest.json + ONNX)")
    p.add_argument("--data", required=True, help="JSONL test file (formats: model/data.py)")
    p.add_argument("--task", choices=["qa", "summarize", "classify"], help="default: the model's task")
    p.add_argument("--baselines-only", action="store_true", help="no model: only the model-free baselines")
    p.add_argument("--limit", type=int, help="evaluate N evenly spaced records (default: every record)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: ONNX Runtime's choice)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="summarize: generated tokens")
    p.add_argument("--num-beams", type=int, default=None,
                   help="summarize: beam width (default: the model's, as the service answers)")
    p.add_argument("--max-answer-tokens", type=int, default=128, help="qa: longest span considered")
    p.add_argument("--json", help="write the report (and predictions) to this JSON file (default: none written)")
    p.add_argument("--quiet", action="store_true", help="print only the report")
    p.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from longdoc.export.evaluate import evaluate

    if args.model_dir is None and not args.baselines_only:
        raise ValueError("give MODEL_DIR, or --baselines-only with --task")
    report, predictions = evaluate(
        None if args.baselines_only else args.model_dir, args.data, task=args.task, limit=args.limit,
        threads=args.threads, max_new_tokens=args.max_new_tokens, num_beams=args.num_beams,
        max_answer_tokens=args.max_answer_tokens, quiet=args.quiet)
    print(f"{report.task}: {report.model or '(baselines only)'} on {report.data}, {report.examples} examples, "
          f"{report.seconds:.0f} s")
    print(report.table())
    if args.json:
        from importlib.metadata import version

        # the command as typed (a figure in the docs names the command that measured it) and what scored it
        command = shlex.join(["longdoc", *sys.argv[1:]]) if Path(sys.argv[0]).name == "longdoc" else None
        metric = {"summarize": f"rouge-score {version('rouge-score')}, use_stemmer=True, F1",
                  "qa": "SQuAD v1.1 exact match / token F1", "classify": "accuracy"}[report.task]
        with open(args.json, "w") as f:
            json.dump({"task": report.task, "model": report.model, "data": report.data, "examples": report.examples,
                       "limit": args.limit, "command": command, "metric": metric, "seconds": report.seconds,
                       "rows": report.rows, "predictions": predictions}, f, indent=1)
    return 0
