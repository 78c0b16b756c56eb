"""The `longdoc` command. Each package registers its own subcommands (model: train;
export: export, verify, eval; service: serve) through an `add_commands(subparsers)` function
in its `cli` module, which must import nothing heavy at module level: `longdoc serve` runs
on machines without torch."""

from __future__ import annotations

import argparse
import importlib
import sys

# modules with add_commands(subparsers), in help order
_COMMAND_MODULES = ("longdoc.service.cli", "longdoc.export.cli", "longdoc.export.eval_cli", "longdoc.model.cli")


# which extra installs a module that a command imports (the core install has neither torch nor the service)
EXTRAS = {"torch": "torch", "onnx": "torch", "safetensors": "torch",
          "transformers": "dev", "onnxruntime": "serve", "fastapi": "serve", "uvicorn": "serve",
          "pydantic": "serve", "pydantic_settings": "serve", "prometheus_client": "serve",
          "fastapi_offline": "serve", "rouge_score": "torch"}


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help shows its default: "(default: X)" is added unless the help says it
    already (an option whose default is None says in words what unset means); a flag's is "off"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or "default" in text
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: {'off' if action.default is False else '%(default)s'})"


def build_parser() -> argparse.ArgumentParser:
    from longdoc import __version__

    parser = argparse.ArgumentParser(
        prog="longdoc", description="Long-document transformers (BigBird, BigBird-Pegasus, BERT2BERT, Longformer, LED, "
                                    "ModernBERT): train, export to ONNX, verify, evaluate, serve."
    )
    parser.add_argument("--version", action="version", version=f"longdoc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
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
    except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
        top = (exc.name or "").partition(".")[0]
        if top not in EXTRAS:
            raise
        print(f"longdoc {args.command}: error: {exc}; install longdoc[{EXTRAS[top]}] "
              f"(see README.md: Set-up)", file=sys.stderr)
        return 1
    except Exception as exc:  # a clear one-line error for users; tracebacks with LONGDOC_DEBUG=1
        import os

        if os.environ.get("LONGDOC_DEBUG"):
            raise
        print(f"longdoc {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
