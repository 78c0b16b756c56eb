"""Load and save checkpoints in the Hugging Face format, loudly.

    directory/config.json            model_type + architectures pick the class
    directory/model.safetensors      or pytorch_model.bin (torch.load(weights_only=True) only),
                                     or a sharded *.index.json of either

Every key and shape is accounted for by name: a key the model expects but the file lacks, a key
the file holds but the model does not use, or a shape that differs is an error (`LoadError`)
that lists them all. The only tolerated differences are named here: tied aliases (one tensor
under several names; a checkpoint needs only one of them), non-persistent buffers older files
still carry (`position_ids`), the next-sentence head of `BigBirdForPreTraining` checkpoints
(loaded as `BigBirdForMaskedLM`), the unused pooler of QA checkpoints (and of Longformer's heads), and whatever a model class
lists in `OPTIONAL_KEYS` / `IGNORED_KEYS`.

A `.bin` is read with `torch.load(weights_only=True)`, which refuses any pickle that would
construct arbitrary objects (no code from the file runs); a result that is not a flat
{name: tensor} dict is refused too.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path

import torch
from torch import nn

from longdoc.model.registry import REGISTRY, lookup
from longdoc.model.search import checkpoint_generation_defaults

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
BIN_NAME = "pytorch_model.bin"

# checkpoint keys that are known to be harmless when the model has no such key (regexes); each
# architecture's own are in its registry record (`Architecture.ignored_keys`)
IGNORED_ALWAYS = (r"(^|\.)embeddings\.position_ids$", r"(^|\.)embed_positions\.position_ids$")


class LoadError(ValueError):
    """A checkpoint directory that cannot be loaded as it is; the message says why."""


# ----------------------------------------------------------------------------------------------
# loading


def load_pretrained(directory, plan: str = "hf-train", architecture: str | None = None) -> nn.Module:
    """Build the model a Hugging Face checkpoint directory describes and load its weights.

    plan: random-block plan of the block-sparse attention ("hf-train" = what the checkpoints were
    trained with, "hf-eval" = transformers in eval mode, "seeded"). architecture: override the
    config's `architectures[0]` (e.g. "BigBirdModel" for the bare encoder of a task checkpoint;
    its `bert.` key prefix is then stripped and the head's keys are dropped).
    Returns the module in eval mode.
    """
    d = Path(directory)
    if not d.is_dir():
        raise LoadError(f"checkpoint directory {str(d)!r} does not exist or is not a directory")
    cfg_dict = read_config(d)
    record = lookup(cfg_dict.get("model_type"))
    cls, cfg_cls, arch = resolve_class(cfg_dict, architecture)
    if "forced_eos_token_id" in {f.name for f in dataclasses.fields(cfg_cls)}:  # an encoder-decoder
        try:  # generation_config.json over config.json, as the exporter reads them
            cfg_dict = {**cfg_dict, **checkpoint_generation_defaults(d, cfg_dict)}
        except ValueError as e:
            raise LoadError(str(e)) from None
    try:
        config = cfg_cls.from_dict(cfg_dict)
    except (TypeError, ValueError) as e:
        raise LoadError(f"{d / CONFIG_NAME}: invalid {cfg_cls.__name__}: {e}") from None
    state = read_state_dict(d)
    prefix = getattr(cls, "base_model_prefix", None)  # set on the bare encoders: "bert.", "longformer."
    if prefix and any(k.startswith(prefix + ".") for k in state) and not any(_is_encoder_key(k) for k in state):
        # the bare encoder out of a task checkpoint: keep the encoder, drop the head by name
        state = {k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".")}
    if prefix and not any(k.startswith("pooler.") for k in state):
        # e.g. the encoder of a QA checkpoint
        module = construct(cls, config, plan, add_pooling_layer=False)
    else:
        module = construct(cls, config, plan)
    ignored = IGNORED_ALWAYS + record.ignored_keys.get(arch, ()) + tuple(getattr(cls, "IGNORED_KEYS", ()))
    load_state_dict_strict(module, state, ignored=ignored, source=str(d))
    return module.eval()


def _is_encoder_key(key: str) -> bool:
    return key.startswith(("embeddings.", "encoder.", "pooler."))


def read_config(d: Path) -> dict:
    path = d / CONFIG_NAME
    if not path.is_file():
        raise LoadError(f"{str(d)!r} has no {CONFIG_NAME}: not a Hugging Face checkpoint directory")
    from longdoc.model.config import read_json_object

    return read_json_object(path, LoadError)


def supported_text() -> str:
    return "; ".join(f"model_type {t!r}: {sorted(r.classes)}" for t, r in REGISTRY.items())


def resolve_class(cfg: dict, architecture: str | None = None):
    """-> (model class, config class, architecture name) for a config dict."""
    model_type = cfg.get("model_type")
    record = lookup(model_type)
    if record is None:
        raise LoadError(f"unsupported model_type {model_type!r}; supported: {supported_text()}")
    if architecture is None:
        listed = cfg.get("architectures") or [record.base_class]
        if not isinstance(listed, list) or not listed:
            raise LoadError(f"config 'architectures' must be a non-empty list, got {listed!r}")
        architecture = listed[0]
    if architecture not in record.classes:
        raise LoadError(
            f"unsupported architecture {architecture!r} for model_type {model_type!r}; supported: {sorted(record.classes)}"
        )
    # the model's module is imported lazily: pegasus only when asked for
    return record.load(record.classes[architecture]), record.load(record.config_class), architecture


def construct(cls, config, plan: str, **kwargs) -> nn.Module:
    """A model class on its config: with the random-block plan where it takes one."""
    params = inspect.signature(cls).parameters
    if "plan" in params:
        return cls(config, plan=plan, **kwargs)
    if "attention_spec" in params:  # longdoc.model.pegasus: the spec is built by its module
        spec_for = getattr(importlib.import_module(cls.__module__), "attention_spec_from_config")
        return cls(config, attention_spec=spec_for(config, plan), **kwargs)
    return cls(config, **kwargs)  # longdoc.model.longformer: no random blocks, no plan


def read_state_dict(d: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory (safetensors preferred; sharded indexes followed)."""
    for index_name, reader in (
        (SAFETENSORS_NAME + ".index.json", _read_safetensors),
        (BIN_NAME + ".index.json", _read_bin),
    ):
        index = d / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
                raise LoadError(f"{index}: not a valid shard index ({e!r})") from None
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                path = d / shard
                if Path(shard).name != shard or not path.is_file():
                    raise LoadError(f"{index}: shard {shard!r} is missing from {str(d)!r}")
                state.update(reader(path))
            return state
    if (d / SAFETENSORS_NAME).is_file():
        return _read_safetensors(d / SAFETENSORS_NAME)
    if (d / BIN_NAME).is_file():
        return _read_bin(d / BIN_NAME)
    raise LoadError(f"{str(d)!r} has no weights: expected {SAFETENSORS_NAME} or {BIN_NAME}")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise LoadError(f"{path}: not a readable safetensors file ({e})") from None


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    import pickle
    import warnings

    try:
        with warnings.catch_warnings():
            # plain-pickle files of other protocols are legitimate; the restricted unpickler
            # still refuses anything but tensors and containers
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(
            f"{path}: refused: not a plain state dict of tensors (torch.load(weights_only=True) "
            f"rejected it, nothing in it was executed): {first}"
        ) from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        what = type(obj).__name__ if not isinstance(obj, dict) else "a dict with non-tensor entries"
        raise LoadError(f"{path}: not a plain state dict (expected {{name: tensor}}, got {what})")
    return obj


def _shared_groups(module: nn.Module) -> list[list[str]]:
    """state_dict keys grouped by the tensor they name (groups of > 1 are tied aliases); the
    first key of a group, in registration order, is its canonical name."""
    groups: dict[int, list[str]] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(key)
    return list(groups.values())


def _limited(items: list[str], n: int = 25) -> str:
    head = ", ".join(items[:n])
    return head + (f", ... and {len(items) - n} more" if len(items) > n else "")


def load_state_dict_strict(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    ignored=(),
    source: str = "",
    fresh_prefixes: tuple[str, ...] = (),
    drop_prefixes: tuple[str, ...] = (),
) -> tuple[list[str], list[str]]:
    """Copy `state` into `module`, every key and shape accounted for, or raise LoadError.

    The policy for fine-tuning: module keys starting with `fresh_prefixes` may be absent from the
    file (a new task head keeps its fresh init) and file keys starting with `drop_prefixes` may go
    unused (another task's head). Returns (fresh, dropped) so the caller can say so; anything else
    missing, unexpected or of the wrong shape is an error naming the keys.
    """
    own = module.state_dict()
    optional = set(getattr(module, "OPTIONAL_KEYS", ()))
    ignored_re = [re.compile(p) for p in ignored]
    to_load: dict[str, torch.Tensor] = {}
    missing, mismatched, fresh = [], [], []
    for group in _shared_groups(module):
        present = [k for k in group if k in state]
        if not present:
            if group[0].startswith(fresh_prefixes) and fresh_prefixes:
                fresh.append(group[0])
            elif not all(k in optional for k in group):
                missing.append(group[0] if len(group) == 1 else f"{group[0]} (or its aliases {group[1:]})")
            continue
        for k in present:
            if tuple(state[k].shape) != tuple(own[k].shape):
                mismatched.append(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}")
        to_load[group[0]] = state[present[0]]  # canonical name first, as transformers ties
    unused = sorted(k for k in state if k not in own and not any(r.search(k) for r in ignored_re))
    dropped = [k for k in unused if drop_prefixes and k.startswith(drop_prefixes)]
    unexpected = [k for k in unused if k not in dropped]
    if missing or unexpected or mismatched:
        parts = [f"checkpoint {source!r} does not match {type(module).__name__}:"]
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_limited(sorted(missing))}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_limited(unexpected)}")
        if mismatched:
            parts.append(f"mismatched shapes ({len(mismatched)}): {_limited(sorted(mismatched))}")
        raise LoadError("\n  ".join(parts))
    result = module.load_state_dict(to_load, strict=False)
    # every parameter not loaded by name is an alias of one that was, or optional
    left = set(result.missing_keys) - {k for g in _shared_groups(module) for k in g[1:]} - optional - set(fresh)
    if left or result.unexpected_keys:  # a bug here, not in the file
        raise AssertionError(f"load_state_dict left {sorted(left)} / {result.unexpected_keys}")
    return fresh, dropped


# ----------------------------------------------------------------------------------------------
# saving


def save_pretrained(module: nn.Module, directory) -> Path:
    """Write `config.json` (with architectures and model_type) and `model.safetensors` so that
    transformers' `from_pretrained(directory)` loads the same model. Tied aliases are written
    once, under their canonical name, as transformers does."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = module.config.to_dict()
    cfg["architectures"] = [type(module).__name__]
    own = module.state_dict()
    params = [p for p in module.parameters()]
    if params:
        cfg["dtype"] = str(params[0].dtype).removeprefix("torch.")
    state = {}
    for group in _shared_groups(module):
        key = group[0]
        state[key] = own[key].detach().to("cpu").contiguous().clone()
    save_file(state, str(d / SAFETENSORS_NAME), metadata={"format": "pt"})
    (d / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return d
