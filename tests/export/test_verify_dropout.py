"""verify's transformers reference is deterministic whatever dropout the checkpoint's config holds
(issue 25, defect 1): checkpoints saved with the dropout of transformers' default configs (0.1, as
the public checkpoints), below and above BigBird's full-attention threshold (144 tokens for the tiny
shape), for every architecture. Before the fix, BigBird rebuilt `attention.self` on a short input
with a fresh Dropout(0.1) and verify failed a correct export (16/28 checks)."""

import numpy as np
import pytest
import transformers

from longdoc.export.exporter import export_model
from longdoc.export.manifest import Manifest
from longdoc.export.verify import Reference, verify_model
from longdoc.testing.tiny_models import (default_dropout, make_tiny_checkpoint, make_tiny_encoder_decoder, make_tiny_led,
                               make_tiny_longformer)

LENGTHS = [40, 200]  # below and above the tiny BigBird's full-attention threshold (144)


def quiet(_msg):
    pass


CHECKPOINTS = {
    "bigbird-qa": ("qa", lambda d: make_tiny_checkpoint(
        d, "qa", source="transformers", **default_dropout(transformers.BigBirdConfig))),
    "bigbird-classify": ("classify", lambda d: make_tiny_checkpoint(
        d, "classify", source="transformers", **default_dropout(transformers.BigBirdConfig))),
    "bigbird-mlm": ("mlm", lambda d: make_tiny_checkpoint(
        d, "mlm", source="transformers", **default_dropout(transformers.BigBirdConfig))),
    "pegasus": ("summarize", lambda d: make_tiny_checkpoint(
        d, "summarize", source="transformers", **default_dropout(transformers.BigBirdPegasusConfig))),
    "longformer-qa": ("qa", lambda d: make_tiny_longformer(
        d, "qa", **default_dropout(transformers.LongformerConfig))),
    "led": ("summarize", lambda d: make_tiny_led(d, **default_dropout(transformers.LEDConfig))),
    "bert2bert": ("summarize", lambda d: make_tiny_encoder_decoder(d, **default_dropout(transformers.BertConfig))),
}


def test_the_tiny_checkpoints_hold_the_default_dropout(tmp_path):
    ckpt = CHECKPOINTS["bigbird-qa"][1](tmp_path / "ckpt")
    config = transformers.AutoConfig.from_pretrained(ckpt)
    assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == 0.1


@pytest.mark.parametrize("family", CHECKPOINTS)
def test_reference_is_deterministic_and_verify_passes_with_default_dropout(tmp_path, family):
    task, make = CHECKPOINTS[family]
    ckpt = make(tmp_path / "ckpt")
    export_model(ckpt, tmp_path / "model", task, progress=quiet)
    manifest = Manifest.load(tmp_path / "model")
    ref = Reference(ckpt, manifest, "transformers")
    rng = np.random.default_rng(0)
    for S in LENGTHS:
        ids = rng.integers(10, 200, (2, S))
        mask = np.ones((2, S), np.int64)
        if task == "summarize":
            dec = rng.integers(10, 200, (2, 4))
            first, second = ref.decoder_logits(ids, mask, dec), ref.decoder_logits(ids, mask, dec)
            np.testing.assert_array_equal(first, second, err_msg=f"{family} length {S}")
        else:
            gm = np.zeros_like(ids) if manifest.global_tokens != "none" else None
            if gm is not None:
                gm[:, 0] = 1
            first, second = ref.encoder(ids, mask, gm), ref.encoder(ids, mask, gm)
            for name in manifest.outputs:
                np.testing.assert_array_equal(first[name], second[name], err_msg=f"{family} {name} length {S}")
    report = verify_model(tmp_path / "model", ckpt, against="transformers", lengths=LENGTHS, progress=quiet,
                          threads=1, max_new_tokens=4)
    assert report.ok, report.summary()
    assert max(c.max_abs_diff for c in report.checks if c.max_abs_diff is not None) <= 1e-4
