"""Training data: JSONL formats, tokenization into features, and the collators that pad them.

One JSON object per line (blank lines are skipped); a broken line or a missing field is a
`DataError` naming `file:line`.

    task       fields                                                     feature (lists of ints)
    mlm        {"text"}                                                   input_ids
    qa         {"question", "context", "answers": [{"text", "start"}]}    input_ids, token_type_ids,
                                                                          start_positions, end_positions
    classify   {"text", "label"}                                          input_ids, label
    summarize  {"document", "summary"}                                    input_ids, labels

Sequences are built by hand from `add_special_tokens=False` encodings, so they do not depend on
the tokenizer's post-processor, and every id comes from `SpecialTokens`:

    mlm, classify:  [CLS] text [SEP]                   (mlm: a long text becomes several chunks)
    qa:             [CLS] question [SEP] context [SEP]  token types 0 ... 0 1 ... 1 (BERT pairs)
    summarize:      document </s>  ->  labels summary </s>; the decoder input is the labels shifted
                    right behind decoder_start (teacher forcing, as transformers' shift_tokens_right)

This module imports no torch at module level except through the collators' functions.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from longdoc.model.registry import TASKS
from longdoc.model.tokenization import SUMMARIZE_INPUTS, TokenOffsets, qa_room, summarize_window

IGNORE_INDEX = -100  # label value the losses skip (transformers' convention)
MAX_QUESTION_LENGTH = 64  # qa: question tokens kept (the default of qa_features and `longdoc train`)

REQUIRED_FIELDS = {
    "mlm": ("text",),
    "qa": ("question", "context", "answers"),
    "classify": ("text", "label"),
    "summarize": ("document", "summary"),
}


class DataError(ValueError):
    """A training file that cannot be used; the message names file:line."""


# ----------------------------------------------------------------------------- reading JSONL


@dataclass(frozen=True)
class Record:
    source: str  # "file:line", for error messages
    fields: dict[str, Any]


def read_jsonl(path: str | Path, task: str | None) -> list[Record]:
    """Every record of a JSONL file (JSON objects, blank lines skipped, a byte-order mark
    tolerated), checked for the task's fields and their types (task None: objects only). The one
    reader of the project's data files: training, `longdoc eval`, the data scripts."""
    if task is not None and task not in REQUIRED_FIELDS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = []
    with path.open(encoding="utf-8-sig") as f:  # tolerate a byte-order mark
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if task is not None:
                _check_fields(obj, task, where)
            records.append(Record(where, obj))
    if not records:
        raise DataError(f"{path}: no records")
    return records


def _check_fields(obj: dict, task: str, where: str) -> None:
    missing = [k for k in REQUIRED_FIELDS[task] if k not in obj]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(map(repr, missing))} for task {task!r}")
    for key in REQUIRED_FIELDS[task]:
        if key in ("answers", "label"):
            continue
        if not isinstance(obj[key], str):
            raise DataError(f"{where}: field {key!r} must be a string, got {type(obj[key]).__name__}")
    if task == "classify" and (not isinstance(obj["label"], (str, int)) or isinstance(obj["label"], bool)):
        raise DataError(f"{where}: field 'label' must be a string or an integer")
    if task == "qa":
        answers = obj["answers"]
        if not isinstance(answers, list):
            raise DataError(f"{where}: field 'answers' must be a list")
        for a in answers:
            if not (isinstance(a, dict) and isinstance(a.get("text"), str) and isinstance(a.get("start"), int)):
                raise DataError(f"{where}: each answer must be {{\"text\": str, \"start\": int}}")
            start, text = a["start"], a["text"]
            if not text or obj["context"][start : start + len(text)] != text or start < 0:
                raise DataError(
                    f"{where}: answer {text!r} is not at character {start} of the context "
                    f"(found {obj['context'][max(start, 0) : max(start, 0) + len(text)]!r})"
                )


# ----------------------------------------------------------------------------- special tokens


@dataclass(frozen=True)
class SpecialTokens:
    pad: int
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    bos: int | None = None
    eos: int | None = None
    decoder_start: int | None = None
    vocab_size: int | None = None  # of the model: random replacement tokens are drawn below it

    def require(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise DataError(f"the tokenizer/config defines no {', '.join(missing)} token id")


def special_tokens_from(tokenizer, config: dict, directory=None) -> SpecialTokens:
    """The special ids training uses, resolved as the serving path resolves them
    (`longdoc.model.tokenization.special_token_ids`: the tokenizer files' token texts first, then the
    config's `*_token_id`), for the tokenizer files in `directory`; what is still undefined comes
    from the model `config`, then from the vocabulary ([CLS]/<s>, [SEP]/</s>, [MASK]/<mask>, ...).
    `longdoc.model.train` writes the result into the output's special_tokens_map.json, so an exported
    model resolves the same ids."""
    from longdoc.model.tokenization import special_token_ids

    ids = special_token_ids(directory, tokenizer, config=config)
    return SpecialTokens(
        pad=ids["pad"] if ids["pad"] is not None else 0,
        cls=ids["cls"],
        sep=ids["sep"],
        mask=ids["mask"],
        bos=ids["bos"],
        eos=ids["eos"],
        decoder_start=ids["decoder_start"] if ids["decoder_start"] is not None else ids["pad"],
        vocab_size=config.get("vocab_size"),
    )


def special_tokens_map(tokenizer, special: SpecialTokens) -> dict[str, str]:
    """special_tokens_map.json content (token texts) for the ids in `special`."""
    out = {}
    for name in ("pad", "cls", "sep", "mask", "eos"):
        token_id = getattr(special, name)
        text = tokenizer.id_to_token(token_id) if token_id is not None else None
        if text is not None:
            out[f"{name}_token"] = text
    return out


# ----------------------------------------------------------------------------- features


def _encode(tokenizer, text: str):
    return tokenizer.encode(text, add_special_tokens=False)


def mlm_features(records: Iterable[Record], tokenizer, special: SpecialTokens, max_length: int) -> list[dict]:
    """[CLS] chunk [SEP] for consecutive chunks of each text (no text is cut off)."""
    special.require("cls", "sep", "mask")
    body = max_length - 2
    if body < 1:
        raise ValueError("max_length must be at least 3")
    features = []
    for record in records:
        ids = _encode(tokenizer, record.fields["text"]).ids
        for i in range(0, max(len(ids), 1), body):
            chunk = ids[i : i + body]
            if chunk:
                features.append({"input_ids": [special.cls, *chunk, special.sep]})
    return features


def classify_features(
    records: Iterable[Record], tokenizer, special: SpecialTokens, max_length: int, label2id: dict[str, int]
) -> list[dict]:
    """[CLS] text [SEP], the text truncated to max_length."""
    special.require("cls", "sep")
    features = []
    for record in records:
        label = str(record.fields["label"])
        if label not in label2id:
            raise DataError(f"{record.source}: label {label!r} is not one of the model's labels {sorted(label2id)}")
        ids = _encode(tokenizer, record.fields["text"]).ids[: max_length - 2]
        features.append({"input_ids": [special.cls, *ids, special.sep], "label": label2id[label]})
    return features


def labels_of(records: Iterable[Record]) -> list[str]:
    """The label set of a classification file, sorted (integers numerically)."""
    labels = {str(r.fields["label"]) for r in records}
    return sorted(labels, key=lambda s: (0, int(s), s) if s.lstrip("-").isdigit() else (1, 0, s))


def qa_features(
    records: Iterable[Record],
    tokenizer,
    special: SpecialTokens,
    max_length: int,
    *,
    long_context: str = "window",
    doc_stride: int = 256,
    max_question_length: int = MAX_QUESTION_LENGTH,
    negative_windows: float = 1.0,
    seed: int = 0,
) -> list[dict]:
    """[CLS] question [SEP] context [SEP] with the first answer as token start/end positions.

    A context longer than the room left after the question is either cut into overlapping
    windows (`long_context="window"`, successive windows start `doc_stride` context tokens
    apart) or truncated to its first window (`"truncate"`). A window that does not hold the
    whole answer, and a record with no answers, is labelled with the [CLS] position (0, 0):
    "no answer here", as in BERT/BigBird SQuAD fine-tuning. `negative_windows` is the share of
    those answer-less windows of answerable records that is kept (seeded draw; 1.0 keeps all,
    as transformers' SQuAD scripts do; 0.0 keeps only windows that hold the answer).
    """
    special.require("cls", "sep")
    if long_context not in ("window", "truncate"):
        raise ValueError(f"long_context must be 'window' or 'truncate', got {long_context!r}")
    rng = random.Random(seed)
    features = []
    last_context = (None, None, None)  # questions about one page usually come together: encode it once
    for record in records:
        question = _encode(tokenizer, record.fields["question"]).ids[:max_question_length]
        if last_context[0] != record.fields["context"]:
            encoding = _encode(tokenizer, record.fields["context"])
            last_context = (record.fields["context"], encoding, TokenOffsets(encoding.offsets))
        _, context, offsets = last_context  # offsets: the context tokens' character spans
        room = qa_room(max_length, len(question))
        if room < 1:
            raise ValueError(f"max_length {max_length} leaves no room for context after the question")
        span = None  # (first token, last token) of the first answer, in context tokens
        answers = record.fields["answers"]
        if answers:
            start_char = answers[0]["start"]
            end_char = start_char + len(answers[0]["text"])
            span = offsets.token_span(start_char, end_char)
            if span is None:
                raise DataError(f"{record.source}: the answer covers no token of the context")
        window_starts = [0]
        if long_context == "window":
            stride = max(1, min(doc_stride, room))
            while window_starts[-1] + room < len(context.ids):
                window_starts.append(window_starts[-1] + stride)
        for w in window_starts:
            ids = context.ids[w : w + room]
            offset = len(question) + 2  # position of the window's first token in the sequence
            start = end = 0
            if span is not None and w <= span[0] and span[1] < w + len(ids):
                start, end = span[0] - w + offset, span[1] - w + offset
            elif span is not None and len(window_starts) > 1 and rng.random() >= negative_windows:
                continue
            input_ids = [special.cls, *question, special.sep, *ids, special.sep]
            token_type_ids = [0] * offset + [1] * (len(ids) + 1)
            features.append(
                {"input_ids": input_ids, "token_type_ids": token_type_ids, "start_positions": start, "end_positions": end}
            )
    return features


def summarize_features(
    records: Iterable[Record], tokenizer, special: SpecialTokens, max_length: int, max_target_length: int,
    template: str = "doc-eos",
) -> list[dict]:
    """The service's encoder input (`template`, longdoc.model.tokenization.summarize_window: e.g.
    document </s>) -> labels summary </s> (each truncated to its maximum)."""
    prefix = SUMMARIZE_INPUTS[template]
    special.require("eos", "decoder_start", *([prefix] if prefix else []))
    ids = dataclasses.asdict(special)
    features = []
    for record in records:
        source, _ = summarize_window(_encode(tokenizer, record.fields["document"]).ids, max_length, ids, template)
        target = _encode(tokenizer, record.fields["summary"]).ids[: max_target_length - 1]
        features.append({"input_ids": source, "labels": [*target, special.eos]})
    return features


# ----------------------------------------------------------------------------- batching order


def length_grouped_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of indices in a shuffled order that groups similar lengths (less padding on long
    documents): shuffle, sort within mega-batches of 50 batches, cut, shuffle the batches.
    A pure function of (lengths, batch_size, seed, epoch), so a resumed run skips to the same
    place."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mega = batch_size * 50
    batches = []
    for i in range(0, len(order), mega):
        group = sorted(order[i : i + mega], key=lambda j: -lengths[j])
        batches += [group[k : k + batch_size] for k in range(0, len(group), batch_size)]
    rng.shuffle(batches)
    return batches


# ----------------------------------------------------------------------------- collators (torch)


def _pad(rows: Sequence[Sequence[int]], value: int, multiple: int = 1):
    import torch

    width = max(len(r) for r in rows)
    width = -(-width // multiple) * multiple
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _encoder_inputs(features, special: SpecialTokens, multiple: int) -> dict:
    import torch

    input_ids = _pad([f["input_ids"] for f in features], special.pad, multiple)
    lengths = torch.tensor([len(f["input_ids"]) for f in features])
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()  # (B, S)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "token_type_ids" in features[0]:
        batch["token_type_ids"] = _pad([f["token_type_ids"] for f in features], 0, multiple)
    return batch


def collate_classify(features, special: SpecialTokens, multiple: int = 1) -> dict:
    import torch

    batch = _encoder_inputs(features, special, multiple)
    batch["labels"] = torch.tensor([f["label"] for f in features], dtype=torch.long)
    return batch


def collate_qa(features, special: SpecialTokens, multiple: int = 1) -> dict:
    import torch

    batch = _encoder_inputs(features, special, multiple)
    batch["start_positions"] = torch.tensor([f["start_positions"] for f in features], dtype=torch.long)
    batch["end_positions"] = torch.tensor([f["end_positions"] for f in features], dtype=torch.long)
    return batch


def collate_summarize(features, special: SpecialTokens, multiple: int = 1) -> dict:
    """Teacher forcing: decoder_input_ids = [decoder_start] + labels[:-1] (transformers'
    shift_tokens_right); padded label positions are IGNORE_INDEX."""
    batch = _encoder_inputs(features, special, multiple)
    labels = _pad([f["labels"] for f in features], IGNORE_INDEX)
    decoder_input_ids = _pad([[special.decoder_start, *f["labels"][:-1]] for f in features], special.pad)
    batch["decoder_input_ids"] = decoder_input_ids
    batch["decoder_attention_mask"] = (labels != IGNORE_INDEX).long()
    batch["labels"] = labels
    return batch


def mask_tokens(input_ids, special: SpecialTokens, generator, mlm_probability: float = 0.15):
    """BERT masking: choose `mlm_probability` of the maskable tokens (not pad/cls/sep); of those,
    80% become [MASK], 10% a random token, 10% stay. Returns (masked input_ids, labels) with
    labels IGNORE_INDEX everywhere but the chosen positions."""
    import torch

    special.require("mask")
    labels = input_ids.clone()
    maskable = torch.ones_like(input_ids, dtype=torch.bool)
    for token in (special.pad, special.cls, special.sep):
        if token is not None:
            maskable &= input_ids != token
    probability = torch.full(input_ids.shape, mlm_probability)
    chosen = torch.bernoulli(probability, generator=generator).bool() & maskable
    labels[~chosen] = IGNORE_INDEX
    masked = input_ids.clone()
    to_mask = torch.bernoulli(torch.full(input_ids.shape, 0.8), generator=generator).bool() & chosen
    masked[to_mask] = special.mask
    # half of the remaining 20% (10% overall) get a random token
    to_random = torch.bernoulli(torch.full(input_ids.shape, 0.5), generator=generator).bool() & chosen & ~to_mask
    vocab = special.vocab_size or int(input_ids.max()) + 1
    masked[to_random] = torch.randint(vocab, input_ids.shape, generator=generator, dtype=torch.long)[to_random]
    return masked, labels


def collate_mlm(features, special: SpecialTokens, generator, mlm_probability: float = 0.15, multiple: int = 1) -> dict:
    batch = _encoder_inputs(features, special, multiple)
    batch["input_ids"], batch["labels"] = mask_tokens(batch["input_ids"], special, generator, mlm_probability)
    return batch


def num_tokens(batch: dict) -> int:
    """Real (non-padding) tokens in a batch, encoder plus decoder: what tokens/s counts."""
    n = int(batch["attention_mask"].sum())
    if "decoder_attention_mask" in batch:
        n += int(batch["decoder_attention_mask"].sum())
    return n
