"""`longdoc export --sparse-gather` (export/manifest.py SPARSE_GATHER): every way of gathering
BigBird's key/value blocks is exact, so each export passes `verify` against the PyTorch reference
(block-sparse lengths included) for each family that runs BigBird's attention; the manifest records
the choice (the runtime feeds a `window` graph tables without the window). The graph-level
equality with the dense oracle is tests/export/test_sparse_attention.py."""

from __future__ import annotations

import pytest

from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.manifest import Manifest
from longdoc.export.verify import verify_model
from longdoc.testing.tiny_models import make_tiny_checkpoint, make_tiny_encoder_decoder, make_tiny_longformer

FAMILIES = {"bigbird-qa": ("qa", make_tiny_checkpoint), "pegasus": ("summarize", make_tiny_checkpoint),
            "bert2bert": ("summarize", make_tiny_encoder_decoder)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gather")
    return {name: (task, make(root / name, task) if make is make_tiny_checkpoint else make(root / name))
            for name, (task, make) in FAMILIES.items()}


@pytest.mark.parametrize("gather", ["all-heads", "onehot", "window"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_sparse_gather_passes_verify(checkpoints, tmp_path, family, gather):
    task, ckpt = checkpoints[family]
    export_model(ckpt, tmp_path / "out", task, sparse_gather=gather, progress=lambda _m: None)
    manifest = Manifest.load(tmp_path / "out")
    assert manifest.sparse_gather == gather
    report = verify_model(tmp_path / "out", ckpt, progress=lambda _m: None, threads=1)
    assert report.ok, report.summary()
    assert any(c.length > manifest.full_attention_max_length for c in report.checks)  # block-sparse lengths too


def test_fp16_window_passes_verify(checkpoints, tmp_path):
    task, ckpt = checkpoints["bigbird-qa"]
    export_model(ckpt, tmp_path / "out", task, dtype="fp16", sparse_gather="window", progress=lambda _m: None)
    report = verify_model(tmp_path / "out", ckpt, progress=lambda _m: None, threads=1)
    assert report.ok, report.summary()


def test_sparse_gather_is_refused_where_it_does_not_apply(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match="--sparse-gather window: longformer"):
        export_model(make_tiny_longformer(tmp_path / "lf", "qa"), tmp_path / "a", "qa", sparse_gather="window",
                     progress=lambda _m: None)
    task, ckpt = checkpoints["bigbird-qa"]
    with pytest.raises(CheckpointError, match="built for float attention products"):
        export_model(ckpt, tmp_path / "b", task, dtype="int8", int8_attention="dynamic", sparse_gather="onehot",
                     progress=lambda _m: None)
    with pytest.raises(CheckpointError, match="is not one of"):
        export_model(ckpt, tmp_path / "c", task, sparse_gather="scatter", progress=lambda _m: None)
