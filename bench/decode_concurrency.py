"""Summaries under concurrency on the CPU (issue 24, item 1): does batched decoding beat one
request at a time? A random-weight BigBird-Pegasus with a wide decoder (d_model 512, 8 heads,
4 + 4 layers, FFN 2048, transformers' default vocabulary of 96,103), 4096 encoder tokens, served
fp32 by a real `longdoc serve`; every request asks for 32 new tokens (the eos logit is pushed to
-1e4 in the checkpoint, so every summary is 32 tokens long).

    one-token   requests for 1 new token, one at a time: the encoder and one decoder step, the
                part of a request that batching cannot share; 1 / its latency bounds the
                throughput that batched decoding can approach (five before the other runs and
                five after them: the median of the ten, as the shared machine drifts)
    alone       one client, 32-token requests, closed loop
    8 clients   clients starting 0.15 s apart, each closed loop, 32-token requests

Prints a table, writes --out/decode_concurrency-LABEL.json and .png. To measure another
checkout's code (the one before a change, say), give its venv's interpreter as --server-python.

    .venv/bin/python bench/decode_concurrency.py --work /tmp/decode-bench --out docs/decode --label device-state
    .venv/bin/python bench/decode_concurrency.py --work /tmp/decode-bench --out docs/decode --label before \
        --server-python /tmp/basevenv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from common import log

import load  # bench/load.py (the script's folder): start_server, make_document

SHAPE = dict(d_model=512, encoder_layers=2, decoder_layers=4, encoder_attention_heads=8, decoder_attention_heads=8,
             encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=4096, block_size=64,
             num_random_blocks=3, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)



def make_model(work: Path) -> Path:
    import torch
    import transformers

    from longdoc.export.exporter import export_model
    from longdoc.testing.tiny_models import tiny_tokenizer

    out = work / "model"
    if (out / "manifest.json").is_file():
        return out
    torch.manual_seed(0)
    cfg = transformers.BigBirdPegasusConfig(**SHAPE)
    model = transformers.BigBirdPegasusForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.final_logits_bias[0, cfg.eos_token_id] = -1e4  # never end early: 32 tokens each
    ckpt = work / "checkpoint"
    model.save_pretrained(ckpt)
    tiny_tokenizer().save(str(ckpt / "tokenizer.json"))  # ids below the vocabulary: enough for random weights
    export_model(ckpt, out, "summarize", dtype="fp32", progress=lambda m: log(f"export: {m}"), overwrite=True)
    return out


async def clients(url: str, docs: list[str], n_clients: int, n_requests: int, gap_s: float,
                  new_tokens: int) -> dict:
    """`n_clients` closed-loop clients, client i starting i * gap_s after the first."""
    latencies, codes, issued = [], [], 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i: int):
            nonlocal issued
            await asyncio.sleep(i * gap_s)  # the arrival schedule itself, not a synchronisation
            while issued < n_requests:
                body = {"document": docs[issued % len(docs)], "max_new_tokens": new_tokens}
                issued += 1
                t = time.perf_counter()
                r = await client.post("/v1/summarize", json=body)
                latencies.append(time.perf_counter() - t)
                codes.append(r.status_code)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n_clients)))
        wall = time.perf_counter() - start
    ok = [x for x, c in zip(latencies, codes) if c == 200]
    return {"clients": n_clients, "requests": len(codes), "ok": len(ok), "seconds": wall,
            "rps": len(ok) / wall, "p50_s": statistics.median(ok) if ok else float("nan"),
            "max_s": max(ok) if ok else float("nan"), "latencies_s": ok}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/longdoc-decode-bench"),
                   help="checkpoint and export go here, reused when present (default: /tmp/longdoc-decode-bench)")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON and the plot (default: none)")
    p.add_argument("--tokens", type=int, default=4096, help="encoder tokens per document (default: 4096)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default: 8)")
    p.add_argument("--gap", type=float, default=0.15, help="seconds between client starts (default: 0.15)")
    p.add_argument("--requests", type=int, default=32, help="requests of the concurrent run (default: 32)")
    p.add_argument("--alone", type=int, default=6, help="requests of the one-client run (default: 6)")
    p.add_argument("--label", default="this", help="names the run: --out gets decode_concurrency-LABEL.json/.png "
                   "(default: this)")
    p.add_argument("--server-python", default=sys.executable,
                   help="the interpreter that runs `longdoc serve`: another checkout's venv measures that code "
                        "(default: this interpreter)")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(a.work)
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    docs = [load.make_document(tok, a.tokens - 1, seed) for seed in range(8)]
    proc, url = load.start_server(str(model_dir), batching=True, threads=None, extra=[], python=a.server_python)
    try:
        log("warm-up")
        asyncio.run(clients(url, docs, 2, 2, 0.0, 2))
        log("one-token requests, one at a time")
        one = asyncio.run(clients(url, docs, 1, 5, 0.0, 1))
        log(f"  {one['p50_s']:.3f} s each")
        log("one client, 32-token requests")
        alone = asyncio.run(clients(url, docs, 1, a.alone, 0.0, a.new_tokens))
        log(f"  {alone['rps']:.2f} requests/s")
        log(f"{a.clients} clients, {a.gap} s apart")
        many = asyncio.run(clients(url, docs, a.clients, a.requests, a.gap, a.new_tokens))
        log(f"  {many['rps']:.2f} requests/s ({many['ok']}/{many['requests']} ok)")
        log("one-token requests again (the bound is taken from both sets: the shared machine drifts)")
        again = asyncio.run(clients(url, docs, 1, 5, 0.0, 1))
        log(f"  {again['p50_s']:.3f} s each")
    finally:
        proc.terminate()
        proc.wait(60)
    one_s = statistics.median(one["latencies_s"] + again["latencies_s"])
    bound = 1 / one_s
    result = {"label": a.label, "shape": SHAPE, "tokens": a.tokens, "new_tokens": a.new_tokens,
              "one_token_s": one_s, "one_token_s_before": one["p50_s"], "one_token_s_after": again["p50_s"],
              "bound_rps": bound, "alone": alone, "concurrent": many,
              "share_of_bound": many["rps"] / bound, "speedup_over_alone": many["rps"] / alone["rps"]}
    print(f"| run | requests/s | p50 s | share of the bound ({bound:.2f}/s = 1 / {one_s:.3f} s) |")
    print("|---|---:|---:|---:|")
    print(f"| 1 client | {alone['rps']:.2f} | {alone['p50_s']:.2f} | {alone['rps'] / bound:.0%} |")
    print(f"| {a.clients} clients, {a.gap} s apart | {many['rps']:.2f} | {many['p50_s']:.2f} | "
          f"{many['rps'] / bound:.0%} |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"decode_concurrency-{a.label}.json").write_text(json.dumps(result, indent=1) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        names = ["1 client", f"{a.clients} clients", "bound (1-token)"]
        ax.bar(names, [alone["rps"], many["rps"], bound], color=["#888", "#2a7", "#ccc"])
        ax.set_ylabel("requests/s")
        ax.set_title(f"32-token summaries of {a.tokens}-token documents, CPU")
        fig.tight_layout()
        fig.savefig(a.out / f"decode_concurrency-{a.label}.png", dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
