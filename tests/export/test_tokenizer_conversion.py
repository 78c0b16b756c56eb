"""A checkpoint without tokenizer.json, as the public checkpoints ship (issue 25, defect 2): export
converts spiece.model (BigBird, Pegasus), vocab.json + merges.txt (Longformer, LED) and vocab.txt
(BERT) into a tokenizer.json that gives transformers' ids; where it cannot, the error names the
files found and the one command that makes tokenizer.json."""

import sys

import pytest
import transformers
from tokenizers import Tokenizer

from longdoc.export.exporter import CheckpointError, export_model
from longdoc.export.manifest import Manifest
from longdoc.model.tokenization import SAMPLE_TEXTS
from longdoc.testing.tiny_models import (SLOW_TOKENIZER_CLASSES, make_tiny_checkpoint, make_tiny_encoder_decoder, make_tiny_led, make_tiny_longformer,
                               write_slow_tokenizer)


def quiet(_msg):
    pass


CASES = {  # family -> (task, checkpoint maker)
    "bigbird": ("qa", lambda d: make_tiny_checkpoint(d, "qa")),
    "pegasus": ("summarize", lambda d: make_tiny_checkpoint(d, "summarize")),
    "longformer": ("qa", lambda d: make_tiny_longformer(d, "qa")),
    "led": ("summarize", lambda d: make_tiny_led(d)),
    "bert": ("summarize", lambda d: make_tiny_encoder_decoder(d)),
}


@pytest.mark.parametrize("family", CASES)
def test_export_converts_the_tokenizer_files_a_public_checkpoint_ships(tmp_path, family):
    task, make = CASES[family]
    ckpt = write_slow_tokenizer(make(tmp_path / "ckpt"), family)
    assert not (ckpt / "tokenizer.json").exists()
    messages = []
    export_model(ckpt, tmp_path / "model", task, progress=messages.append)
    assert any("converted the checkpoint's tokenizer" in m for m in messages)
    served = Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json"))
    theirs = getattr(transformers, SLOW_TOKENIZER_CLASSES[family]).from_pretrained(ckpt)
    for text in (*SAMPLE_TEXTS, "the water of the sea is warm"):
        assert served.encode(text).ids == theirs(text)["input_ids"]
    assert len(set(served.encode("the water of the sea is warm").ids)) > 3  # real pieces, not all unknown
    assert Manifest.load(tmp_path / "model").files["tokenizer.json"]  # checksummed like a copied one


def test_without_transformers_the_error_names_the_files_and_the_command(tmp_path, monkeypatch):
    ckpt = write_slow_tokenizer(make_tiny_checkpoint(tmp_path / "ckpt", "qa"), "bigbird")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(CheckpointError) as err:
        export_model(ckpt, tmp_path / "model", "qa", progress=quiet)
    text = str(err.value)
    assert "found spiece.model" in text and "pip install 'transformers>=4.44' 'sentencepiece>=0.2'" in text
    assert f"BigBirdTokenizer.from_pretrained('{ckpt}').backend_tokenizer.save('{ckpt}/tokenizer.json')" in text
    assert not (tmp_path / "model").exists()


def test_no_tokenizer_files_at_all_says_what_each_family_needs(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qa")
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"found no tokenizer files \(the directory holds config.json, "
                                              r"model.safetensors\).*spiece.model \(BigBird, BigBird-Pegasus.*"
                                              r"vocab.json \+ merges.txt \(Longformer, LED.*vocab.txt \(BERT"):
        export_model(ckpt, tmp_path / "model", "qa", progress=quiet)


def test_the_command_in_the_error_makes_a_tokenizer_json_export_takes(tmp_path):
    import subprocess

    from longdoc.model.tokenization import convert_command

    ckpt = write_slow_tokenizer(make_tiny_checkpoint(tmp_path / "ckpt", "qa"), "bigbird")
    subprocess.run(convert_command(ckpt).replace("python", sys.executable, 1), shell=True, check=True)
    assert (ckpt / "tokenizer.json").is_file()
    export_model(ckpt, tmp_path / "model", "qa", progress=quiet)
