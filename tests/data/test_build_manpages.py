"""The man-page data builder: rendering, QA spans with exact offsets, summaries, the split."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from data import build_manpages as B
from longdoc.model.tokenization import TokenOffsets

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


def test_sentence_span_does_not_stop_at_abbreviations():
    text = "       Do it (e.g., twice) again.  More.\n"
    s, e = B.sentence_span(text, 7)
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


# ----------------------------------------------------------------------------- the broad corpus


def test_package_list_parse_keeps_order_and_groups():
    text = """# header: what this file is
# core utilities
coreutils
grep   

# networking
iproute2
"""
    assert B.parse_package_list(text) == {"coreutils": "core utilities", "grep": "core utilities", "iproute2": "networking"}
    assert list(B.parse_package_list(text)) == ["coreutils", "grep", "iproute2"]
    with pytest.raises(ValueError, match="line 3: grep listed twice"):
        B.parse_package_list("grep\nsed\ngrep\n")
    with pytest.raises(ValueError, match="not a Debian package name"):
        B.parse_package_list("coreutils grep\n")


def test_checked_in_package_list_is_broad_and_starts_with_the_default_packages():
    listed = B.parse_package_list(B.PACKAGE_LIST.read_text())
    assert list(listed)[: len(B.PACKAGES)] == list(B.PACKAGES)  # their pages win every duplicate
    assert len(listed) >= 300 and len(set(listed.values())) >= 6


def test_deduplicate_keeps_the_first_package_copy_by_name_and_by_text():
    ls_core = B.Page(name="ls.1", section="1", text="NAME\n       ls - list\n" + "x" * 300, package="coreutils")
    ls_busy = B.Page(name="ls.1", section="1", text="NAME\n       ls - busybox ls\n", package="busybox")
    gunzip = B.Page(name="gunzip.1", section="1", text="NAME\n       gzip - compress\n", package="gzip")
    gzip = B.Page(name="gzip.1", section="1", text=gunzip.text, package="gzip")
    other = B.Page(name="printf.3", section="3", text="NAME\n       printf - format\n", package="manpages-dev")
    kept, dropped = B.deduplicate([ls_core, gunzip, ls_busy, gzip, other])
    assert kept == [ls_core, gunzip, other]
    assert dropped == [
        {"page": "ls.1", "package": "busybox", "rule": "same name", "kept_page": "ls.1", "kept_package": "coreutils"},
        {"page": "gzip.1", "package": "gzip", "rule": "same text", "kept_page": "gunzip.1", "kept_package": "gzip"},
    ]
    # the other order: the first listed package wins
    kept, _ = B.deduplicate([ls_busy, ls_core])
    assert kept == [ls_busy]


def test_split_of_a_page_does_not_depend_on_the_corpus():
    # the split is a function of the name alone: the default set's test pages (recorded in its meta)
    # are test pages of the broad corpus, and none of its training pages is
    meta = json.loads(B.CORPORA["manpages"].meta.read_text())
    test_pages = set(meta["split"]["test_pages"])
    assert len(test_pages) == meta["stats"]["pages"]["test"]["pages"]
    assert all(B.split_of(name) == "test" for name in test_pages)
    assert B.split_of("open.2") == "test" and B.split_of("ls.1") == "train"


def test_summary_pair_drops_a_table_rule_under_the_name_line():
    """Tcl's pages draw a tbl rule under NAME; it is not part of the summary (11 broad-corpus
    training summaries were 10,000 characters of underscores)."""
    text = PAGE.replace("a file\n", "a file " + "_" * 200 + "\n", 1)
    assert B.summary_pair(page(text))["summary"] == "open and possibly frobnicate a file"


def test_summary_pair_reads_mdoc_em_dash_names():
    text = PAGE.replace("demo - open and possibly", "demo \u2014 open and possibly")
    assert B.summary_pair(page(text))["summary"] == "open and possibly frobnicate a file"


def test_is_alias_sees_so_after_comments():
    assert B.is_alias(b".so man3/open.3\n")
    assert B.is_alias(b'.\\" Copyright 2024\n.\\" more\n.so man3/open.3\n')
    assert not B.is_alias(b'.\\" Copyright\n.TH OPEN 2\n.SH NAME\n.so is mentioned later\n')


MAN_SOURCE = """.TH {upper} {section} 2024-01-01 "fixture" "Fixture Manual"
.SH NAME
{name} \\- {summary}
.SH DESCRIPTION
{body}
.TP
.B \\-\\-frobnicate\\-input
Frobnicate the input before anything else happens to it.
"""


def make_deb(debs, package, version, pages):
    """A real .deb (dpkg-deb --build) holding man pages {"name.section": (summary, body)}."""
    import gzip

    root = debs.parent / "src" / package
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: {version}\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: fixture\n")
    for page, (summary, body) in pages.items():
        name, section = page.rsplit(".", 1)
        man = root / "usr/share/man" / f"man{section}"
        man.mkdir(parents=True, exist_ok=True)
        source = MAN_SOURCE.format(upper=name.upper(), section=section, name=name, summary=summary, body=body)
        (man / f"{page}.gz").write_bytes(gzip.compress(source.encode(), mtime=0))
    deb = debs / f"{package}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True)
    return deb


@pytest.mark.skipif(shutil.which("groff") is None or shutil.which("dpkg-deb") is None, reason="groff or dpkg-deb not installed")
def test_broad_build_records_versions_sha256_counts_and_duplicates(tmp_path):
    debs = tmp_path / "cache" / "debs"
    debs.mkdir(parents=True)
    long_body = "This fixture page describes a tool at enough length for the builder to keep it. " * 4
    alpha = make_deb(debs, "alpha", "1.0-1", {"tool.1": ("the alpha tool", long_body), "shared.1": ("alpha's copy", long_body),
                                               "alphalib.3": ("a library call", long_body)})
    beta = make_deb(debs, "beta", "2.5-3", {"shared.1": ("beta's copy", long_body), "betad.8": ("the beta daemon", long_body),
                                             "tcl.n": ("section n, not read", long_body)})
    plist = tmp_path / "packages.txt"
    plist.write_text("# group A\nalpha\n# group B\nbeta\n")
    out, meta_path = tmp_path / "out", tmp_path / "meta.json"
    assert B.main(["--corpus", "broad", "--packages", str(plist), "--cache", str(tmp_path / "cache"),
                   "--out", str(out), "--meta", str(meta_path), "--no-stats", "--jobs", "2"]) == 0
    meta = json.loads(meta_path.read_text())
    assert meta["packages"] == {
        "alpha": {"version": "1.0-1", "deb": alpha.name, "sha256": B.sha256(alpha), "group": "group A", "pages": 3},
        "beta": {"version": "2.5-3", "deb": beta.name, "sha256": B.sha256(beta), "group": "group B", "pages": 1},
    }
    assert meta["package_list"] == {"file": "packages.txt", "sha256": B.sha256(plist), "packages": 2}
    assert meta["failures"] == {}
    assert meta["duplicates"]["dropped"] == [
        {"page": "shared.1", "package": "beta", "rule": "same name", "kept_page": "shared.1", "kept_package": "alpha"}]
    assert "-Kutf8" in meta["renderer"]["command"]
    rows = [json.loads(line) for line in (out / "pages.jsonl").read_text().splitlines()]
    assert sorted((r["page"], r["package"], r["section"]) for r in rows) == [
        ("alphalib.3", "alpha", "3"), ("betad.8", "beta", "8"), ("shared.1", "alpha", "1"), ("tool.1", "alpha", "1")]
    assert all(r["split"] == B.split_of(r["page"]) for r in rows)
    assert set(meta["split"]["test_pages"]) == {r["page"] for r in rows if r["split"] == "test"}
    summaries = {}
    for split in ("train", "test"):
        for line in (out / f"summarize_{split}.jsonl").read_text().splitlines():
            r = json.loads(line)
            summaries[r["page"]] = (r["summary"], split)
    assert summaries["shared.1"][0] == "alpha's copy"  # the first listed package's copy
    assert {p: s for p, (_, s) in summaries.items()} == {r["page"]: r["split"] for r in rows}
    assert meta["counts"]["summarize"]["train"] + meta["counts"]["summarize"]["test"] == 4
    qa = [json.loads(line) for split in ("train", "test") for line in (out / f"qa_{split}.jsonl").read_text().splitlines()]
    assert {r["term"] for r in qa} == {"--frobnicate-input"} and len(qa) == 4

    # --reuse-pages (no download, no groff) re-derives every data set and the meta byte for byte
    first = {f.name: f.read_bytes() for f in out.iterdir()} | {"meta": meta_path.read_bytes()}
    shutil.rmtree(tmp_path / "cache")
    for f in out.iterdir():
        if f.name != "pages.jsonl":
            f.unlink()
    assert B.main(["--corpus", "broad", "--packages", str(plist), "--cache", str(tmp_path / "cache"),
                   "--out", str(out), "--meta", str(meta_path), "--no-stats", "--reuse-pages"]) == 0
    assert {f.name: f.read_bytes() for f in out.iterdir()} | {"meta": meta_path.read_bytes()} == first


def test_answer_token_end_with_a_reused_page_encoding_equals_the_pair_encoding():
    from tokenizers import Tokenizer

    # the shipped QA model's WordPiece (the same MiniLM vocabulary; the data's own tokenizer comes
    # with the `models` extra, which the tests do not install)
    tok = Tokenizer.from_file(str(Path(__file__).parents[2] / "models" / "qa" / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    context = PAGE
    for p in B.qa_pairs(page()):
        a = p["answers"][0]
        start, end = a["start"], a["start"] + len(a["text"])
        enc = tok.encode(p["question"], context)  # the pair, as a QA model reads it
        last = max(t for t, (sid, (s, e)) in enumerate(zip(enc.sequence_ids, enc.offsets)) if sid == 1 and s < end and e > start)
        reused = TokenOffsets(tok.encode(context, add_special_tokens=False).offsets)
        assert B.answer_token_end(tok, p["question"], context, start, end) == last
        assert B.answer_token_end(tok, p["question"], context, start, end, reused) == last
        assert enc.tokens[last] != "[SEP]" and a["text"].lower().endswith(enc.tokens[last].lstrip("#"))
    # an answer past the context: the whole sequence's length
    q = "What does X do?"
    assert B.answer_token_end(tok, q, "short page", 50, 60) == len(tok.encode(q, "short page").ids)


def test_summary_pair_needs_a_one_line_summary():
    one_word = PAGE.replace("demo - open and possibly frobnicate a file", "demo - DEPRECATED")
    assert B.summary_pair(page(one_word)) is None
    # a NAME section that runs into the body (its next heading not recognised) is no summary
    run_on = PAGE.replace("demo - open and possibly frobnicate a file", "demo - open it " + "and more words " * 10)
    assert len(run_on.split("\n")[1].split()) > B.MAX_SUMMARY_WORDS
    assert B.summary_pair(page(run_on)) is None
    at_limit = PAGE.replace("demo - open and possibly frobnicate a file", "demo - " + " ".join(["word"] * B.MAX_SUMMARY_WORDS))
    assert len(B.summary_pair(page(at_limit))["summary"].split()) == B.MAX_SUMMARY_WORDS


@pytest.mark.skipif(shutil.which("groff") is None or shutil.which("dpkg-deb") is None, reason="groff or dpkg-deb not installed")
def test_package_disjoint_split_keeps_a_package_on_one_side(tmp_path):
    """Issue 27: the held-out packages (packages-heldout.txt beside the package list) make the
    package-disjoint validation and test parts; a page they share with a listed package stays the
    listed package's, the page-level files are what they are without them, and --reuse-pages adds
    held-out packages to an earlier build."""
    debs = tmp_path / "cache" / "debs"
    debs.mkdir(parents=True)
    body = "This fixture page describes a tool at enough length for the builder to keep it. " * 4
    make_deb(debs, "alpha", "1.0-1", {"tool.1": ("the alpha tool", body), "shared.1": ("alpha's copy", body)})
    make_deb(debs, "zeta", "1.0-1", {"zetad.8": ("the zeta daemon", body), "zetactl.1": ("control zeta", body)})
    make_deb(debs, "delta", "3.0-1", {"delta.1": ("the delta tool", body), "shared.1": ("delta's copy", body)})
    plist = tmp_path / "packages.txt"
    plist.write_text("# group A\nalpha\n")
    common = ["--corpus", "broad", "--packages", str(plist), "--cache", str(tmp_path / "cache"), "--no-stats", "--jobs", "2"]
    # without a held-out list: the page-level build alone
    assert B.main([*common, "--out", str(tmp_path / "plain"), "--meta", str(tmp_path / "plain.json")]) == 0
    assert not (tmp_path / "plain" / "summarize_pkg-test.jsonl").exists()
    assert "package_split" not in json.loads((tmp_path / "plain.json").read_text())

    (tmp_path / "packages-heldout.txt").write_text("# held out\nzeta\ndelta\n")
    out, meta_path = tmp_path / "out", tmp_path / "meta.json"
    assert B.main([*common, "--out", str(out), "--meta", str(meta_path)]) == 0
    meta = json.loads(meta_path.read_text())
    assert B.package_part_of("zeta", {"zeta"}) == "pkg-validation" and B.package_part_of("delta", {"delta"}) == "pkg-test"
    assert B.package_part_of("alpha", {"zeta"}) == "pkg-train"
    split = meta["package_split"]
    assert split["parts"]["pkg-validation"] == {"packages": ["zeta"], "pages": 2}
    assert split["parts"]["pkg-test"] == {"packages": ["delta"], "pages": 1}  # delta's shared.1 is alpha's
    assert split["packages"]["delta"]["part"] == "pkg-test" and split["packages"]["delta"]["pages"] == 1
    assert meta["duplicates"]["dropped"][-1] == {"page": "shared.1", "package": "delta", "rule": "same name",
                                                "kept_page": "shared.1", "kept_package": "alpha"}

    def pages_of(path):
        return {json.loads(line)["page"] for line in path.read_text().splitlines()}

    assert pages_of(out / "summarize_pkg-validation.jsonl") == {"zetad.8", "zetactl.1"}
    assert pages_of(out / "summarize_pkg-test.jsonl") == {"delta.1"}
    assert pages_of(out / "qa_pkg-test.jsonl") == {"delta.1"}
    # the page-level split is the same with the held-out packages as without them
    for name in ("summarize_train.jsonl", "summarize_test.jsonl", "qa_train.jsonl", "qa_test.jsonl"):
        assert (out / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    assert meta["counts"] == json.loads((tmp_path / "plain.json").read_text())["counts"]
    rows = [json.loads(line) for line in (out / "pages.jsonl").read_text().splitlines()]
    train_packages = {r["package"] for r in rows if r["package_split"] == "pkg-train"}
    for part in ("pkg-validation", "pkg-test"):
        assert not train_packages & {r["package"] for r in rows if r["package_split"] == part}
    assert all(r["split"] is None for r in rows if r["package"] in ("zeta", "delta"))

    # --reuse-pages on the plain build reads the held-out packages it lacks: the same data sets
    shutil.copy(tmp_path / "plain.json", tmp_path / "reused.json")
    (tmp_path / "reused").mkdir()
    shutil.copy(tmp_path / "plain" / "pages.jsonl", tmp_path / "reused" / "pages.jsonl")
    assert B.main([*common, "--out", str(tmp_path / "reused"), "--meta", str(tmp_path / "reused.json"), "--reuse-pages"]) == 0
    assert json.loads((tmp_path / "reused.json").read_text())["package_split"] == split
    for f in out.iterdir():
        assert (tmp_path / "reused" / f.name).read_bytes() == f.read_bytes(), f.name
