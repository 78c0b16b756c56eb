"""The tokenizer of a checkpoint directory (tokenizers library; no torch, no transformers).

    load_tokenizer(directory)     -> tokenizers.Tokenizer from tokenizer.json
    special_token_ids(directory)  -> {"pad", "cls", "sep", "mask", "bos", "eos", "decoder_start"}: id or None

Special tokens are looked up by their text (from `special_tokens_map.json`, then
`tokenizer_config.json`) in the tokenizer's vocabulary, which is what the tokenizer really
emits; ids in `config.json` (`pad_token_id`, ...) fill what the tokenizer files do not name.
`decoder_start` comes from `config.json` only (encoder-decoders; Pegasus starts with pad).
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_NAME = "tokenizer.json"
SPECIAL_TOKENS = ("pad", "cls", "sep", "mask", "bos", "eos")


class TokenizerError(Exception):
    """A checkpoint directory whose tokenizer cannot be loaded; the message says why."""


def load_tokenizer(directory):
    """tokenizers.Tokenizer from `directory/tokenizer.json`."""
    from tokenizers import Tokenizer

    path = Path(directory) / TOKENIZER_NAME
    if not path.is_file():
        raise TokenizerError(
            f"{str(directory)!r} has no {TOKENIZER_NAME} (the fast-tokenizer file). Checkpoints that ship "
            "only a SentencePiece model can be converted once with transformers: "
            "AutoTokenizer.from_pretrained(dir).backend_tokenizer.save(dir + '/tokenizer.json')"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exception subclasses for malformed files
        raise TokenizerError(f"{path}: not a readable tokenizers file ({e})") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    # "[CLS]" or {"content": "[CLS]", "lstrip": false, ...} (AddedToken as saved by transformers)
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_token_ids(directory, tokenizer=None) -> dict[str, int | None]:
    """Ids of the special tokens: pad, cls, sep, mask, bos, eos, decoder_start (None = not defined)."""
    d = Path(directory)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(d)
    config = _read_json(d / "config.json")
    texts = {**_read_json(d / "tokenizer_config.json"), **_read_json(d / "special_tokens_map.json")}
    ids: dict[str, int | None] = {}
    for name in SPECIAL_TOKENS:
        text = _token_text(texts.get(f"{name}_token"))
        token_id = tokenizer.token_to_id(text) if text is not None else None
        if token_id is None:
            value = config.get(f"{name}_token_id")
            token_id = value if isinstance(value, int) and not isinstance(value, bool) else None
        ids[name] = token_id
    start = config.get("decoder_start_token_id")
    ids["decoder_start"] = start if isinstance(start, int) and not isinstance(start, bool) else None
    return ids
