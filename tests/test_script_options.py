"""Every command-line option of the scripts under bench/, data/ and .ci/ says its default in its help.

The project rule (kept for the `longdoc` CLI by tests/test_cli.py) is that every option's help shows
its default. The scripts have no shared formatter and some need torch or a GPU to import, so this is a
static check of their source (`ast`, nothing imported): each `add_argument("-...")` call must be
required=True, hidden with help=argparse.SUPPRESS (an internal flag a script passes to its own child
processes), or have a help expression whose source text mentions "default" (e.g. "(default:
%(default)s)", or in words: "(default: off)", "(default: none)").
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "data" / "cache"  # git-ignored: extracted third-party packages, not the project's scripts


def _scripts() -> list[Path]:
    found = []
    for top in ("bench", "data", ".ci"):
        for folder, subfolders, files in os.walk(ROOT / top):
            subfolders[:] = [s for s in subfolders if Path(folder, s) != CACHE and s != "__pycache__"]
            found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def _undocumented(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument" and node.args and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("-")):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        required = isinstance(kw.get("required"), ast.Constant) and kw["required"].value is True
        help_text = ast.unparse(kw["help"]) if "help" in kw else ""
        if not (required or help_text == "argparse.SUPPRESS" or "default" in help_text):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[0].value}")
    return found


def test_every_script_option_has_help_that_shows_its_default():
    scripts = _scripts()
    assert len(scripts) > 10, scripts
    offending = [entry for path in scripts for entry in _undocumented(path)]
    assert not offending, ("options whose help does not show the default (add \"(default: %(default)s)\" "
                           "or say it in words):\n" + "\n".join(offending))
