"""Export reads each architecture from its registry record (longdoc.export.registry) and asks no
"which architecture is this?" of its own."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.registry import LOWERINGS, build_bigbird, register_lowering
from longdoc.model.registry import REGISTRY, Architecture
from longdoc.testing.tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# generic code: reads records, never names an architecture
GENERIC = ("export/exporter.py", "export/verify.py", "model/checkpoint.py", "model/train.py")
# every registered model type and architecture class name (a new family is covered once registered)
NAMES = set(REGISTRY) | {name for a in REGISTRY.values() for name in (*a.classes, *a.exports())}


def architecture_questions(source: str) -> list[str]:
    """Lines that compare a `model_type` with something, or name a model type or an architecture
    class in a string (docstrings aside)."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Compare) and "model_type" in ast.unparse(node)
                and any(isinstance(c, ast.Constant) or isinstance(c, (ast.Tuple, ast.List, ast.Set))
                        for c in (node.left, *node.comparators))):
            found.append(node)  # compared with a literal: a registry lookup is not a question
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and node.value in NAMES):
            found.append(node)
    return [f"{node.lineno}: {ast.unparse(node)}" for node in found]


def quiet(_msg):
    pass


def test_every_model_type_has_one_record_and_one_lowering():
    assert set(LOWERINGS) == set(REGISTRY)
    for model_type, lowering in LOWERINGS.items():
        assert lowering.model is REGISTRY[model_type]


def test_the_question_finder_finds_questions():
    # the branches the registry replaced (export/exporter.py, model/train.py before it)
    for line in ('x = config["model_type"] == "longformer"', 'y = config.get("model_type") in ("longformer", "led")',
                 'def f():\n    return "EncoderDecoderModel"', "led = cfg.model_type != WANT[0:1] or model_type in (a, b)",
                 'a = {"qa": "BigBirdForQuestionAnswering"}', 'b = ("modernbert", 1)',
                 'c = {"qa": "ModernBertForQuestionAnswering"}'):
        assert architecture_questions(line), line
    assert not architecture_questions('def f():\n    """e.g. "BigBirdModel" or "led"."""\n    return "a Longformer model"')


@pytest.mark.parametrize("path", GENERIC)
def test_generic_code_asks_no_architecture_question(path):
    found = architecture_questions((ROOT / path).read_text())
    assert not found, "\n".join(f"{path}:{line}" for line in found)


def test_a_new_architecture_exports_through_its_record_alone(tmp_path, monkeypatch):
    """A "fake_bird" is a BigBird under another model_type: one record, one lowering registered in
    the test, no change to the exporter; its export equals the BigBird export of the same weights."""
    checkpoint = make_tiny_checkpoint(tmp_path / "bigbird", "qa")
    fake = tmp_path / "fake"
    fake.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (fake / name).write_bytes((checkpoint / name).read_bytes())
    config = json.loads((checkpoint / "config.json").read_text())
    (fake / "config.json").write_text(json.dumps({**config, "model_type": "fake_bird",
                                                  "architectures": ["FakeBirdForQuestionAnswering"]}))
    with pytest.raises(CheckpointError, match="model_type 'fake_bird' is not supported"):
        export_model(fake, tmp_path / "out0", "qa", progress=quiet)

    monkeypatch.setitem(REGISTRY, "fake_bird", Architecture(
        model_type="fake_bird", module="longdoc.model.bigbird", config_class="BigBirdConfig",
        classes={"FakeBirdForQuestionAnswering": "BigBirdForQuestionAnswering"},
        base_class="FakeBirdForQuestionAnswering", tasks={"qa": "FakeBirdForQuestionAnswering"}))
    monkeypatch.setitem(LOWERINGS, "fake_bird", None)  # removed again after the test
    register_lowering("fake_bird", build_bigbird)

    theirs = export_model(checkpoint, tmp_path / "bigbird-out", "qa", progress=quiet)
    ours = export_model(fake, tmp_path / "fake-out", "qa", progress=quiet)
    assert ours.architecture == "FakeBirdForQuestionAnswering"
    assert ours.files["encoder.onnx"] == theirs.files["encoder.onnx"]
    for key in ("attention", "block_size", "min_length", "max_length", "full_attention_max_length", "num_layers",
                "num_heads", "hidden_size", "global_tokens", "summarize_input"):
        assert getattr(ours, key) == getattr(theirs, key), key
    with pytest.raises(CheckpointError, match=r"fake_bird checkpoint exports as --task qa, not 'classify'"):
        export_model(fake, tmp_path / "out1", "classify", progress=quiet)
