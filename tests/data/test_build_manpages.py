"""The man-page data builder: rendering, QA spans with exact offsets, summaries, the split."""

import shutil

import pytest

from data import build_manpages as B

PAGE = """NAME
       demo - open and possibly frobnicate a file

SYNOPSIS
       int demo(int flags);

DESCRIPTION
       The demo() call frobnicates.  Flags follow.

   Flags
       O_FROB
              Frobnicate the file before opening it.  Later text, e.g. more.

       O_TWICE
              Do it (e.g., twice) again.  More.
       O_TWICE
              A second tag with the same term is ambiguous.

       --verbose, -v
              Print what is being done, one line per step.

       Domain
              A heading word, not a name, so no question here.

ERRORS
       EFROB  The file could not be frobnicated.
       ENOFROB
              No frobnicator is available on this system.
"""


def page(text=PAGE, name="demo.2"):
    return B.Page(name=name, section="2", text=text, package="test")


def test_qa_pairs_are_exact_spans_of_first_sentences():
    pairs = {p["term"]: p for p in B.qa_pairs(page())}
    assert set(pairs) == {"O_FROB", "--verbose", "ENOFROB"}  # O_TWICE ambiguous, Domain a word
    for p in pairs.values():
        a = p["answers"][0]
        assert p["context"][a["start"] : a["start"] + len(a["text"])] == a["text"]
    assert pairs["O_FROB"]["answers"][0]["text"] == "Frobnicate the file before opening it."
    assert pairs["O_FROB"]["question"] == "What does O_FROB do?"
    assert pairs["--verbose"]["answers"][0]["text"] == "Print what is being done, one line per step."
    assert pairs["ENOFROB"]["question"] == "What does the error ENOFROB mean?"


def test_first_sentence_does_not_stop_at_abbreviations():
    text = "       Do it (e.g., twice) again.  More.\n"
    s, e = B.first_sentence(text, 7)
    assert text[s:e] == "Do it (e.g., twice) again."


def test_summary_pair_drops_the_name_section():
    pair = B.summary_pair(page())
    assert pair["summary"] == "open and possibly frobnicate a file"
    assert "NAME" not in pair["document"] and pair["document"].startswith("SYNOPSIS")


def test_split_is_by_page_and_deterministic():
    names = [f"page{i}.3" for i in range(1000)]
    splits = [B.split_of(n) for n in names]
    assert splits == [B.split_of(n) for n in names]
    assert 50 < splits.count("test") < 150  # ~10%


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff not installed")
def test_render_puts_paragraphs_on_one_line_without_header():
    source = b""".TH DEMO 2 2024-01-01 "Linux man-pages" "System Calls Manual"
.SH NAME
demo \\- do a thing
.SH DESCRIPTION
A long paragraph that groff would normally wrap and hyphenate at eighty columns, so
it goes on and on with words such as internationalization and frobnication.
.TP
.B O_FROBNICATE
Frobnicate the file.
"""
    text = B.render(source)
    assert text.startswith("NAME\n")
    assert "System Calls Manual" not in text
    lines = text.splitlines()
    assert any(line.strip().startswith("A long paragraph") and line.rstrip().endswith("frobnication.") for line in lines)
    i = next(i for i, line in enumerate(lines) if line.strip() == "O_FROBNICATE")
    assert lines[i + 1].strip() == "Frobnicate the file."
    assert len(lines[i + 1]) - len(lines[i + 1].lstrip()) > len(lines[i]) - len(lines[i].lstrip())
