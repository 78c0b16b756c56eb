"""Checkpoints whose position table is not 4096 (issue 11, defect 1).

transformers draws BigBird's hf-train random blocks over the checkpoint's own
`max_position_embeddings` at the padded lengths 1024/3072/4096 (`HF_LEGACY_LENGTHS`), so the
export must carry that number into the manifest and the served model must build its layout
from it. Each checkpoint is exported and compared with transformers at every special length it
can hold (and at lengths that pad to them), batch 1 and 3."""

import pytest

from longdoc.export.exporter import export_model
from longdoc.export.manifest import Manifest
from longdoc.export.verify import verify_lengths, verify_model
from longdoc.model.layout import HF_LEGACY_LENGTHS, AttentionSpec
from longdoc.testing.tiny_models import make_tiny_checkpoint

POSITIONS = (512, 1024, 2048, 4096, 8192)


def quiet(_msg):
    pass


def special_lengths(positions: int, block_size: int = 16) -> list[int]:
    """Every legacy padded length the table holds, and one length just below each that pads to it."""
    lengths = [n for n in HF_LEGACY_LENGTHS if n <= positions]
    return sorted({*lengths, *(n - block_size // 2 - 1 for n in lengths), positions})


@pytest.mark.parametrize("positions", POSITIONS)
def test_encoder_with_any_position_table_matches_transformers(tmp_path, positions):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qa", source="transformers", max_position_embeddings=positions)
    manifest = export_model(ckpt, tmp_path / "model", "qa", progress=quiet)
    assert AttentionSpec.from_dict(manifest.attention).max_position_embeddings == positions
    assert Manifest.load(tmp_path / "model").attention["max_position_embeddings"] == positions
    report = verify_model(tmp_path / "model", ckpt, against="transformers", lengths=special_lengths(positions),
                          progress=quiet, threads=1)
    assert report.ok, report.summary()


@pytest.mark.parametrize("positions", (1024, 2048))
def test_pegasus_with_a_small_position_table_matches_transformers(tmp_path, positions):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "summarize", source="transformers",
                                max_position_embeddings=positions)
    export_model(ckpt, tmp_path / "model", "summarize", progress=quiet)
    report = verify_model(tmp_path / "model", ckpt, against="transformers", lengths=special_lengths(positions),
                          progress=quiet, threads=1, generation_lengths=1)
    assert report.ok, report.summary()


@pytest.mark.parametrize("positions", POSITIONS)
def test_default_verify_lengths_include_every_special_length(tmp_path, positions):
    """`verify` with no --lengths must try the lengths where transformers' plan changes."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qa", max_position_embeddings=positions)
    manifest = export_model(ckpt, tmp_path / "model", "qa", progress=quiet)
    lengths = verify_lengths(manifest)
    for n in HF_LEGACY_LENGTHS:
        if n <= positions:
            assert n in lengths and any(n - 16 < x < n for x in lengths), (n, lengths)
