"""Whole-document embeddings against truncated ones: does a sentence from deep inside a long manual
page find its page? (issue 39)

The pages are the package-disjoint test pages of the broad man-page corpus (data/build_manpages.py
step 5b: the pkg-test packages of data/packages-heldout.txt, deduplicated as its meta file records),
built here offline from the Debian packages (downloaded once into data/cache/ by apt-get, as
data/build_manpages.py does; nothing else is fetched). A page is the summarization document (the
page without its NAME section). Long pages: at least --min-tokens tokens. Queries: up to
--per-page sentences of each long page (8 to 40 words) that start past its first --deep tokens,
chosen by sha1 (deterministic). Every query is embedded as a text of its own, every long page whole;
recall@1 is the share of queries whose nearest page (cosine) is their own.

The page vectors come from one pass over every window of every page (`longdoc.export.windows`
embed_windows, the service's windows; the model's graph pools each window), pooled into one vector
per page several ways: the service's (`pool_window_embeddings`), its alternatives, and the first
window alone (what `truncate: true` and a server that truncates give). Writes a results JSON (the
figures docs/models.md reads).

    .venv/bin/python -m data.embed_retrieval --model models/embed --out docs/results/embed-retrieval.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from data import build_manpages as B

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
_SENTENCE = re.compile(r"[A-Z][^.!?]*[.!?](?=\s|$)")


def test_pages() -> list[tuple[str, str, str]]:
    """(package, page name, document) of every package-disjoint test page, as data/build_manpages.py
    builds them: the pkg-test packages' pages, less the copies its meta file records as dropped."""
    heldout = B.parse_package_list((ROOT / "data" / B.HELDOUT_LIST_NAME).read_text())
    packages = tuple(p for p in heldout if B.package_part_of(p, heldout) == "pkg-test")
    meta = json.loads(B.CORPORA["broad"].meta.read_text())
    dropped = {(d["package"], d["page"]) for d in meta["duplicates"]["dropped"]}
    infos = B.download(packages, B.CACHE, {})
    out = []
    for package, info in infos.items():
        root = B.extract(package, info["deb"], B.CACHE)
        pages = [p for p in B.read_pages(root, package, B.CORPORA["broad"].groff_args, {}, jobs=2)
                 if (package, p.name) not in dropped]
        pages, _ = B.deduplicate(pages)
        expected = meta["package_split"]["packages"][package]["pages"]
        if len(pages) != expected:
            log(f"note: {package}: {len(pages)} pages, the meta file records {expected}")
        for page in pages:
            pair = B.summary_pair(page)
            if pair is not None:
                out.append((package, page.name, pair["document"]))
    return out


def deep_sentences(text: str, offsets: list[tuple[int, int]], deep: int, per_page: int, key: str) -> list[str]:
    """Up to `per_page` sentences of 8 to 40 words that start past token `deep`, by sha1 order."""
    start_char = offsets[deep][0] if len(offsets) > deep else len(text)
    found = []
    for m in _SENTENCE.finditer(text):
        sentence = " ".join(m.group().split())
        if m.start() >= start_char and 8 <= len(sentence.split()) <= 40:
            found.append(sentence)
    found = sorted(set(found), key=lambda s: hashlib.sha1(f"{key}\n{s}".encode()).hexdigest())
    return found[:per_page]


def window_vectors(model, windows: list[tuple[int, ...]], batch: int = 16) -> np.ndarray:
    """The graph's pooled vector of each window, (n, E), batched by similar length."""
    order = sorted(range(len(windows)), key=lambda i: len(windows[i]))
    out = np.zeros((len(windows), model.manifest.hidden_size), np.float32)
    pad = model.manifest.special_tokens["pad"]
    for a in range(0, len(order), batch):
        rows = order[a : a + batch]
        S = max(len(windows[i]) for i in rows)
        ids = np.full((len(rows), S), pad, np.int64)
        mask = np.zeros((len(rows), S), np.int64)
        for r, i in enumerate(rows):
            ids[r, : len(windows[i])] = windows[i]
            mask[r, : len(windows[i])] = 1
        out[rows] = model.run_encoder(ids, mask)["embedding"]
    return out


def recall_at_1(queries: np.ndarray, pages: np.ndarray, truth: np.ndarray) -> float:
    from longdoc.export.windows import unit

    scores = unit(queries) @ unit(pages).T  # (Q, P) cosine
    return float((scores.argmax(axis=1) == truth).mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/embed", help="exported embed model directory (default: %(default)s)")
    p.add_argument("--min-tokens", type=int, default=1024, help="a long page's tokens at least (default: %(default)s)")
    p.add_argument("--deep", type=int, default=512, help="queries start past this token (default: %(default)s)")
    p.add_argument("--per-page", type=int, default=3, help="queries per page at most (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default: %(default)s)")
    p.add_argument("--out", default=None, help="results JSON to write (default: none written)")
    args = p.parse_args(argv)

    from longdoc.export import windows as W
    from longdoc.export.runtime import OnnxModel

    model = OnnxModel(args.model, threads=args.threads)
    m, sp = model.manifest, model.manifest.special_tokens
    log("building the package-disjoint test pages (data/build_manpages.py's steps, offline once downloaded)")
    pages = test_pages()
    long_pages, queries, truth = [], [], []
    for package, name, text in pages:
        enc = model.tokenizer.encode(text, add_special_tokens=False)
        if len(enc.ids) < args.min_tokens:
            continue
        sentences = deep_sentences(text, enc.offsets, args.deep, args.per_page, name)
        if not sentences:
            continue
        long_pages.append((package, name, enc.ids))
        queries += sentences
        truth += [len(long_pages) - 1] * len(sentences)
    log(f"{len(pages)} test pages; {len(long_pages)} of >= {args.min_tokens} tokens with queries; "
        f"{len(queries)} queries")

    t = time.monotonic()
    per_page = [W.embed_windows(ids, m.max_length, sp["cls"], sp["sep"]) for _, _, ids in long_pages]
    flat = window_vectors(model, [w for ws in per_page for w in ws])
    query_vecs = window_vectors(model, [W.embed_windows(model.tokenizer.encode(q, add_special_tokens=False).ids,
                                                        m.max_length, sp["cls"], sp["sep"], truncate=True)[0]
                                        for q in queries])
    seconds = time.monotonic() - t
    normalize = m.embedding["normalize"]
    poolings = {  # name -> page vector from its windows' vectors (n, E) and their real tokens (n,)
        "service": lambda v, n: W.pool_window_embeddings(list(v), normalize),
        "mean of unit window vectors": lambda v, n: W.unit(v).mean(axis=0),
        "token-weighted mean of window vectors": lambda v, n: (v * n[:, None]).sum(axis=0) / n.sum(),
        "max over window vectors": lambda v, n: v.max(axis=0),
        "first window (truncate)": lambda v, n: v[0],
    }
    results, i = {name: [] for name in poolings}, 0
    for ws in per_page:
        v, n = flat[i : i + len(ws)], np.array([len(w) - 2 for w in ws], np.float64)
        i += len(ws)
        for name, pool in poolings.items():
            results[name].append(pool(v, n))
    truth_a = np.array(truth)
    recall = {name: recall_at_1(query_vecs, np.stack(vs), truth_a) for name, vs in results.items()}
    for name, r in recall.items():
        print(f"recall@1 {r:.3f}  {name}")
    windows = [len(ws) for ws in per_page]
    report = {
        "command": ".venv/bin/python -m data.embed_retrieval " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": str(args.model),
        "dtype": m.dtype, "window": m.max_length, "pages": len(long_pages), "test_pages": len(pages),
        "queries": len(queries), "min_tokens": args.min_tokens, "deep": args.deep, "per_page": args.per_page,
        "windows_per_page": {"min": min(windows), "median": float(np.median(windows)), "max": max(windows)},
        "recall_at_1": recall, "pooled": recall["service"], "truncated": recall["first window (truncate)"],
        "seconds": round(seconds, 1),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
