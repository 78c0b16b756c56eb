"""Summary text (model/tokenization.py): WordPiece decoding spaces out hyphens ("current - based");
`summary_text` joins them again, and `SummaryStream` streams pieces that never need taking back."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from longdoc.model.tokenization import SummaryStream, summary_text


def wordpiece() -> Tokenizer:
    words = ["[UNK]", "the", "current", "-", "based", "entry", "ls", "list", "##s", "(", ")", "."]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


def test_hyphens_spaced_out_by_the_decoder_are_joined():
    tok = wordpiece()
    ids = tok.encode("the current-based entry").ids
    assert tok.decode(ids) == "the current - based entry"  # the defect
    assert summary_text(tok, ids) == "the current-based entry"
    assert summary_text(tok, tok.encode("list ( the entry ) -").ids) == "list ( the entry )"  # a dangling dash


def test_streamed_pieces_are_never_taken_back_and_make_the_summary():
    tok = wordpiece()
    for text in ("the current-based entry", "the current - ( entry", "lists the entry -", "the - - entry"):
        ids = tok.encode(text).ids
        stream = SummaryStream(tok)
        pieces = [stream.add(i) for i in ids]
        assert "".join(pieces) == summary_text(tok, ids), (text, pieces)
