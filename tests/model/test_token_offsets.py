"""Characters to tokens (model/tokenization.py TokenOffsets): the one mapping of an answer's
characters to its tokens, used by training (model/data.py), `longdoc eval` and the data builders.
Checked at token starts, inside tokens, in the whitespace between them and at the end, on the
shipped models' WordPiece, and against the overlap scan it replaced."""

from __future__ import annotations

import functools
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from longdoc.model.tokenization import TokenOffsets

ROOT = Path(__file__).resolve().parents[2]
TEXT = "mount  attaches the filesystem (unmounting: umount2)."


@functools.lru_cache(maxsize=1)
def wordpiece() -> Tokenizer:
    """The shipped QA model's MiniLM WordPiece (its pieces: "##" inside words, punctuation apart)."""
    return Tokenizer.from_file(str(ROOT / "models" / "qa" / "tokenizer.json"))


def overlapping(offsets, start: int, end: int) -> tuple[int, int] | None:
    """The reference: a scan of every token for those that overlap [start, end)."""
    hits = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return (hits[0], hits[-1]) if hits else None


def test_spans_at_token_starts_inside_tokens_between_them_and_at_the_end():
    enc = wordpiece().encode(TEXT, add_special_tokens=False)
    # 0 mount (0,5) | 1 attache (7,14) 2 ##s (14,15) | 3 the (16,19) | 4 files (20,25) 5 ##yst 6 ##em (28,30)
    # | 7 ( | 8 un 9 ##mount 10 ##ing | 11 : | 12 um 13 ##ount 14 ##2 | 15 ) | 16 . (52,53)
    assert enc.offsets[:4] == [(0, 5), (7, 14), (14, 15), (16, 19)] and enc.offsets[-1] == (52, 53)
    tokens = TokenOffsets(enc.offsets)
    assert len(tokens) == len(enc.ids) == 17
    # from token starts to token ends: a word's pieces
    assert tokens.token_span(16, 19) == (3, 3)  # "the"
    assert tokens.token_span(7, 15) == (1, 2)  # "attaches": attache ##s
    assert tokens.token_span(20, 30) == (4, 6)  # "filesystem"
    # starting or ending inside a token: every token touched counts
    assert tokens.token_span(17, 18) == (3, 3)  # "h" of "the"
    assert tokens.token_span(10, 27) == (1, 5)  # "che the files" + "ys" of ##yst
    assert tokens.token_span(26, 26) == (5, 5)  # empty, inside ##yst
    # whitespace between tokens is no token: the two spaces after "mount", the space before "the"
    assert tokens.token_span(5, 7) is None and tokens.token_span(15, 16) is None
    assert tokens.token_span(4, 8) == (0, 1)  # "t  a": the tokens on either side
    assert tokens.token_span(15, 19) == (3, 3)  # a leading space adds nothing
    assert tokens.token_span(16, 16) is None  # empty, at a token's start
    # the end: the last token, the whole text, past the text
    assert tokens.token_span(52, 53) == (16, 16)
    assert tokens.token_span(51, 60) == (15, 16)
    assert tokens.token_span(0, len(TEXT)) == (0, 16)
    assert tokens.token_span(len(TEXT), len(TEXT) + 10) is None
    assert TokenOffsets([]).token_span(0, 5) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["mount", "umount2", "the", "(", ")", ".", "file-system", "ls", " ", "\n", "é"]),
                max_size=30),
       st.integers(0, 120), st.integers(0, 40))
def test_bisection_finds_the_tokens_an_overlap_scan_finds(words, start, length):
    text = " ".join(words)
    offsets = wordpiece().encode(text, add_special_tokens=False).offsets
    assert TokenOffsets(offsets).token_span(start, start + length) == overlapping(offsets, start, start + length)
