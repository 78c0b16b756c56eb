"""data/qa_windows.py: QA training windows, one per question, cut from its page. The broad corpus'
qa_train.jsonl is 11 GB (each question carries its whole page), so it is read in page order
without being held whole, and each page is tokenized once."""

from __future__ import annotations

import json
import random

from data.qa_windows import records_by_page, window_record
from longdoc.testing.tiny_models import tiny_tokenizer

PAGES = {
    "ls.1": " ".join(f"word{i}" for i in range(300)) + " list directory contents here",
    "cp.1": " ".join(f"term{i}" for i in range(200)) + " copy files and directories",
}


def record(page: str, n: int, answer: str) -> dict:
    text = PAGES[page]
    return {"id": f"{page}#{n}", "page": page, "question": f"What does {answer.split()[0]} do?", "context": text,
            "answers": [{"text": answer, "start": text.index(answer)}]}


class CountingTokenizer:
    def __init__(self):
        self.tok, self.contexts = tiny_tokenizer(), 0

    def encode(self, text, add_special_tokens=True):
        self.contexts += text in PAGES.values()
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


def test_records_come_in_page_order_and_each_page_is_tokenized_once(tmp_path):
    rows = [record("ls.1", 0, "list directory"), record("cp.1", 0, "copy files"),
            record("ls.1", 1, "contents here"), record("cp.1", 1, "and directories")]
    source = tmp_path / "qa_train.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # a blank last line is skipped

    got = list(records_by_page(source))
    assert [r["id"] for r in got] == ["cp.1#0", "cp.1#1", "ls.1#0", "ls.1#1"]  # stable within a page

    # every record parses its own copy of the page text: a cache keyed by the string object's id
    # tokenized the page once per question
    tokenizer, cache, rng = CountingTokenizer(), {}, random.Random(0)
    windows = [window_record(r, tokenizer, 64, rng, cache) for r in got]
    assert tokenizer.contexts == 2
    for w in windows:
        answer = w["answers"][0]
        assert w["context"][answer["start"]:].startswith(answer["text"])
        assert len(tiny_tokenizer().encode(w["context"], add_special_tokens=False).ids) <= 64
