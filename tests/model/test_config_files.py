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


def test_the_encoder_decoders_read_the_same_generation_defaults():
    """BigBird-Pegasus, LED and the BERT2BERT config read one list of generation defaults
    (`GenerationDefaults`): forced_bos_token_id, which the BERT2BERT config kept in `extra` and so
    never passed to the search, is read by all three and written back as it came."""
    from longdoc.model.encoder_decoder import EncoderDecoderConfig
    from longdoc.model.led import LEDConfig
    from longdoc.model.pegasus import BigBirdPegasusConfig

    b2b = EncoderDecoderConfig.from_dict({
        "model_type": "encoder-decoder", "forced_bos_token_id": 7, "num_beams": 3, "unknown_key": 1,
        "encoder": {"model_type": "big_bird", "hidden_size": 32, "num_attention_heads": 2},
        "decoder": {"model_type": "bert", "hidden_size": 32, "num_attention_heads": 2}})
    for cfg in (b2b, LEDConfig.from_dict({"forced_bos_token_id": 7, "num_beams": 3}),
                BigBirdPegasusConfig.from_dict({"forced_bos_token_id": 7, "num_beams": 3})):
        assert (cfg.forced_bos_token_id, cfg.num_beams) == (7, 3)
        assert cfg.to_dict()["forced_bos_token_id"] == 7
    assert b2b.extra == {"unknown_key": 1} and b2b.to_dict()["unknown_key"] == 1
