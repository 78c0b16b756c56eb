import json

import pytest

from longdoc.export.manifest import Manifest, ManifestError

BASE = dict(task="qa", architecture="BigBirdForQuestionAnswering", dtype="fp32", graphs={"encoder": "encoder.onnx"},
            attention={"pattern": "bigbird", "block_size": 16}, num_layers=2, num_heads=2, hidden_size=32,
            block_size=16, min_length=16, max_length=512, full_attention_max_length=144,
            special_tokens={"pad": 0, "cls": 4, "sep": 5})


def test_round_trip(tmp_path):
    m = Manifest(**{**BASE, "special_tokens": {"pad": 0, "cls": 4, "sep": 5, "mask": None}})
    m.save(tmp_path)
    assert Manifest.load(tmp_path) == m
    assert json.loads((tmp_path / "manifest.json").read_text())["format_version"] == 1


@pytest.mark.parametrize("change, message", [
    ({"task": "translate"}, "task 'translate'"),
    ({"dtype": "bf16"}, "dtype 'bf16'"),
    ({"max_length": 500}, "not a multiple of block_size"),
    ({"num_heads": 3}, "not a multiple of num_heads"),
    ({"num_layers": 0}, "num_layers must be a positive integer"),
    ({"task": "summarize"}, "needs a 'decoder' graph"),
    ({"task": "classify"}, "needs labels"),
    ({"graphs": {}}, "'encoder'"),
    ({"special_tokens": {"pad": 0, "sep": 5}}, "special_tokens has no cls id .*export the checkpoint again"),
    ({"layer_attention": [{"pattern": "bigbird", "block_size": 16}]}, "layer_attention has 1 entries for 2 layers"),
    ({"layer_attention": [{"pattern": "bigbird", "block_size": 16}, {"pattern": "dense", "block_size": 8}]},
     "every layer_attention block_size must be block_size 16"),
    ({"layer_attention": [{"block_size": 16}] * 2}, "layer_attention must be a list of AttentionSpec dicts"),
])
def test_invalid_manifests_say_why(change, message):
    with pytest.raises(ManifestError, match=message):
        Manifest(**{**BASE, **change})


def test_layer_attention_is_every_layers_spec(tmp_path):
    assert Manifest(**BASE).layer_attention_specs() == [BASE["attention"]] * 2
    layers = [{"pattern": "longformer", "block_size": 16, "band": 16}, {"pattern": "longformer", "block_size": 16,
                                                                        "band": 32, "window_blocks": 5}]
    m = Manifest(**{**BASE, "layer_attention": layers})
    m.save(tmp_path)
    assert Manifest.load(tmp_path).layer_attention_specs() == layers


def test_load_errors(tmp_path):
    with pytest.raises(ManifestError, match="no manifest.json"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({**BASE, "colour": "red"}))
    with pytest.raises(ManifestError, match="unknown manifest keys: colour"):
        Manifest.load(tmp_path)
    data = dict(BASE)
    del data["block_size"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="missing keys: block_size"):
        Manifest.load(tmp_path)
