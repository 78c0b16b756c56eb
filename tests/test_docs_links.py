"""The README and the reference pages of docs/ link only to files that exist, and never into
docs/notes/ (the lab log, which no reference page needs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")  # [text](target#anchor)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve_and_stay_out_of_the_notes(page):
    for target, _ in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
        assert ROOT / "docs" / "notes" not in path.parents, f"{page.relative_to(ROOT)} links into the notes: {target}"


def test_the_reference_pages_are_these():
    """docs/ holds the reference pages and their results files; dated runs go to docs/notes/."""
    assert {p.name for p in (ROOT / "docs").glob("*.md")} == {
        "DESIGN.md", "service.md", "export.md", "deploy.md", "models.md", "training.md", "gpu.md", "benchmarks.md"}


LAB_HEADING = re.compile(r"^#+ .*(\b20\d\d-\d\d-\d\d\b|History|Earlier runs?|[Aa]ttempt|[Rr]e-?run|Previous run|"
                         r"[Ii]ssue \d)", re.M)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_reference_pages_have_no_lab_sections(page):
    """No dated runs, "History", "Earlier runs", "Second attempt" or re-runs: current behaviour and
    current figures only (dated work belongs in docs/notes/)."""
    assert not LAB_HEADING.findall(page.read_text()), LAB_HEADING.findall(page.read_text())


def test_the_readme_is_short():
    """The README is what a newcomer reads first: what it is, set-up, requests, where the default
    models work, bringing a checkpoint, links (issue 37). Details belong in docs/."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 150, f"README.md has {lines} lines; move details to docs/"
