"""`longdoc train`'s flags are TrainConfig's fields (model/train_config.py): one description of a
run, so a field cannot lack its flag or have a flag whose default disagrees with it (issue 26)."""

import argparse
from dataclasses import fields

import pytest

from longdoc.model.cli import add_commands
from longdoc.model.train_config import TrainConfig, config_from_args


def parser():
    p = argparse.ArgumentParser()
    add_commands(p.add_subparsers(dest="command"))
    return p


REQUIRED = ["train", "--task", "qa", "--model", "m", "--train", "t.jsonl", "--output", "out"]


def test_every_field_has_its_flag_and_default():
    args = parser().parse_args(REQUIRED)
    assert config_from_args(args) == TrainConfig(task="qa", model="m", train="t.jsonl", output="out")
    for f in fields(TrainConfig):
        assert hasattr(args, f.name) or f.metadata.get("cli") is False, f.name


def test_flags_reach_the_config():
    args = parser().parse_args([*REQUIRED, "--lr", "1e-4", "--max-steps", "7", "--labels", "a, b", "--resume",
                                "--freeze-encoder", "--precision", "bf16", "--dropout", "0"])
    cfg = config_from_args(args)
    assert (cfg.lr, cfg.max_steps, cfg.labels, cfg.resume, cfg.freeze_encoder, cfg.precision, cfg.dropout) == (
        1e-4, 7, ["a", "b"], "latest", True, "bf16", 0.0)
    assert config_from_args(parser().parse_args([*REQUIRED, "--resume", "out/checkpoint-5"])).resume == "out/checkpoint-5"


def test_a_run_needs_its_task_model_data_and_output():
    with pytest.raises(TypeError, match="needs task"):
        TrainConfig(model="m", train="t", output="o")
    with pytest.raises(SystemExit):
        parser().parse_args(["train", "--task", "qa"])


def test_a_recipes_own_default_is_the_one_its_help_shows():
    """A script that changes a field's default (data/train_default_summarize)
    shows that default, not the field's own "(default: ...)" sentence."""
    from longdoc.model.train_config import add_train_arguments

    p = argparse.ArgumentParser()
    add_train_arguments(p, only=("max_length",), defaults={"max_length": 768})
    text = " ".join(p.format_help().split())
    assert "(default: 768)" in text and "max_position_embeddings" not in text
    assert p.parse_args([]).max_length == 768
