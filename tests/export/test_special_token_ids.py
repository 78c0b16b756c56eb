"""A config whose special-token ids disagree with its tokenizer (issue 38, item 7). A BigBird QA
checkpoint saved from `BigBirdConfig()` keeps `sep_token_id: 66` while its own tokenizer's [SEP]
is another id: transformers' model ends the question (its global tokens) at 66, the export at the
tokenizer's [SEP]. Export refused nothing; `verify` of the int8 export said PASS while the fp32
export failed at every length with nothing naming the cause. Now export refuses it with both ids
and the fix, and verify fails it whatever the dtype."""

from __future__ import annotations

import json

import pytest

from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.verify import verify_model
from longdoc.testing.tiny_models import SEP, make_tiny_checkpoint
from tests.export.test_verify import LENGTHS, SHAPES

NAMED = {"sep_token": "[SEP]", "cls_token": "[CLS]", "pad_token": "[PAD]", "mask_token": "[MASK]"}


def qa_checkpoint(directory, sep_token_id: int):
    """A tiny BigBird QA checkpoint (test_verify's shape, whose int8 export passes verify) with
    tokenizer files that name its special tokens (as transformers' save_pretrained writes them)
    and the config's sep_token_id set."""
    make_tiny_checkpoint(directory, "qa", seed=0, **SHAPES["qa"])
    (directory / "special_tokens_map.json").write_text(json.dumps(NAMED))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "sep_token_id": sep_token_id}))
    return directory


def test_export_refuses_a_config_sep_that_is_not_the_tokenizers(tmp_path):
    checkpoint = qa_checkpoint(tmp_path / "checkpoint", 66)
    with pytest.raises(CheckpointError, match=(
            rf"config.json's sep_token_id is 66, but the tokenizer's sep token '\[SEP\]' is {SEP}: "
            rf"BigBirdForQuestionAnswering reads sep_token_id from the config .* set \"sep_token_id\": {SEP} in "
            rf"{checkpoint / 'config.json'}")):
        export_model(checkpoint, tmp_path / "model", "qa", progress=lambda _: None)
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_verify_fails_a_config_sep_that_is_not_the_tokenizers_whatever_the_dtype(tmp_path, dtype):
    checkpoint = qa_checkpoint(tmp_path / "checkpoint", SEP)
    export_model(checkpoint, tmp_path / "model", "qa", dtype=dtype, progress=lambda _: None)
    lengths = LENGTHS["qa"]
    good = verify_model(tmp_path / "model", checkpoint, lengths=lengths, threads=1, progress=lambda _: None)
    assert good.ok, good.summary()
    config = json.loads((checkpoint / "config.json").read_text())  # the config now says 66
    (checkpoint / "config.json").write_text(json.dumps({**config, "sep_token_id": 66}))
    bad = verify_model(tmp_path / "model", checkpoint, lengths=lengths, threads=1, progress=lambda _: None)
    assert not bad.ok
    (check,) = [c for c in bad.checks if c.what == "special-token ids"]
    assert not check.ok and f"sep_token_id is 66, but the tokenizer's sep token '[SEP]' is {SEP}" in check.note
    assert "MISMATCH  config.json's sep_token_id is 66" in bad.summary()
