"""ModernBERT has a model record but no ONNX lowering yet (per-layer layouts, issue 28): `longdoc
export` and verify refuse its checkpoints by name, before reading any weight, and write nothing."""

from __future__ import annotations

import pytest
import torch

from longdoc.export.exporter import CheckpointError, export_model, read_config
from longdoc.export.registry import LOWERINGS, build_refused

REFUSAL = "export of ModernBERT is not implemented yet: per-layer layouts, issue 28"


@pytest.fixture
def modernbert_checkpoint(tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.ModernBertConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                           num_attention_heads=2, local_attention=8, pad_token_id=0, bos_token_id=1,
                                           cls_token_id=1, eos_token_id=2, sep_token_id=2, num_labels=2)
    directory = tmp_path / "modernbert"
    transformers.ModernBertForSequenceClassification(config).save_pretrained(directory)
    return directory


def test_export_refuses_modernbert_by_name(modernbert_checkpoint, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=REFUSAL):
        export_model(modernbert_checkpoint, out, task="classify", progress=lambda _m: None)
    assert not out.exists()
    with pytest.raises(CheckpointError, match=REFUSAL):
        read_config(modernbert_checkpoint)  # the gate verify passes too


def test_the_refused_build_step_says_why_too():
    assert LOWERINGS["modernbert"].not_implemented == REFUSAL
    with pytest.raises(NotImplementedError, match=REFUSAL):
        build_refused(None, {"model_type": "modernbert"}, None)


def test_every_other_architecture_exports():
    assert [t for t, lowering in LOWERINGS.items() if lowering.not_implemented] == ["modernbert"]


def test_a_task_hint_names_only_exportable_model_types():
    from longdoc.export.exporter import exportable_model_types
    from longdoc.model.registry import model_types_for

    assert "modernbert" in model_types_for("mlm")  # it has an MLM model ...
    assert "modernbert" not in exportable_model_types("mlm")  # ... but no export to point a user to
    assert exportable_model_types("mlm") == [t for t in model_types_for("mlm") if t != "modernbert"]
