"""docs/service.md's settings table names every field of `Settings` (service/settings.py), and its
file table every module of service/, and nothing else: a setting or module added, renamed or
removed without the docs fails here."""

from __future__ import annotations

import re
from pathlib import Path

from longdoc.service.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "service.md"


def documented_settings(text: str) -> list[str]:
    """The names in the first column of the table headed `| setting | default | meaning |`
    (a row may name several: `` `a` / `b` ``)."""
    lines = text.splitlines()
    start = lines.index("| setting | default | meaning |") + 2  # past the header and |---|
    names = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names += re.findall(r"`(\w+)`", line.split("|")[1])
    return names


def test_the_settings_table_names_every_setting_once():
    documented = documented_settings(DOC.read_text())
    assert len(documented) == len(set(documented)), sorted(n for n in documented if documented.count(n) > 1)
    fields = set(Settings.model_fields)
    assert not fields - set(documented), f"settings missing from docs/service.md's table: {sorted(fields - set(documented))}"
    assert not set(documented) - fields, f"docs/service.md's table names no such setting: {sorted(set(documented) - fields)}"


def test_a_row_is_read_whatever_it_groups():
    table = ("| setting | default | meaning |\n|---|---|---|\n| `a` / `b` | 1 / 2 | `not_a_name` here |\n"
             "| `c` | x | y |\n\nafter the table: `d`\n")
    assert documented_settings(table) == ["a", "b", "c"]


def test_the_file_table_names_every_module_of_the_service():
    """The table at the top of docs/service.md names every module of service/."""
    text = DOC.read_text()
    table = text[text.index("| file | what |"):text.index("\n\n", text.index("| file | what |"))]
    service = DOC.parents[1] / "service"
    modules = {str(p.relative_to(service.parent)) for p in service.glob("*.py") if p.name != "__init__.py"}
    named = set(re.findall(r"`(service/\w+\.py)`", table))
    assert not modules - named, f"docs/service.md's file table lacks {sorted(modules - named)}"
    assert not named - modules, f"docs/service.md's file table names no such module: {sorted(named - modules)}"
