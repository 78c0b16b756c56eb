"""`TrainConfig`, the one description of a training run, and the command-line flags derived from it
(`longdoc train`, `data/train_default_*.py`): each field's help, choices and default are written
once, here. Torch-free, so that building the CLI does not import torch (as service/cli.py derives
its flags from `Settings`)."""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, field, fields

from longdoc.model.data import MAX_QUESTION_LENGTH  # no torch


def _opt(default, help: str, **cli):
    """A field with its flag's help (and argparse extras: choices, required, cli=False)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class TrainConfig:
    task: str = _opt(None, "training objective", choices=("mlm", "qa", "classify", "summarize"), required=True)
    model: str = _opt(None, "checkpoint dir to start from, or a config.json (random init)", required=True)
    train: str = _opt(None, "training JSONL (formats: docs/training.md)", required=True)
    output: str = _opt(None, "output directory: OUTPUT/checkpoint-STEP/ (resumable) and, at the end, the final model",
                       required=True)
    eval: str | None = _opt(None, "evaluation JSONL (eval loss every --eval-every steps; default: no evaluation)")
    tokenizer: str | None = _opt(None, "tokenizer.json or its dir (default: the model's dir)")
    max_length: int | None = _opt(None, "encoder tokens (default: the config's max_position_embeddings)")
    max_target_length: int = _opt(256, "summarize: summary tokens")
    batch_size: int = _opt(8, "sequences per micro-batch")
    grad_accum: int = _opt(1, "micro-batches per optimizer step")
    lr: float = _opt(5e-5, "peak learning rate (AdamW, linear decay)")
    weight_decay: float = _opt(0.01, "AdamW weight decay")
    adam_betas: tuple[float, float] = _opt((0.9, 0.999), "AdamW betas", cli=False)
    adam_eps: float = _opt(1e-8, "AdamW epsilon", cli=False)
    warmup_steps: int | None = _opt(None, "warm-up steps (default: --warmup-ratio of the steps)")
    warmup_ratio: float = _opt(0.06, "share of the steps warming up")
    epochs: float = _opt(1.0, "passes over the training data")
    max_steps: int | None = _opt(None, "optimizer steps, overriding --epochs (default: from --epochs)")
    max_grad_norm: float = _opt(1.0, "gradient clipping norm")
    log_every: int = _opt(10, "optimizer steps between log lines")
    eval_every: int = _opt(500, "steps between evaluations; 0: only at the end")
    save_every: int = _opt(500, "steps between checkpoints; 0: only at the end")
    keep_checkpoints: int = _opt(2, "newest OUTPUT/checkpoint-* kept")
    precision: str = _opt("auto", "auto: bf16 autocast on CUDA where supported, else fp16; fp32 on CPU. bf16 works "
                                  "on CPU too, fp16 only on CUDA", choices=("auto", "fp32", "bf16", "fp16"))
    device: str = _opt("auto", "auto | cpu | cuda | cuda:N")
    seed: int = _opt(0, "random seed (initialization, data order, masking)")
    plan: str = _opt("hf-train", "random-block plan (hf-train: the blocks the public checkpoints were trained with)",
                     choices=("hf-train", "hf-eval", "seeded"))
    resume: str | bool = _opt(False, "continue from the latest OUTPUT/checkpoint-* (or the given checkpoint dir; "
                                     "default: start afresh)")
    mlm_probability: float = _opt(0.15, "mlm: share of tokens masked")
    qa_long_context: str = _opt("window", "qa: contexts longer than max-length become overlapping windows, or are cut",
                                choices=("window", "truncate"))
    doc_stride: int = _opt(256, "qa windows: context tokens between window starts")
    max_question_length: int = _opt(MAX_QUESTION_LENGTH, "qa: question tokens kept")
    qa_negative_windows: float = _opt(1.0, "qa windows: share of windows without the answer that is kept "
                                           "(0: only answer windows)")
    labels: list[str] | None = _opt(None, "classify: comma-separated label names (default: the model's, else the data's)")
    dropout: float | None = _opt(None, "override the config's dropout probabilities (default: the config's)")
    freeze_encoder: bool = _opt(False, "summarize: train the decoder only, the encoder keeps its weights")
    quiet: bool = _opt(False, "no progress lines")

    def __post_init__(self):
        missing = [f.name for f in fields(self) if f.metadata.get("required") and getattr(self, f.name) is None]
        if missing:
            raise TypeError(f"TrainConfig needs {', '.join(missing)}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_train_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                        defaults: dict | None = None, helps: dict | None = None) -> None:
    """One flag per TrainConfig field (`only`: these fields), with the field's help, choices and
    default; `defaults` / `helps` replace a field's default or help for a script of its own recipe."""
    defaults, helps = defaults or {}, helps or {}
    for f in fields(TrainConfig):
        if not f.metadata.get("cli", True) or (only is not None and f.name not in only):
            continue
        default = defaults.get(f.name, f.default if f.default is not MISSING else None)
        required = f.metadata.get("required", False) and f.name not in defaults
        help_text = helps.get(f.name, f.metadata["help"])
        if f.name in defaults and f.name not in helps:  # the field's own default no longer applies
            help_text = re.sub(r"\s*\(default: [^)]*\)", "", help_text)
        kwargs: dict = {"dest": f.name, "default": default}
        if f.name == "resume":  # a bare --resume: the latest checkpoint
            kwargs.update(nargs="?", const="latest", metavar="CHECKPOINT")
        elif f.type in ("bool", bool):
            kwargs.update(action="store_true")
        else:
            kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(str(f.type))
            if kind is not None:
                kwargs["type"] = kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        if required:
            kwargs["required"] = True
            kwargs.pop("default")
        elif "default:" not in help_text:  # else the help says what the default is
            help_text += f" (default: {_shown(default)})"
        parser.add_argument(_flag(f.name), help=help_text.replace("%", "%%"), **kwargs)


def config_from_args(args: argparse.Namespace, **overrides) -> TrainConfig:
    """The TrainConfig of parsed flags (fields without a flag keep their defaults), then `overrides`."""
    values = {}
    for f in fields(TrainConfig):
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    if isinstance(values.get("labels"), str):
        values["labels"] = [s.strip() for s in values["labels"].split(",") if s.strip()] or None
    if values.get("resume") is None:
        values["resume"] = False
    values.update(overrides)
    return TrainConfig(**values)
