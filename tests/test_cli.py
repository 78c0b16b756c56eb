"""The `longdoc` command as a newcomer meets it: help, version, errors on a bad argument."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from longdoc.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_option_has_help_that_shows_its_default(command):
    parser = _commands()[command]
    text = parser.format_help()
    assert "default: None" not in text
    for action in parser._actions:
        assert action.help, f"{command} {action.dest}: no help"
        if not action.option_strings or action.default == argparse.SUPPRESS or action.required:
            continue
        formatted = parser.formatter_class(command)._get_help_string(action) % {
            **vars(action), "default": action.default, "prog": command}
        assert formatted.count("default") == 1, f"{command} {action.option_strings[0]}: {formatted!r}"


def test_export_help_names_every_registered_architecture():
    """The families `longdoc export` takes are the registry's (ModernBERT was missing from a
    hand-written list), not a second list to keep in step."""
    from longdoc.model.registry import REGISTRY

    text = _commands()["export"].description
    assert all(model_type in text for model_type in REGISTRY), text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert re.fullmatch(r"longdoc \S+\n", capsys.readouterr().out)


def test_a_bad_list_of_lengths_says_what_is_expected(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "out", "--checkpoint", "ck", "--lengths", "abc"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "<lambda>" not in err and "'abc': expected comma-separated token counts" in err


def test_a_missing_optional_dependency_names_the_extra(monkeypatch, capsys):
    def needs_onnx(args):
        raise ModuleNotFoundError("No module named 'onnx'", name="onnx")

    parser = build_parser()
    monkeypatch.setattr("longdoc.cli.build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["export"].set_defaults(func=needs_onnx)
    assert main(["export", "ck", "out", "--task", "qa"]) == 1
    assert capsys.readouterr().err.strip() == (
        "longdoc export: error: No module named 'onnx'; install longdoc[torch] (see README.md: Set-up)")


def test_serving_a_directory_that_is_not_an_export_prints_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    run = subprocess.run([sys.executable, "-m", "longdoc", "serve", "--model", f"qa={tmp_path}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        f"longdoc serve: error: model qa: {tmp_path}/manifest.json: no manifest.json "
        f"(is {tmp_path} an exported model directory?)"]


def test_serve_without_its_extra_names_the_missing_module(monkeypatch):
    """Without the serve extra's packages, `longdoc serve` raises the ModuleNotFoundError that
    longdoc.cli turns into "install longdoc[...]", not a NameError of the handler (the except
    block's name is gone by the time the command runs)."""
    import argparse
    import sys

    from longdoc.service import cli as service_cli

    monkeypatch.setitem(sys.modules, "longdoc.service.settings", None)
    parser = argparse.ArgumentParser()
    service_cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve"])
    with pytest.raises(ModuleNotFoundError):
        args.func(args)
