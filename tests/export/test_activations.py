"""One activation table (longdoc.model.activations): the export lowers every name of it to the
values PyTorch computes, and refuses a config naming any other when it reads the config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.graph import LOWERED_ACTIVATIONS, GraphBuilder
from longdoc.export.verify import verify_model
from longdoc.model.activations import ACTIVATIONS
from longdoc.testing.tiny_models import make_tiny_checkpoint, make_tiny_encoder_decoder


def quiet(_msg):
    pass


def test_the_export_lowers_the_whole_table():
    assert set(LOWERED_ACTIVATIONS) == set(ACTIVATIONS)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_lowering_computes_what_pytorch_computes(name):
    import onnxruntime as ort
    from onnx import TensorProto

    x = np.concatenate([np.linspace(-14, 14, 281), [-1e-3, 0.0, 1e-3]]).astype(np.float32)[None]  # (1, 284)
    g = GraphBuilder("activation")
    g.output(g.activation(g.input("x", TensorProto.FLOAT, [1, x.shape[1]]), name), "y", None, [1, x.shape[1]])
    session = ort.InferenceSession(g.model(name).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    want = ACTIVATIONS[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_export_refuses_an_activation_it_cannot_lower_when_it_reads_the_config(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "qa")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "hidden_act": "swiglu_x"}))
    (checkpoint / "model.safetensors").unlink()  # refused before any weight is looked for
    with pytest.raises(CheckpointError, match=r"activation 'swiglu_x' cannot be exported \(the export lowers gelu"):
        export_model(checkpoint, tmp_path / "out", "qa", progress=quiet)


def test_export_refuses_a_nested_decoder_activation(tmp_path):
    checkpoint = make_tiny_encoder_decoder(tmp_path / "b2b")
    config = json.loads((checkpoint / "config.json").read_text())
    config["decoder"]["hidden_act"] = "swiglu_x"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="activation 'swiglu_x' cannot be exported"):
        export_model(checkpoint, tmp_path / "out", "summarize", progress=quiet)


@pytest.mark.parametrize("name", ["quick_gelu", "mish"])
def test_a_bigbird_that_trains_with_any_activation_exports_with_it(tmp_path, name):
    # quick_gelu and mish: in the model's table before, not in the export's
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "classify", hidden_act=name)
    export_model(checkpoint, tmp_path / "out", "classify", progress=quiet)
    report = verify_model(tmp_path / "out", checkpoint, lengths=[32, 200], progress=quiet, threads=1)
    assert report.ok, report.summary()
