"""Cut QA training records down to one window of the page that holds the answer.

    .venv/bin/python -m data.qa_windows data/cache/manpages/qa_train.jsonl \
        data/cache/manpages/qa_train_w1024.jsonl --max-length 1024

`longdoc train --task qa` on whole pages would cut each page into overlapping windows, most of
them without the answer (labelled [CLS]); on 2 CPU cores that spends the time budget on
negatives. Here every record keeps only a window of the page's text of about
`max_length - question - 3` tokens that holds the whole answer at a random place (seeded), so
the trainer sees one positive window per question. The answer offsets are rebased onto the
window. Test files are never windowed: evaluation reads whole pages.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from longdoc.model.data import MAX_QUESTION_LENGTH
from longdoc.model.tokenization import TokenOffsets, qa_room


def window_record(record: dict, tokenizer, max_length: int, rng: random.Random, cache: dict) -> dict | None:
    """One window of the record's page that holds its first answer, the answer rebased onto it; None
    when the answer is longer than a window or covers no token."""
    context = record["context"]
    if context not in cache:  # keyed by the text: each JSON line parses a new string for the same page
        cache.clear()  # one page at a time: its encoding's token offsets, searched by bisection
        cache[context] = TokenOffsets(tokenizer.encode(context, add_special_tokens=False).offsets)
    tokens = cache[context]
    question_tokens = len(tokenizer.encode(record["question"], add_special_tokens=False).ids)
    room = qa_room(max_length, min(question_tokens, MAX_QUESTION_LENGTH))  # the question as training cuts it
    answer = record["answers"][0]
    start_char, end_char = answer["start"], answer["start"] + len(answer["text"])
    answer_tokens = tokens.token_span(start_char, end_char)
    if answer_tokens is None or answer_tokens[1] - answer_tokens[0] + 1 > room:
        return None
    first, last = answer_tokens
    lo = max(0, last - room + 1)
    hi = min(first, max(0, len(tokens) - room))
    w = rng.randint(lo, max(lo, hi))
    end_token = min(len(tokens), w + room) - 1
    char_lo, char_hi = tokens.starts[w], tokens.ends[end_token]
    out = dict(record)
    out["context"] = context[char_lo:char_hi]
    out["answers"] = [{"text": answer["text"], "start": start_char - char_lo}]
    out["window_chars"] = [char_lo, char_hi]
    assert out["context"][out["answers"][0]["start"]:][: len(answer["text"])] == answer["text"]
    return out


def records_by_page(source: Path):
    """The records of a QA JSONL file in page order (stable: a page's questions keep their order),
    so that each page is tokenized once; read twice, never held whole (the broad set is 11 GB)."""
    index = []
    with source.open("rb") as f:
        while line := f.readline():
            if line.strip():
                index.append((json.loads(line)["page"], f.tell() - len(line)))
    index.sort(key=lambda item: item[0])
    with source.open("rb") as f:
        for _page, offset in index:
            f.seek(offset)
            yield json.loads(f.readline())


def main(argv: list[str] | None = None) -> int:
    from data.build_manpages import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--max-length", type=int, default=1024,
                        help="tokens of a training example: question, window and specials (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="where each answer lands in its window (default: %(default)s)")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer()
    rng, cache, kept, dropped = random.Random(args.seed), {}, 0, 0
    with args.output.open("w") as f:
        for record in records_by_page(args.source):
            out = window_record(record, tokenizer, args.max_length, rng, cache)
            if out is None:
                dropped += 1
                continue
            f.write(json.dumps(out) + "\n")
            kept += 1
    print(f"{kept} windows written, {dropped} answers longer than a window (or covering no token) dropped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
