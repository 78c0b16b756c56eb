"""The tokenizer of a checkpoint directory (tokenizers library; no torch, no transformers).

    load_tokenizer(directory)     -> tokenizers.Tokenizer from tokenizer.json
    convert_tokenizer(directory)  -> tokenizers.Tokenizer from the files a public checkpoint ships
                                     instead (SLOW_TOKENIZER_FILES; needs transformers, at export)
    special_token_ids(directory)  -> {"pad", "cls", "sep", "mask", "bos", "eos", "decoder_start"}: id or None
                                     (the one table of special tokens: the exporter writes it into the manifest)
    special_token_mismatches      -> where the config's ids of the tokens a model reads are not its tokenizer's
    encode_within(tok, text, limit) -> a document's ids and offsets, tokenized only until `limit` is passed
    summarize_window, qa_room     -> the summarize input and the QA window's room for the document
    TokenOffsets(offsets)         -> the tokens a character span covers (answers' characters to tokens)

Special tokens are looked up by their text (from `special_tokens_map.json`, then
`tokenizer_config.json`) in the tokenizer's vocabulary, which is what the tokenizer really
emits; ids in `config.json` (`pad_token_id`, ...) fill what the tokenizer files do not name, then
the vocabulary's conventional texts. `decoder_start` comes from `config.json`, else pad.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_NAME = "tokenizer.json"
SPECIAL_TOKENS = ("pad", "cls", "sep", "mask", "bos", "eos")


class TokenizerError(Exception):
    """A checkpoint directory whose tokenizer cannot be loaded; the message says why."""


# The tokenizer files the public checkpoints of each family ship instead of tokenizer.json
# (google/bigbird-*, google/bigbird-pegasus-*, allenai/longformer-*, allenai/led-*, BERT models)
SLOW_TOKENIZER_FILES = {
    "spiece.model": "BigBird, BigBird-Pegasus (SentencePiece)",
    "vocab.json + merges.txt": "Longformer, LED (byte-level BPE)",
    "vocab.txt": "BERT, a BERT2BERT decoder (WordPiece)",
}
# converted tokenizers must give the checkpoint's own tokenizer's ids on these
SAMPLE_TEXTS = ("The quick brown fox jumps over the lazy dog.",
                "Long documents: 4,096 tokens, café naïve -- chown(2) changes the owner of a file!",
                "  spaces   and\ttabs, UPPER and lower, 3.14 %$# <s> [SEP]")


def tokenizer_class(directory) -> str:
    """The transformers class that reads the checkpoint's tokenizer: tokenizer_config.json's
    `tokenizer_class` (AutoTokenizer goes by config.json's model_type, and transformers 5 maps
    bigbird_pegasus to no SentencePiece class), else AutoTokenizer."""
    name = _read_json(Path(directory) / "tokenizer_config.json").get("tokenizer_class")
    return name.removesuffix("Fast") if isinstance(name, str) and name.isidentifier() else "AutoTokenizer"


def convert_command(directory) -> str:
    """The one command that writes `directory/tokenizer.json` from a checkpoint's other tokenizer
    files (needs transformers, and sentencepiece for spiece.model)."""
    d, cls = str(directory), tokenizer_class(directory)
    return (f"python -c \"from transformers import {cls}; {cls}.from_pretrained({d!r})"
            f".backend_tokenizer.save({d + '/' + TOKENIZER_NAME!r})\"")


def slow_tokenizer_files(directory) -> list[str]:
    """The names of SLOW_TOKENIZER_FILES found complete in `directory` (e.g. ["vocab.json + merges.txt"])."""
    d = Path(directory)
    return [names for names in SLOW_TOKENIZER_FILES if all((d / n).is_file() for n in names.split(" + "))]


def _no_tokenizer_json(directory, why: str) -> str:
    needs = "; ".join(f"{files} ({family})" for files, family in SLOW_TOKENIZER_FILES.items())
    return (f"{str(directory)!r} has no {TOKENIZER_NAME} (the fast-tokenizer file); {why}. The tokenizer files each "
            f"family needs: {TOKENIZER_NAME}, or {needs}. Make {TOKENIZER_NAME} once with transformers and "
            f"sentencepiece installed (pip install 'transformers>=4.44' 'sentencepiece>=0.2'): "
            f"{convert_command(directory)}")


def load_tokenizer(directory):
    """tokenizers.Tokenizer from `directory/tokenizer.json`."""
    from tokenizers import Tokenizer

    path = Path(directory) / TOKENIZER_NAME
    if not path.is_file():
        found = slow_tokenizer_files(directory)
        raise TokenizerError(_no_tokenizer_json(directory, f"found {', '.join(found)}" if found
                                                else "nor any other tokenizer file"))
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exception subclasses for malformed files
        raise TokenizerError(f"{path}: not a readable tokenizers file ({e})") from None


def convert_tokenizer(directory):
    """tokenizers.Tokenizer equivalent to the checkpoint's own tokenizer, built by transformers from
    the files a checkpoint without tokenizer.json ships (SLOW_TOKENIZER_FILES), and checked: its ids
    on SAMPLE_TEXTS (alone and as a pair) equal the checkpoint's tokenizer's. TokenizerError names
    the files found and the command that makes tokenizer.json where it cannot convert."""
    from tokenizers import Tokenizer

    found = slow_tokenizer_files(directory)
    if not found:
        listing = ", ".join(sorted(p.name for p in Path(directory).iterdir())) or "nothing"
        raise TokenizerError(_no_tokenizer_json(directory, f"found no tokenizer files (the directory holds {listing})"))
    try:
        import transformers
        if "spiece.model" in found:
            import sentencepiece  # noqa: F401  (transformers' SentencePiece converter reads the model with it)
    except ImportError as exc:
        raise TokenizerError(_no_tokenizer_json(
            directory, f"found {', '.join(found)}, which export converts only where transformers and sentencepiece "
                       f"are installed ({exc})")) from None
    try:
        theirs = getattr(transformers, tokenizer_class(directory)).from_pretrained(str(directory))
        backend = theirs.backend_tokenizer
    except Exception as exc:  # transformers raises many kinds for unreadable or unknown files
        raise TokenizerError(_no_tokenizer_json(directory, f"found {', '.join(found)}, but transformers cannot "
                                                           f"convert them ({type(exc).__name__}: {exc})")) from None
    converted = Tokenizer.from_str(backend.to_str())  # what serving loads from the written file
    for text in SAMPLE_TEXTS:
        for args in ((text,), (text, SAMPLE_TEXTS[0])):
            want = theirs(*args)["input_ids"]
            got = converted.encode(*args).ids
            if got != want:
                raise TokenizerError(f"{directory}: the tokenizer converted from {', '.join(found)} gives other ids "
                                     f"than the checkpoint's own on {args!r}: {got[:12]} vs {want[:12]}; make "
                                     f"{TOKENIZER_NAME} yourself: {convert_command(directory)}")
    return converted


def _read_json(path: Path) -> dict:
    """A tokenizer or model config file, {} when there is none (`longdoc.model.config.read_json_object`)."""
    from longdoc.model.config import read_json_object

    return read_json_object(path, TokenizerError, missing={})


def _token_text(value) -> str | None:
    # "[CLS]" or {"content": "[CLS]", "lstrip": false, ...} (AddedToken as saved by transformers)
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


# candidates by text when neither the tokenizer files nor the config name a token
VOCABULARY_GUESSES = {
    "cls": ("[CLS]", "<s>"),
    "sep": ("[SEP]", "</s>"),
    "pad": ("[PAD]", "<pad>"),
    "mask": ("[MASK]", "<mask>", "<mask_1>", "<mask_2>"),
    "eos": ("</s>", "[SEP]"),
}


def _config_id(config: dict, key: str) -> int | None:
    value = config.get(key)
    value = value[0] if isinstance(value, list) and value else value  # eos_token_id may be a list
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def named_token_ids(directory, tokenizer) -> dict[str, tuple[str, int]]:
    """The special tokens the tokenizer files name (special_tokens_map.json over
    tokenizer_config.json) and its vocabulary holds: {"sep": ("[SEP]", 4), ...}."""
    d = Path(directory)
    texts = {**_read_json(d / "tokenizer_config.json"), **_read_json(d / "special_tokens_map.json")}
    named = {}
    for name in SPECIAL_TOKENS:
        text = _token_text(texts.get(f"{name}_token"))
        token_id = tokenizer.token_to_id(text) if text is not None else None
        if token_id is not None:
            named[name] = (text, token_id)
    return named


def special_token_ids(directory=None, tokenizer=None, config: dict | None = None) -> dict[str, int | None]:
    """The one table of special-token ids: pad, cls, sep, mask, bos, eos, decoder_start (None =
    not defined). Resolved in this order: the token texts the tokenizer files name
    (`named_token_ids`), the config's `*_token_id` (`config`, else the directory's config.json),
    then the vocabulary's conventional texts (`VOCABULARY_GUESSES`: BERT configs name no [CLS]).
    `decoder_start` comes from the config, else pad (Pegasus starts decoding with pad). The
    exporter writes this table into the manifest; nothing downstream patches it."""
    d = Path(directory) if directory is not None else None
    if tokenizer is None:
        if d is None:
            raise ValueError("special_token_ids needs a directory or a tokenizer")
        tokenizer = load_tokenizer(d)
    if config is None:
        config = _read_json(d / "config.json") if d is not None else {}
    named = named_token_ids(d, tokenizer) if d is not None else {}
    ids: dict[str, int | None] = {}
    for name in SPECIAL_TOKENS:
        token_id = named[name][1] if name in named else _config_id(config, f"{name}_token_id")
        for guess in VOCABULARY_GUESSES.get(name, ()) if token_id is None else ():
            token_id = tokenizer.token_to_id(guess)
            if token_id is not None:
                break
        ids[name] = token_id
    start = _config_id(config, "decoder_start_token_id")
    ids["decoder_start"] = start if start is not None else ids["pad"]
    return ids


def special_token_mismatches(directory, tokenizer, config: dict, reads: tuple[str, ...], family: str) -> list[str]:
    """Where the config's `*_token_id` of a special token the model reads (`reads`, its registry
    record's `config_token_ids`: BigBird QA finds the question's end by sep_token_id, a summarizer
    stops at eos_token_id) is not the id the tokenizer files name for it: the checkpoint (and
    transformers) would look for one id where the tokenizer writes another, while the export reads
    the tokenizer's. Each mismatch as a sentence with both ids and the fix; [] when they agree."""
    named = named_token_ids(directory, tokenizer)
    out = []
    for name in reads:
        configured = _config_id(config, f"{name}_token_id")
        if name in named and configured is not None and configured != named[name][1]:
            text, token_id = named[name]
            out.append(f"config.json's {name}_token_id is {configured}, but the tokenizer's {name} token {text!r} "
                       f"is {token_id}: {family} reads {name}_token_id from the config (and transformers does), "
                       f"the export reads the tokenizer's. If the model was trained with this tokenizer, set "
                       f"\"{name}_token_id\": {token_id} in {Path(directory) / 'config.json'}; if not, give the "
                       f"checkpoint the tokenizer it was trained with")
    return out


# ---- a document's tokens, counted as they come: an over-limit document costs about its first `limit`
# Tokenizing is linear in the text, and a 2 MB document costs seconds: `encode_within` tokenizes
# a long text in chunks and stops once the limit is passed. A chunk ends at a cut (`chunk_cuts`):
# a space between two ASCII letters or digits ("word word"), and for pre-tokenizers that split at
# every space and punctuation mark (BERT's, `Whitespace`) also where a word meets ASCII punctuation
# ("word," ",word"), outside the special tokens' texts ("[SEP]"). For the tokenizer pieces it
# accepts (normalizers that map characters one by one, pre-tokenizers that split at the cut, added
# tokens that hold no space), no token spans a cut and each side tokenizes alone as it does within
# the whole, so the chunks' tokens, their offsets moved by the chunk's start, are the whole text's
# (tests/model/test_encode_within.py checks this against one encode on the shipped tokenizers and
# on byte-level BPE and SentencePiece ones). Other tokenizers get one encode, as a text without a
# cut does for its part past the last one (e.g. 2 MB of CJK characters or of "a,a,a," on a
# byte-level BPE).
_SPACE_CUT = re.compile(r"(?<=[0-9A-Za-z]) (?=[0-9A-Za-z])")
_PUNCT = r"!-/:-@\[-`{-~"
_WORD_CUT = re.compile(rf"(?<=[0-9A-Za-z])(?=[ {_PUNCT}])|(?<=[{_PUNCT}])(?=[ 0-9A-Za-z])")
_WORD_SPLITTING = {"BertPreTokenizer", "Whitespace"}  # each space dropped, punctuation apart from words
_CHUNK_SAFE_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Nmt", "StripAccents",
                           "Precompiled"}
_CHUNK_SAFE_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits"}


def _chunk_safe_piece(piece: dict | None, safe: set[str]) -> bool:
    if piece is None:
        return True
    kind = piece.get("type")
    if kind == "Sequence":
        return all(_chunk_safe_piece(p, safe) for p in piece.get("normalizers", piece.get("pretokenizers", [])))
    if kind == "Replace":  # of a string with no space, or of runs of 2 or more spaces (SentencePiece's)
        pattern, text = piece.get("pattern", {}), piece.get("pattern", {}).get("String")
        return pattern.get("Regex") == " {2,}" or (text is not None and (" " not in text or text.strip(" ") == ""
                                                                         and len(text) >= 2))
    if kind == "Metaspace":  # split at each space; a chunk starting with one gets no second
        return piece.get("split", True)
    if kind == "ByteLevel":  # GPT-2's regex: " word" is a piece of its own
        return piece.get("use_regex", True)
    return kind in safe


@dataclass(frozen=True)
class ChunkCuts:
    """Where `encode_within` may cut a text for a tokenizer: `pattern` finds the cuts; none may
    fall inside an occurrence of one of `keep` (the added tokens' texts that a cut could split)."""

    pattern: re.Pattern
    keep: tuple[str, ...] = ()

    def last(self, text: str, lo: int, hi: int) -> int | None:
        """The last cut in [lo, hi), looked for near hi first."""
        for start in (max(lo, hi - 1024), lo):
            for m in reversed(list(self.pattern.finditer(text, start, hi))):
                if self.allowed(text, m.start()):
                    return m.start()
            if start == lo:
                return None
        return None

    def first(self, text: str, pos: int) -> int:
        """The first cut at or after pos, else the text's end."""
        while (m := self.pattern.search(text, pos)) is not None:
            if self.allowed(text, m.start()):
                return m.start()
            pos = m.start() + 1
        return len(text)

    def allowed(self, text: str, i: int) -> bool:
        return i > 0 and not any(text.find(k, max(0, i - len(k) + 1), i + len(k) - 1) >= 0 for k in self.keep)


def chunk_cuts(tokenizer) -> ChunkCuts | None:
    """Where `encode_within` may cut the tokenizer's texts into chunks (see above); None: nowhere."""
    import json

    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return None
    pieces = {}
    for name, component, safe in (("normalizer", tokenizer.normalizer, _CHUNK_SAFE_NORMALIZERS),
                                  ("pre_tokenizer", tokenizer.pre_tokenizer, _CHUNK_SAFE_PRE_TOKENIZERS)):
        pieces[name] = None if component is None else json.loads(component.__getstate__())
        if not _chunk_safe_piece(pieces[name], safe):
            return None
    added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    for token in tokenizer.get_added_tokens_decoder().values():
        text = token.content
        if any(c.isspace() for c in text) or (token.single_word or token.lstrip or token.rstrip) and \
                (text[:1].isalnum() or text[-1:].isalnum()):
            return None
    if (pieces["pre_tokenizer"] or {}).get("type") in _WORD_SPLITTING:
        return ChunkCuts(_WORD_CUT, tuple(t for t in added if len(t) > 1 and _WORD_CUT.search(t)))
    return ChunkCuts(_SPACE_CUT)


def encode_within(tokenizer, text: str, limit: int, chunk_chars: int | None = None):
    """(ids, offsets, read) of `text` without special tokens: as `tokenizer.encode(text)` when it
    has at most `limit` tokens (`read` is then len(text)); else the tokens of its chunks (see
    above) up to the one where the limit was passed, which ends at character `read`. `chunk_chars`:
    the chunks' size (default: 4 characters per token of the limit, at least 4096, at most 65536;
    a chunk ends at the last cut in its second half, else at the first cut after it). Through
    `encode_batch`, which releases the GIL while it runs (`encode` holds it)."""
    chunk = chunk_chars or min(1 << 16, max(4096, 4 * limit))
    cuts = chunk_cuts(tokenizer) if len(text) > chunk else None
    if cuts is None:
        (enc,) = tokenizer.encode_batch([text], add_special_tokens=False)
        return enc.ids, enc.offsets, len(text)
    ids, offsets, start = [], [], 0
    while start < len(text) and len(ids) <= limit:
        end = len(text)
        if len(text) - start > chunk:
            end = cuts.last(text, start + chunk // 2, start + chunk) or cuts.first(text, start + chunk)
        (enc,) = tokenizer.encode_batch([text[start:end]], add_special_tokens=False)
        ids += enc.ids
        offsets += enc.offsets if start == 0 else [(a + start, b + start) for a, b in enc.offsets]
        start = end
    return ids, offsets, start


# ---- a summarizer's encoder input

# template -> the special token in front of the document (None: none); every template ends with eos.
# As each family's tokenizer builds it: Pegasus `document </s>`, BART/LED `<s> document </s>` (bos
# is LED's global token), BERT2BERT `[CLS] document [SEP]` (its eos is [SEP]). The exporter writes
# the template into the manifest (`summarize_input`); training and serving both read it.
SUMMARIZE_INPUTS = {"doc-eos": None, "bos-doc-eos": "bos", "cls-doc-eos": "cls"}


def summarize_input_of(model_type: str | None) -> str:
    """The summarize input template of a checkpoint's `model_type` (its registry record's)."""
    from longdoc.model import registry  # imported here: the registry imports this module

    return registry.summarize_input_of(model_type)


def summarize_window(doc_ids, max_length: int, special_tokens, template: str = "doc-eos") -> tuple[list[int], bool]:
    """The encoder input of a summary under `template` (SUMMARIZE_INPUTS): [prefix] document eos,
    at most max_length tokens (one window: the encoder reads no further); and whether the
    document was cut. special_tokens: a mapping of special-token names to ids."""
    name = SUMMARIZE_INPUTS[template]
    prefix = [] if name is None else [int(special_tokens[name])]
    keep = max_length - 1 - len(prefix)
    return [*prefix, *doc_ids[:keep], int(special_tokens["eos"])], len(doc_ids) > keep


# --- the QA input ----------------------------------------------------------------------------------
# `[CLS] question [SEP] document[a:b] [SEP]` (BERT pairs): training (longdoc.model.data.qa_features),
# the service's and eval's windows (longdoc.export.windows.qa_windows) and data/qa_windows.py size a
# window's document part here.
QA_SPECIAL_TOKENS = 3  # [CLS], [SEP], [SEP]


def qa_room(max_length: int, question_len: int) -> int:
    """Document tokens one QA window of max_length tokens holds beside a question of question_len
    tokens (`[CLS] question [SEP] doc [SEP]`); below 1 when the question leaves no room."""
    return max_length - question_len - QA_SPECIAL_TOKENS


# --- characters to tokens --------------------------------------------------------------------------
class TokenOffsets:
    """A text's token character spans (a tokenizers `Encoding.offsets`), searched by bisection: the
    tokens a character span covers (an answer's tokens for training, eval, the data builders).
    Tokenizers emit offsets in text order (starts and ends non-decreasing), so the tokens that
    overlap [start, end) are one run: from the first token that ends after `start` to the last
    that starts before `end`. Build it once per text; a lookup is O(log n)."""

    def __init__(self, offsets):
        self.starts = [s for s, _ in offsets]
        self.ends = [e for _, e in offsets]

    def __len__(self) -> int:
        return len(self.starts)

    def token_span(self, start: int, end: int) -> tuple[int, int] | None:
        """(first, last), inclusive, of the tokens that overlap characters [start, end); None when
        no token does (the span lies in whitespace between tokens, or past the last token)."""
        first = bisect.bisect_right(self.ends, start)  # the first token ending after start
        last = bisect.bisect_left(self.starts, end) - 1  # the last token starting before end
        return (first, last) if first <= last else None


# --- summary text ----------------------------------------------------------------------------------
_SPACED_HYPHEN = re.compile(r"(?<=\w) - (?=\w)")


def summary_text(tokenizer, ids) -> str:
    """A summary's text: the tokenizer's decoding, with the hyphens that WordPiece decoding spaces
    out joined again ("current - based" -> "current-based"; the tokenizer splits "-" off as a token
    of its own and its decoder puts a space on each side). A summary is a page's one-line
    description, so a spaced dash between two words inside it is a hyphen; a dangling " -" at its
    end is dropped. The service (plain and streamed) and `longdoc eval` write summaries with this
    one function."""
    text = _SPACED_HYPHEN.sub("-", tokenizer.decode(list(ids)))
    return text[:-2] if text.endswith(" -") else text


class SummaryStream:
    """A summary's text as its tokens come: `add(id)` returns the new text. `summary_text` holds a
    trailing " -" back (the next token may make it a hyphen), so what was returned is never taken
    back and the pieces concatenate to `summary_text` of the tokens so far (`sent`)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = summary_text(self.tokenizer, self.ids)
        if not text.startswith(self.sent):  # the decoding rewrote earlier text: wait until it settles
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
