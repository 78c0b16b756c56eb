"""LED at real size against transformers (issue 15). A script, not a test: minutes on a CPU, and
it downloads nothing.

Random-init weights (transformers, seed 0) at `LEDConfig()` (transformers' defaults: 12 + 12
layers x 1024, 16 heads, FFN 4096, vocabulary 50,265, attention_window 512, 16,384 encoder
positions; led-large-16384's shape with a smaller window) or, with --shape base, at
allenai/led-base-16384's shape (6 + 6 layers x 768, 12 heads, FFN 3072, window 1024). The
checkpoint is written by transformers and read by `longdoc.model.load_pretrained`, as a user's.

For each input length: random ids, a padded second row, the first token global (LED's recipe);
max abs difference of the encoder's last hidden state (real positions) and of the logits of a
teacher-forced 16-token decoder pass; then greedy and beam search token ids (no_repeat_ngram_size 3:
random weights alone repeat one token), ours vs
transformers' `generate(do_sample=False)` (same global_attention_mask), and the wall time of
each side. Prints a Markdown table; --out also writes it (with the command) to a file.

    .venv/bin/python bench/led_real_size.py --lengths 1024 4096 --threads 2 --out /tmp/led_real_size.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "default": {},  # LEDConfig()
    "base": dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12, decoder_attention_heads=12,
                 encoder_ffn_dim=3072, decoder_ffn_dim=3072, attention_window=1024),
}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default",
                    help="the model's shape: 'default' = LEDConfig(), 'base' = allenai/led-base-16384's (default: %(default)s)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096],
                    help="input lengths in tokens (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=8, help="generated tokens per search (default: %(default)s)")
    ap.add_argument("--beams", type=int, default=2, help="beams of the beam search (default: %(default)s)")
    ap.add_argument("--no-repeat-ngram-size", type=int, default=3,
                    help="as LED's summarization checkpoints set it; random weights otherwise repeat one token"
                         " (default: %(default)s)")
    ap.add_argument("--min-length", type=int, default=0,
                    help="total decoder length below which eos is forbidden (random weights may end at once)"
                         " (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="also write the table (Markdown) here (default: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from longdoc.model import load_pretrained

    torch.manual_seed(0)
    cfg = transformers.LEDConfig(**SHAPES[args.shape])
    hf = transformers.LEDForConditionalGeneration(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_pretrained(d)
    params = sum(p.numel() for p in hf.parameters()) / 1e6
    print(f"LEDConfig(**{SHAPES[args.shape]}): {params:.0f}M parameters, attention_window {cfg.attention_window[0]}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads", file=sys.stderr)

    rows = []
    for L in args.lengths:
        g = torch.Generator().manual_seed(L)
        ids = torch.randint(3, cfg.vocab_size, (2, L), generator=g)
        ids[:, 0] = cfg.bos_token_id
        mask = torch.ones_like(ids)
        pad = L // 8  # the second row is shorter: a padded batch
        ids[1, L - pad:] = cfg.pad_token_id
        mask[1, L - pad:] = 0
        glob = torch.zeros_like(ids)
        glob[:, 0] = 1
        dec = torch.randint(3, cfg.vocab_size, (2, 16), generator=g)
        dec[:, 0] = cfg.decoder_start_token_id
        with torch.no_grad():
            a, t_hf = timed(lambda: hf(input_ids=ids, attention_mask=mask, global_attention_mask=glob, decoder_input_ids=dec))
            b, t_ours = timed(lambda: ours(ids, mask, decoder_input_ids=dec, global_attention_mask=glob))
        enc_diff = (a.encoder_last_hidden_state - b.encoder_last_hidden_state).abs()[mask.bool()].max().item()
        logit_diff = (a.logits - b.logits).abs().max().item()
        del a, b
        searches = []
        for beams in (1, args.beams):
            kw = dict(max_new_tokens=args.new_tokens, num_beams=beams, no_repeat_ngram_size=args.no_repeat_ngram_size,
                      min_length=args.min_length)
            with torch.no_grad():
                x, tg_hf = timed(lambda: hf.generate(input_ids=ids, attention_mask=mask, global_attention_mask=glob,
                                                     do_sample=False, **kw))
                y, tg_ours = timed(lambda: ours.generate(ids, mask, global_attention_mask=glob, **kw))
            same = x.tolist() == y.tolist()
            searches.append((beams, same, tg_hf, tg_ours))
            print(f"L={L} beams={beams}: identical={same} ours {y.tolist()} transformers {x.tolist()}", file=sys.stderr)
        rows.append((L, enc_diff, logit_diff, t_hf, t_ours, searches))
        print(f"L={L}: encoder {enc_diff:.2e} logits {logit_diff:.2e} forward hf {t_hf:.1f}s ours {t_ours:.1f}s",
              file=sys.stderr)

    lines = [f"| tokens | encoder max abs diff | logits max abs diff | forward s (transformers / ours) | "
             f"greedy tokens | greedy s | beam {args.beams} tokens | beam s |",
             "|---:|---:|---:|---:|---|---:|---|---:|"]
    for L, enc_diff, logit_diff, t_hf, t_ours, searches in rows:
        cells = [str(L), f"{enc_diff:.1e}", f"{logit_diff:.1e}", f"{t_hf:.1f} / {t_ours:.1f}"]
        for _beams, same, tg_hf, tg_ours in searches:
            cells += ["identical" if same else "**DIFFER**", f"{tg_hf:.1f} / {tg_ours:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        cmd = "python bench/led_real_size.py " + " ".join(sys.argv[1:])
        args.out.write_text(
            f"# LED at real size against transformers\n\n`{cmd}`\n\n"
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; LEDConfig(**{SHAPES[args.shape]}) "
            f"({params:.0f}M parameters, attention_window {cfg.attention_window[0]}), random init (seed 0), "
            f"batch 2 (row 2 padded by L/8), first token global, {args.new_tokens} new tokens, "
            f"no_repeat_ngram_size {args.no_repeat_ngram_size}, min_length {args.min_length}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads.\n\n{table}\n")


if __name__ == "__main__":
    main()
