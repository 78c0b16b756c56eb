"""The architecture registry (longdoc.model.registry) is the one source of per-architecture facts."""

from __future__ import annotations

import pytest

from longdoc.model import registry
from longdoc.model.registry import REGISTRY, TASKS, Architecture


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_every_record_names_classes_its_module_has(model_type):
    record = REGISTRY[model_type]
    config_class = record.load(record.config_class)
    assert config_class.model_type == model_type
    for architecture, class_name in record.classes.items():
        assert callable(record.load(class_name)), architecture
    assert record.base_class in record.classes
    assert set(record.tasks) <= set(TASKS) and record.tasks
    assert set(record.tasks.values()) <= set(record.classes)
    assert set(record.train_tasks) <= set(record.tasks)
    assert set(record.exports()) <= set(record.classes)
    assert set(record.global_tokens) <= set(record.tasks)


def test_tasks_are_defined_once():
    from longdoc.export import manifest
    from longdoc.model import data

    assert manifest.TASKS is TASKS and data.TASKS is TASKS


def test_summarize_input_comes_from_the_record():
    from longdoc.model.tokenization import summarize_input_of

    assert {t: summarize_input_of(t) for t in REGISTRY} == {t: r.summarize_input for t, r in REGISTRY.items()}
    assert summarize_input_of(None) == summarize_input_of("gpt2") == "doc-eos"


def test_checkpoint_loading_and_training_read_the_registry(monkeypatch):
    from longdoc.model.checkpoint import resolve_class
    from longdoc.model.train import _check_task_config

    record = Architecture(model_type="fake_bird", module="longdoc.model.bigbird", config_class="BigBirdConfig",
                          classes={"FakeBirdForMaskedLM": "BigBirdForMaskedLM"}, base_class="FakeBirdForMaskedLM",
                          tasks={"mlm": "FakeBirdForMaskedLM"}, train_tasks=("mlm",))
    with pytest.raises(ValueError, match="needs a 'big_bird' model"):
        _check_task_config("mlm", {"model_type": "fake_bird"}, "x")
    monkeypatch.setitem(REGISTRY, "fake_bird", record)
    cls, _, arch = resolve_class({"model_type": "fake_bird"})
    assert (cls.__name__, arch) == ("BigBirdForMaskedLM", "FakeBirdForMaskedLM")
    _check_task_config("mlm", {"model_type": "fake_bird"}, "x")  # trainable now
    with pytest.raises(ValueError, match="task 'qa' needs a 'big_bird' model"):
        _check_task_config("qa", {"model_type": "fake_bird"}, "x")


def test_register_refuses_a_second_record_and_unknown_tasks():
    with pytest.raises(ValueError, match="registered already"):
        registry.register(REGISTRY["big_bird"])
    with pytest.raises(ValueError, match="unknown tasks"):
        registry.register(Architecture(model_type="x", module="m", config_class="C", classes={"A": "A"},
                                       base_class="A", tasks={"translate": "A"}))


# --- one activation table ------------------------------------------------------------------------

def test_one_activation_table_for_every_model():
    from longdoc.model import activations, bigbird, led, pegasus

    assert bigbird.ACTIVATIONS is activations.ACTIVATIONS
    assert pegasus.ACTIVATIONS is activations.ACTIVATIONS
    assert led.ACTIVATIONS is activations.ACTIVATIONS


@pytest.mark.parametrize("name", ["quick_gelu", "mish", "relu6"])
def test_every_config_accepts_every_activation_of_the_table(name):
    from longdoc.model.bigbird import BigBirdConfig
    from longdoc.model.led import LEDConfig
    from longdoc.model.longformer import LongformerConfig
    from longdoc.model.pegasus import BigBirdPegasusConfig

    assert BigBirdConfig.from_dict({"hidden_act": name}).hidden_act == name
    assert LongformerConfig.from_dict({"hidden_act": name}).hidden_act == name
    assert BigBirdPegasusConfig.from_dict({"activation_function": name}).activation_function == name
    assert LEDConfig.from_dict({"activation_function": name}).activation_function == name
    with pytest.raises(ValueError, match="activation_function 'swiglu_x' is not supported"):
        BigBirdPegasusConfig.from_dict({"activation_function": "swiglu_x"})
