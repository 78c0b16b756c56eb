"""verify runs only at lengths its reference can run (issue 25, defect 5). A tiny LED with one window
of 24 and 1024 positions exported with lengths 1..1020, and verify stopped with `index out of
range in self`: transformers pads 1013 tokens to 1032, a multiple of the window, past its position
table. The export's bounds are now transformers' (1..1008), and verify skips, saying why, a length
either side cannot run."""

import json

import pytest

from longdoc.export.exporter import export_model
from longdoc.export.manifest import Manifest
from longdoc.export.verify import VerifyError, verify_model
from longdoc.testing.tiny_models import make_tiny_led


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def led(tmp_path_factory):
    root = tmp_path_factory.mktemp("led-window-24")
    ckpt = make_tiny_led(root / "ckpt", attention_window=24, max_encoder_position_embeddings=1024)
    export_model(ckpt, root / "model", "summarize", progress=quiet)
    return root, ckpt


def test_led_export_ends_at_the_last_whole_window_of_the_position_table(led):
    root, _ = led
    m = Manifest.load(root / "model")
    assert (m.min_length, m.max_length) == (1, 1008)  # 42 windows of 24; 1013 would pad to 1032 > 1024


def test_verify_against_transformers_runs_at_every_default_length(led):
    root, ckpt = led
    report = verify_model(root / "model", ckpt, against="transformers", progress=quiet, threads=1,
                          max_new_tokens=4)
    assert report.ok, report.summary()
    assert max(c.length for c in report.checks) == 1008 and report.skipped == {}


def test_verify_skips_lengths_the_reference_cannot_run_and_says_why(led, tmp_path):
    root, ckpt = led
    messages = []
    report = verify_model(root / "model", ckpt, against="transformers", lengths=[100, 1013], progress=messages.append,
                          threads=1, max_new_tokens=4)
    assert report.ok and {c.length for c in report.checks if c.length} == {100}
    assert report.skipped == {1013: "outside the export's lengths 1..1008"}
    assert "skipping length 1013: outside the export's lengths 1..1008" in messages
    assert "skipped length 1013: outside the export's lengths 1..1008" in report.summary()
    with pytest.raises(VerifyError, match="no length to check: 1013: outside"):
        verify_model(root / "model", ckpt, lengths=[1013], progress=quiet, threads=1)


def test_an_export_with_longer_bounds_than_transformers_runs_is_verified_where_it_can(led, tmp_path):
    """An export made before the bounds agreed (lengths 1..1020): the lengths past 1008 are skipped."""
    import shutil

    root, ckpt = led
    shutil.copytree(root / "model", tmp_path / "model")
    path = tmp_path / "model" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_length": 1020}))
    report = verify_model(tmp_path / "model", ckpt, against="transformers", lengths=[100, 1013, 1020], progress=quiet,
                          threads=1, max_new_tokens=4)
    assert report.ok, report.summary()
    why = 'the reference runs lengths 1..1008 of this checkpoint (docs/export.md, "Length bounds")'
    assert report.skipped == {1013: why, 1020: why}
