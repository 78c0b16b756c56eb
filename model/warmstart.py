"""Warm start a long-context BigBird from a shorter-context encoder checkpoint.

BigBird paper, App. E.1 ("we warm start from RoBERTa's checkpoint"): the encoder weights are
reused unchanged, since block-sparse attention has the same parameters as full attention;
only the absolute position table is too short. It is grown to the new length by copying the
learned table over and over: new row i = old row (i mod n_old), so rows i and i + n_old are equal.

Sources (Hugging Face format: config.json + model.safetensors or pytorch_model.bin):
- model_type "bert" (e.g. sentence-transformers' all-MiniLM-L6-v2, a bare `BertModel` whose
  keys have no "bert." prefix): the layer names are BigBird's already; the renames are the
  "bert." prefix and the pooler (BERT `pooler.dense.*` -> BigBird `bert.pooler.*`, a bare Linear).
- model_type "roberta": prefix "roberta." -> "bert.", the `lm_head.*` -> `cls.predictions.*`,
  and RoBERTa's first two position rows dropped (its positions start at padding_idx + 1 = 2;
  BigBird's start at 0).
- model_type "big_bird": only the position table grows.

Buffers (`position_ids`, `token_type_ids`) and heads BigBird has no place for (BERT's
next-sentence head) are dropped and listed. The result is written as config.json +
model.safetensors (+ the tokenizer files, without the tokenizer.json's truncation/padding
settings, which would cut documents at the old length) and `warmstart.json` recording what
was done. Architecture: `BigBirdForMaskedLM` when the source has an MLM head, else `BigBirdModel`;
`longdoc train` adds a task head to either.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
)
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "NOTICE")

# config fields copied unchanged from the source encoder
_SHARED_CONFIG = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "type_vocab_size",
    "initializer_range",
    "layer_norm_eps",
    "pad_token_id",
)


class WarmStartError(ValueError):
    pass


def _rename(key: str, model_type: str) -> str | None:
    """Source key -> BigBird key (None: drop)."""
    if key.endswith(("position_ids", "token_type_ids")) and ".embeddings." in f".{key}":
        return None  # buffers, rebuilt by the model
    prefix = {"bert": "bert.", "roberta": "roberta.", "big_bird": "bert."}[model_type]
    if key.startswith(prefix):
        key = key[len(prefix) :]
    elif model_type == "roberta" and key.startswith("lm_head."):
        rest = key[len("lm_head.") :]
        rest = {
            "dense.weight": "transform.dense.weight",
            "dense.bias": "transform.dense.bias",
            "layer_norm.weight": "transform.LayerNorm.weight",
            "layer_norm.bias": "transform.LayerNorm.bias",
        }.get(rest, rest)
        return f"cls.predictions.{rest}"
    elif key.startswith("cls.predictions."):
        return key
    elif key.startswith(("cls.", "classifier.", "qa_outputs.", "lm_head.")):
        return None  # a head BigBird has no counterpart for
    if key.startswith(("embeddings.", "encoder.")):
        return f"bert.{key}"
    if key.startswith("pooler."):
        # BERT's pooler is a module with .dense; BigBird's is the Linear itself
        return "bert." + key.replace("pooler.dense.", "pooler.")
    return None


def warm_start(
    source: str | Path,
    destination: str | Path,
    max_length: int = 4096,
    *,
    block_size: int = 64,
    num_random_blocks: int = 3,
    attention_type: str = "block_sparse",
) -> dict:
    """Write a BigBird checkpoint dir at `destination` from the encoder at `source`, its position
    table tiled up to `max_length`. Returns the record also written to warmstart.json."""
    import torch
    from safetensors.torch import save_file

    source, destination = Path(source), Path(destination)
    config_path = source / "config.json"
    if not config_path.is_file():
        raise WarmStartError(f"{source}: no config.json")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type not in ("bert", "roberta", "big_bird"):
        raise WarmStartError(f"{config_path}: model_type {model_type!r} is not bert, roberta or big_bird")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise WarmStartError(f"{config_path}: position_embedding_type must be 'absolute'")
    if max_length % block_size:
        raise WarmStartError(f"max_length {max_length} must be a multiple of block_size {block_size}")

    from longdoc.model.checkpoint import read_state_dict

    state = read_state_dict(source)
    names = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    weights_path = next(source / n for n in names if (source / n).is_file())
    out: dict[str, torch.Tensor] = {}
    dropped = []
    for key, tensor in state.items():
        new = _rename(key, model_type)
        if new is None:
            dropped.append(key)
        else:
            out[new] = tensor.detach().to(torch.float32).contiguous().clone()
    position_key = "bert.embeddings.position_embeddings.weight"
    if position_key not in out:
        raise WarmStartError(f"{weights_path}: no position embeddings (expected {position_key!r} after renaming)")
    old = out[position_key]  # (n_old, hidden)
    if model_type == "roberta":
        old = old[2:]  # RoBERTa's rows 0, 1 are unused (padding_idx = 1, positions start at 2)
    n_old = old.shape[0]
    repeats = -(-max_length // n_old)
    out[position_key] = old.repeat(repeats, 1)[:max_length].contiguous()  # (max_length, hidden)

    initialised = []
    if "bert.pooler.weight" not in out:
        # BigBird's encoder has a pooler, RoBERTa's MLM checkpoints do not: BERT init, seeded
        hidden = config["hidden_size"]
        generator = torch.Generator().manual_seed(0)
        std = config.get("initializer_range", 0.02)
        out["bert.pooler.weight"] = torch.randn(hidden, hidden, generator=generator) * std
        out["bert.pooler.bias"] = torch.zeros(hidden)
        initialised = ["bert.pooler.weight", "bert.pooler.bias"]
    has_mlm_head = any(k.startswith("cls.predictions.") for k in out)
    if has_mlm_head:
        # tied to the word embeddings in BigBirdForMaskedLM; written out so every key is present
        out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"].clone()
        if "cls.predictions.bias" in out:
            out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"].clone()

    tokenizer = _token_ids(source)
    new_config = {k: config[k] for k in _SHARED_CONFIG if k in config}
    new_config.update(
        model_type="big_bird",
        architectures=["BigBirdForMaskedLM" if has_mlm_head else "BigBirdModel"],
        max_position_embeddings=max_length,
        attention_type=attention_type,
        block_size=block_size,
        num_random_blocks=num_random_blocks,
        use_bias=True,
        rescale_embeddings=False,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.get("cls", config.get("bos_token_id")),
        eos_token_id=tokenizer.get("sep", config.get("eos_token_id")),
        sep_token_id=tokenizer.get("sep", config.get("sep_token_id")),
    )
    if model_type == "roberta":
        new_config["type_vocab_size"] = max(new_config.get("type_vocab_size", 1), 1)

    if not has_mlm_head:
        # a bare BigBirdModel: transformers writes its keys without the "bert." prefix
        out = {k.removeprefix("bert."): v for k, v in out.items()}
    destination.mkdir(parents=True, exist_ok=True)
    save_file(out, str(destination / "model.safetensors"), metadata={"format": "pt"})
    (destination / "config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
    copied = _copy_tokenizer(source, destination, max_length)
    for name in LICENSE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)
    record = {
        "source": str(source),
        "source_model_type": model_type,
        "source_weights_sha256": hashlib.sha256(weights_path.read_bytes()).hexdigest(),
        "source_positions": n_old,
        "max_length": max_length,
        "position_rule": f"row i = source row (i mod {n_old})",
        "dropped_keys": sorted(dropped),
        "initialised_keys": initialised,
        "tokenizer_files": copied,
    }
    (destination / "warmstart.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _token_ids(source: Path) -> dict[str, int]:
    """[CLS]/[SEP] (or <s>/</s>) ids from the source's tokenizer.json, if it has one."""
    path = source / "tokenizer.json"
    if not path.is_file():
        return {}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    ids = {}
    for name, candidates in (("cls", ("[CLS]", "<s>")), ("sep", ("[SEP]", "</s>"))):
        for token in candidates:
            if tok.token_to_id(token) is not None:
                ids[name] = tok.token_to_id(token)
                break
    return ids


def _copy_tokenizer(source: Path, destination: Path, max_length: int) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        path = source / name
        if not path.is_file():
            continue
        if name == "tokenizer.json":
            data = json.loads(path.read_text(encoding="utf-8"))
            data["truncation"] = None  # sentence-transformers ships truncation/padding at 128
            data["padding"] = None
            (destination / name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        elif name == "tokenizer_config.json":
            data = json.loads(path.read_text(encoding="utf-8"))
            data["model_max_length"] = max_length
            (destination / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(path, destination / name)
        copied.append(name)
    return copied


# ----------------------------------------------------------------------------------------------
# BERT2BERT: an encoder-decoder warm started from one checkpoint (BigBird paper App. E.5, after
# Rothe et al. 2020): the encoder is `warm_start`'s BigBird, the decoder the same weights as a BERT
# decoder (causal self-attention, same embeddings and MLM head), its cross-attention fresh.


CROSS_ATTENTION_INITS = ("fresh", "self")


def warm_start_encoder_decoder(
    source: str | Path,
    destination: str | Path,
    max_length: int = 4096,
    *,
    decoder_max_length: int | None = None,
    block_size: int = 64,
    num_random_blocks: int = 3,
    attention_type: str = "block_sparse",
    seed: int = 0,
    cross_attention: str = "fresh",
) -> dict:
    """Write a transformers `EncoderDecoderModel` checkpoint (big_bird encoder, bert decoder) at
    `destination`: `warm_start` writes the encoder (positions tiled to `max_length`), then the
    decoder gets the same embeddings, layers and MLM head, positions tiled to
    `decoder_max_length` (default: the source's table size) by the same rule. Cross-attention
    (and an MLM head the source lacks) are BERT-initialised from `seed`. Special tokens, the
    BERT2BERT way: decoder start = [CLS] (or <s>), eos = [SEP] (or </s>), pad = the source's pad.
    cross_attention (CROSS_ATTENTION_INITS): "fresh" = BERT init, as Rothe et al.; "self" = each
    decoder layer's cross-attention starts as a copy of its own self-attention (query, key, value,
    output and its LayerNorm), so that from the first step its scores over the document have the
    spread of the source's attention instead of being nearly uniform (a fresh one gives every page
    the same average, and the decoder learns to ignore it). Returns the record written to
    warmstart.json."""
    if cross_attention not in CROSS_ATTENTION_INITS:
        raise WarmStartError(f"cross_attention must be one of {', '.join(CROSS_ATTENTION_INITS)}, got {cross_attention!r}")
    import torch
    from safetensors.torch import load_file, save_file

    from longdoc.model.encoder_decoder import EncoderDecoderConfig, EncoderDecoderModel

    destination = Path(destination)
    record = warm_start(source, destination, max_length, block_size=block_size,
                        num_random_blocks=num_random_blocks, attention_type=attention_type)
    encoder_config = json.loads((destination / "config.json").read_text())
    state = {k.removeprefix("bert."): v for k, v in load_file(str(destination / "model.safetensors")).items()}
    n_dec = record["source_positions"] if decoder_max_length is None else decoder_max_length
    if n_dec > max_length:
        raise WarmStartError(f"decoder_max_length {n_dec} exceeds max_length {max_length}")
    # the encoder table is the source's tiled to max_length; its first rows are the decoder's tiled to n_dec
    positions = state["embeddings.position_embeddings.weight"][:n_dec].clone()

    decoder_config = {k: encoder_config[k] for k in _SHARED_CONFIG if k in encoder_config}
    decoder_config.update(model_type="bert", max_position_embeddings=n_dec, is_decoder=True, add_cross_attention=True,
                          tie_word_embeddings=True, bos_token_id=encoder_config.get("bos_token_id"),
                          eos_token_id=encoder_config.get("eos_token_id"))
    encoder_config.pop("architectures", None)
    config = EncoderDecoderConfig.from_dict({
        "model_type": "encoder-decoder", "encoder": encoder_config, "decoder": decoder_config,
        "decoder_start_token_id": encoder_config.get("bos_token_id"), "eos_token_id": encoder_config.get("eos_token_id"),
        "pad_token_id": encoder_config.get("pad_token_id", 0)})
    torch.manual_seed(seed)  # the fresh parts: BERT init (EncoderDecoderModel's constructor)
    model = EncoderDecoderModel(config)
    out = {f"encoder.{k}": v for k, v in state.items() if not k.startswith("cls.")}
    for k, v in state.items():
        if k.startswith(("embeddings.", "encoder.")):
            out[f"decoder.bert.{k}"] = v.clone()
        elif k.startswith("cls.predictions.") and not k.startswith("cls.predictions.decoder."):
            out[f"decoder.{k}"] = v.clone()  # the MLM head; its decoder weight is the tied embedding
    out["decoder.bert.embeddings.position_embeddings.weight"] = positions
    if cross_attention == "self":
        for k in [k for k in out if k.startswith("decoder.bert.encoder.layer.") and ".attention." in k]:
            out[k.replace(".attention.", ".crossattention.", 1)] = out[k].clone()
    own = model.state_dict()
    fresh = sorted(k for k in own if k not in out and k not in model.tied_weights())
    for k in fresh:
        out[k] = own[k].detach().clone()
    from longdoc.model.checkpoint import load_state_dict_strict

    load_state_dict_strict(model, out, source=str(destination))  # every key and shape accounted for
    save_file({k: v.contiguous() for k, v in out.items()}, str(destination / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = ["EncoderDecoderModel"]
    (destination / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    record.update(architecture="EncoderDecoderModel", decoder_max_length=n_dec,
                  decoder_position_rule=f"row i = source row (i mod {record['source_positions']})",
                  initialised_keys=[f"encoder.{k.removeprefix('bert.')}" for k in record["initialised_keys"]] + fresh,
                  seed=seed, cross_attention=cross_attention)
    (destination / "warmstart.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
