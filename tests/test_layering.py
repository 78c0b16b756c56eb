"""The package layering of docs/DESIGN.md (import rules, issue 26): model <- export <- service;
`longdoc.testing` (tiny models, the fake worker) sits above all three and none of them imports it;
nothing outside tests/ imports from `tests`; bench scripts leave sys.path alone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# an import statement of longdoc.testing, or its name given to importlib
IMPORTS_TESTING = r"^\s*(from longdoc\.testing\b|import longdoc\.testing\b|from longdoc import testing\b)|[\"']longdoc\.testing\b"


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / f for f in out.stdout.split()]


def offenders(files: list[Path], pattern: str) -> list[str]:
    regex = re.compile(pattern, re.M)
    return [f"{f.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
            for f in files for text in [f.read_text()] for m in regex.finditer(text)]


def test_the_rules_see_the_files():
    assert len(tracked("bench/*.py")) >= 10 and len(tracked("service/*.py")) >= 10
    assert offenders([ROOT / "tests" / "conftest.py"], IMPORTS_TESTING)


def test_nothing_outside_tests_imports_from_tests():
    files = [f for f in tracked("*.py", "*.md", "*.sh", "*.yml", "*.yaml", "*.toml") if f.parts[len(ROOT.parts)] != "tests"]
    assert offenders(files, r"(from|import) tests[. ]") == []


def test_model_export_service_do_not_import_longdoc_testing():
    assert offenders(tracked("model/*.py", "export/*.py", "service/*.py"), IMPORTS_TESTING) == []


def test_bench_scripts_leave_sys_path_alone():
    assert offenders(tracked("bench/*.py"), r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=") == []


def service_imports() -> dict[str, set[str]]:
    """longdoc.service's modules -> the longdoc.service modules each imports, at module level or
    inside a function (a function-level import is still an edge a reader must follow)."""
    import ast

    modules = {".".join(("longdoc", *f.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): f
               for f in (ROOT / "service").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
        graph[name] = {e for e in edges if e in modules and e != name and e not in ("longdoc.service",)}
    return graph


def test_service_modules_import_each_other_without_a_cycle():
    graph = service_imports()
    assert {"longdoc.service.core", "longdoc.service.frontends", "longdoc.service.tasks.qa"} <= set(graph)
    assert "longdoc.service.batcher" in graph["longdoc.service.core"]  # the reader sees the edges
    done, path = set(), []

    def visit(module: str) -> None:  # depth first; a module met again on the current path closes a cycle
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
