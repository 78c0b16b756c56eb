"""A tokenizer that counts the characters it is given to tokenize: what refusing a document costs,
measured without timing (tests/model/test_encode_within.py, tests/service/test_host.py)."""

from __future__ import annotations


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.characters = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, *args, **kwargs):
        self.characters += len(text)
        return self.tokenizer.encode(text, *args, **kwargs)

    def encode_batch(self, texts, **kwargs):
        self.characters += sum(map(len, texts))
        return self.tokenizer.encode_batch(texts, **kwargs)
