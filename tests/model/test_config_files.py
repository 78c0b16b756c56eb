"""One reader of JSON config files (`longdoc.model.config.read_json_object`): checkpoint loading,
export, training and the tokenizer tables all refuse a config that is not a JSON object the same
way, naming the file, in their own error type (issue 26: four readers had disagreed)."""

import pytest

from longdoc.export.exporter import CheckpointError, read_config
from longdoc.model.checkpoint import LoadError, read_config as read_checkpoint_config
from longdoc.model.config import read_json_object
from longdoc.model.tokenization import TokenizerError, special_token_ids


@pytest.mark.parametrize("text, message", [("[1, 2]", "expected a JSON object, got list"),
                                           ("{not json", "not valid JSON")])
def test_every_reader_names_the_file_and_what_is_wrong(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    path = tmp_path / "config.json"
    for call, error in ((lambda: read_config(tmp_path), CheckpointError),
                        (lambda: read_checkpoint_config(tmp_path), LoadError),
                        (lambda: read_json_object(path), ValueError)):
        with pytest.raises(error, match=message) as info:
            call()
        assert str(path) in str(info.value)
    (tmp_path / "tokenizer_config.json").write_text(text)
    with pytest.raises(TokenizerError, match=message):
        special_token_ids(tmp_path, tokenizer=object(), config={})


def test_a_missing_optional_file_is_its_default(tmp_path):
    assert read_json_object(tmp_path / "special_tokens_map.json", missing={}) == {}
    with pytest.raises(ValueError, match="no such file"):
        read_json_object(tmp_path / "config.json")
