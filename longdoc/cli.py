"""The `longdoc` command. Each package registers its own subcommands (model: train;
export: export, verify, eval; service: serve) through an `add_commands(subparsers)` function
in its `cli` module, which must import nothing heavy at module level: `longdoc serve` runs
on machines without torch."""

from __future__ import annotations

import argparse
import importlib
import sys

# modules with add_commands(subparsers), in help order; a module not written yet is skipped.
_COMMAND_MODULES = ("service.cli", "export.cli", "export.eval_cli", "model.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longdoc", description="Long-document BigBird models: train, export to ONNX, verify, evaluate, serve."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a package not written yet
            if exc.name != name:
                raise
            continue
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear one-line error for users; tracebacks with LONGDOC_DEBUG=1
        import os

        if os.environ.get("LONGDOC_DEBUG"):
            raise
        print(f"longdoc {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
