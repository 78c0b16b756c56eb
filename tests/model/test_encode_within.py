"""A document's tokens counted as they come (model/tokenization.py `encode_within`, issue 38 item 3):
a text within the limit gets exactly the tokens and offsets of one `encode`, however it was cut into
chunks; a text over it stops soon after the limit, with a prefix of those tokens. Checked on the
shipped models' WordPiece, the fake worker's word-level tokenizer, and byte-level BPE and
SentencePiece (Metaspace) tokenizers trained here, at chunk sizes that cut every few words."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers

from longdoc.model.tokenization import chunk_cuts, encode_within
from tests.counting_tokenizer import CountingTokenizer

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "chown(2) changes the owner of a file -- café naïve",
          "mount --bind /a /b; umount2 is the call", "ＦＵＬＬ width and 日本語 text, e-mail and built-in words",
          "  spaces   and\ttabs, UPPER and lower, 3.14 %$# <s> [SEP]"] * 20


@functools.lru_cache(maxsize=None)
def tokenizer(name: str) -> Tokenizer:
    if name in ("qa", "summarize"):
        return Tokenizer.from_file(str(ROOT / "models" / name / "tokenizer.json"))
    if name == "fake":
        from longdoc.testing.fake_worker import fake_tokenizer

        return fake_tokenizer()
    if name.startswith("bytelevel"):
        from tokenizers import ByteLevelBPETokenizer

        bpe = ByteLevelBPETokenizer(add_prefix_space=name.endswith("prefix"))
        bpe.train_from_iterator(CORPUS, vocab_size=400, show_progress=False, special_tokens=["<s>", "</s>"])
        return bpe._tokenizer
    from tokenizers import SentencePieceUnigramTokenizer  # Nmt, NFKC, runs of spaces to one; Metaspace

    unigram = SentencePieceUnigramTokenizer()
    unigram.train_from_iterator(CORPUS, vocab_size=120, show_progress=False, special_tokens=["<unk>", "</s>"],
                                unk_token="<unk>")
    return unigram._tokenizer


NAMES = ["qa", "summarize", "fake", "bytelevel", "bytelevel-prefix", "sentencepiece"]
PIECES = ["the", "fox", "Jumps", "e", "3", "14", "umount2", "café", "naïve", "日本語", "ＦＵＬＬ", "🙂", "-", "--",
          ",", ".", "(", ")", "[SEP]", "[UNK]", "<s>", "</s>", "\u200b", "\u00a0", "Ǆ", "x" * 120, "a,b",
          "#", "'s", ",[", "]."]
SPACES = [" ", " ", " ", "  ", "   ", "\n", "\t", " \n ", ""]
texts = st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from(SPACES)), min_size=1, max_size=60).map(
    lambda parts: "".join(p + s for p, s in parts))


@pytest.mark.parametrize("name", NAMES)
def test_the_tokenizers_here_are_cut_in_chunks(name):
    assert chunk_cuts(tokenizer(name)) is not None


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None)
@given(text=texts, chunk_chars=st.integers(2, 40), limit=st.integers(0, 80))
def test_chunks_give_one_encodes_tokens(name, text, chunk_chars, limit):
    tok = tokenizer(name)
    whole = tok.encode(text, add_special_tokens=False)
    ids, offsets, read = encode_within(tok, text, 10**9, chunk_chars)
    assert (ids, offsets, read) == (whole.ids, whole.offsets, len(text))
    ids, offsets, read = encode_within(tok, text, limit, chunk_chars)
    if len(whole.ids) <= limit:
        assert (ids, offsets, read) == (whole.ids, whole.offsets, len(text))
    else:  # over: a prefix of the whole's tokens, past the limit
        assert len(ids) > limit and ids == whole.ids[: len(ids)] and offsets == whole.offsets[: len(ids)]
        assert read == len(text) or chunk_cuts(tok).pattern.match(text, read)


def test_a_tokenizer_that_cannot_be_cut_gets_one_encode():
    """A normalizer that strips (or prepends, as Llama's does) changes a chunk's first token."""
    tok = Tokenizer.from_str(tokenizer("bytelevel").to_str())
    tok.normalizer = normalizers.Strip()
    assert chunk_cuts(tok) is None
    text = " ".join(["the quick brown fox"] * 50)
    whole = tok.encode(text, add_special_tokens=False)
    assert encode_within(tok, text, 10**9, 16) == (whole.ids, whole.offsets, len(text))


def test_refusing_a_huge_document_costs_about_its_first_limit_tokens():
    """Issue 38, item 3: a 1.9 MB document over the token limit was tokenized whole (1.6-1.9 s of
    CPU) before its 413. Now what is tokenized ends within one chunk of its `limit`-th token."""
    tok = CountingTokenizer(tokenizer("qa"))
    doc = ("The quick brown fox jumps over the lazy dog. " * 44_000)[:1_900_000]
    limit = 65536
    ids, _, read = encode_within(tok, doc, limit)
    first = tok.tokenizer.encode(doc[:600_000], add_special_tokens=False).offsets[limit][1]  # where token limit+1 ends
    assert len(ids) > limit and read < len(doc)
    assert tok.characters == read <= first + 65536, (tok.characters, first)
    assert tok.characters < len(doc) / 4


def test_a_document_of_words_and_punctuation_without_spaces_is_cut_too():
    """BERT's pre-tokenizer splits at punctuation as at spaces: 1.9 MB of "word,word," is cut at
    each comma (and never inside "[SEP]"), and refused after about its first `limit` tokens."""
    tok = CountingTokenizer(tokenizer("qa"))
    doc = ("alpha,beta.gamma[SEP]delta(x)" * 70_000)[:1_900_000]
    ids, _, read = encode_within(tok, doc, 65536)
    assert len(ids) > 65536 and tok.characters == read < len(doc) / 4
    assert ids == tok.tokenizer.encode(doc[:read], add_special_tokens=False).ids
