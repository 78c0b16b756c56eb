"""`longdoc export`: a Hugging Face-format checkpoint directory -> a model directory
(docs/DESIGN.md): encoder.onnx [+ decoder.onnx], tokenizer.json, manifest.json."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from longdoc.export.graph import LOWERED_ACTIVATIONS, OPSET, save_model
from longdoc.export.lowering import LONGFORMER_ATTENTION, Weights
from longdoc.export.manifest import (INT8_ATTENTION, INT8_WEIGHTS, SPARSE_GATHER, TASKS, TOKENIZER_NAME, Manifest,
                                     file_checksums, sha256_of)
from longdoc.export.registry import LOWERINGS, BuildRequest, Lowering
from longdoc.model.config import read_json_object
from longdoc.model.layout import AttentionSpec
from longdoc.model.registry import model_types_for
from longdoc.model.search import GENERATION_FIELDS, checkpoint_generation_defaults
from longdoc.model.tokenization import (TokenizerError, convert_tokenizer, load_tokenizer, special_token_ids,
                                        special_token_mismatches)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
PLANS = ("hf-train", "hf-eval", "seeded")
ACTIVATION_KEYS = ("hidden_act", "activation_function")  # where a config names its activations


class CheckpointError(ValueError):
    """A checkpoint directory we cannot export (missing files, unsupported architecture)."""


def read_config(directory: str | Path) -> dict:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (expected a Hugging Face checkpoint directory)")
    config = read_json_object(path, CheckpointError)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in LOWERINGS:
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(LOWERINGS)})")
    unlowered = sorted({name for name in activations_of(config) if name not in LOWERED_ACTIVATIONS})
    if unlowered:
        raise CheckpointError(f"{path}: activation {', '.join(map(repr, unlowered))} cannot be exported (the export "
                              f"lowers {', '.join(sorted(LOWERED_ACTIVATIONS))})")
    return config


def activations_of(config) -> list[str]:
    """Every activation name a config (and its nested encoder / decoder configs) gives."""
    if not isinstance(config, dict):
        return []
    return [*(v for k, v in config.items() if k in ACTIVATION_KEYS and isinstance(v, str)),
            *(name for v in config.values() for name in activations_of(v))]


def sentence_embedding(directory: Path):
    """What an embed export reads from a sentence-transformers folder (its Transformer module's
    checkpoint, pooling, normalization, tokens per text; longdoc.export.sentence_transformers)."""
    from longdoc.export.sentence_transformers import SentenceTransformersError, read_sentence_transformers

    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    try:
        return read_sentence_transformers(directory)
    except SentenceTransformersError as exc:
        raise CheckpointError(str(exc)) from None


def exportable_model_types(task: str) -> list[str]:
    """The model types whose checkpoints export for `task` (records with a lowering)."""
    return [t for t in model_types_for(task) if t in LOWERINGS]


def lowering_of(config: dict) -> Lowering:
    """The registry record of a config `read_config` accepted."""
    return LOWERINGS[config["model_type"]]


def checkpoint_tokenizer(checkpoint_dir: Path, progress: Callable[[str], None] = print):
    """The tokenizer the export writes as its tokenizer.json: the checkpoint's own tokenizer.json,
    or one converted from the files its family's public checkpoints ship instead (spiece.model,
    vocab.json + merges.txt, vocab.txt; `longdoc.model.tokenization.convert_tokenizer`)."""
    try:
        if (checkpoint_dir / TOKENIZER_NAME).is_file():
            return load_tokenizer(checkpoint_dir)
        tokenizer = convert_tokenizer(checkpoint_dir)
    except TokenizerError as exc:
        raise CheckpointError(str(exc)) from None
    progress(f"converted the checkpoint's tokenizer to {TOKENIZER_NAME} (same ids as transformers' tokenizer on "
             "sample text)")
    return tokenizer


def weights_path(directory: Path) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise CheckpointError(f"{directory}: no weights ({' or '.join(WEIGHT_FILES)})")


def read_weights(directory: str | Path) -> dict[str, np.ndarray]:
    path = weights_path(Path(directory))
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:  # NumPy first (no torch import); bf16 checkpoints need torch to read
            with safe_open(str(path), framework="np") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, TypeError, ValueError):
            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k).float().numpy() for k in f.keys()}
    import torch  # a .bin: a plain state dict only, never arbitrary pickled code

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: not a plain PyTorch state dict ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a state dict")
    return {k: v.float().numpy() for k, v in state.items()}


def task_of(config: dict, task: str) -> str:
    """Check the requested task against the checkpoint's architecture; fail fast."""
    if task not in TASKS:
        raise CheckpointError(f"task {task!r} is not one of {', '.join(TASKS)}")
    record = lowering_of(config).model
    architectures = config.get("architectures") or []
    arch = architectures[0] if architectures else None
    if task not in record.tasks:
        raise CheckpointError(f"a {record.model_type} checkpoint exports as --task {' or '.join(record.tasks)}, "
                              f"not {task!r} (--task {task} needs a {' or '.join(exportable_model_types(task))} checkpoint)")
    exports = record.exports()
    if arch is not None and arch not in exports:
        raise CheckpointError(f"architecture {arch!r} is not supported for {record.model_type} "
                              f"(supported: {', '.join(exports)})")
    if arch is not None and exports[arch] not in (None, task):
        raise CheckpointError(f"checkpoint architecture {arch} is a {exports[arch]!r} model, not {task!r}")
    return task


def encoder_config(config: dict) -> dict:
    """The part of a checkpoint config that describes its encoder (block size, positions, attention)
    under BERT's names (`longdoc.model.registry.Architecture.encoder_config`)."""
    return lowering_of(config).model.encoder_config(config)


def layer_attention_dicts(config: dict, plan: str) -> list[dict]:
    """Every encoder layer's attention spec over the export's one block size, as the manifest's
    `layer_attention` holds it."""
    try:
        return [spec.to_dict() for spec in lowering_of(config).model.layer_attention_specs(config, plan)]
    except ValueError as exc:  # a bad window
        raise CheckpointError(str(exc)) from None


def length_bounds(config: dict, attention: str = "sparse") -> tuple[int, int, int]:
    """(min_length, max_length, full_attention_max_length) of a checkpoint's export: the lengths
    transformers runs on it too (docs/export.md, "Length bounds"), and up to which length it runs
    full attention (BigBird's switch; 0: never)."""
    encoder_block_size(config)  # a bad window fails here, by name
    return lowering_of(config).model.lengths(config, attention)


def encoder_block_size(config: dict) -> int:
    """Tokens per layout block: BigBird's `block_size`, Longformer's w = attention_window / 2."""
    try:
        return lowering_of(config).model.block_size(config)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _versions() -> dict:
    import onnx

    versions = {"onnx": onnx.__version__, "opset": OPSET}
    for name in ("longdoc", "torch", "onnxruntime"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = None
    return versions


def check_output_dir(output_dir: Path, checkpoint_dir: Path, overwrite: bool) -> None:
    """Refuse an output directory that holds a checkpoint (with the arguments swapped, export would
    overwrite the checkpoint's tokenizer.json), and a non-empty one unless `overwrite`."""
    if output_dir.exists() and not output_dir.is_dir():
        raise CheckpointError(f"output {output_dir}: not a directory")
    if output_dir.resolve() == checkpoint_dir.resolve() or any(
            (output_dir / name).exists() for name in ("config.json", *WEIGHT_FILES)):
        raise CheckpointError(f"output {output_dir} holds a checkpoint (config.json or weights); export writes "
                              f"a new directory (are CHECKPOINT_DIR and OUTPUT_DIR swapped?)")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"output {output_dir} is not empty; pass --overwrite to replace it")


def export_model(checkpoint_dir: str | Path, output_dir: str | Path, task: str, dtype: str = "fp32",
                 plan: str = "hf-train", progress: Callable[[str], None] = print,
                 overwrite: bool = False, int8_attention: str = "off", attention: str = "sparse",
                 int8_weights: str = "per-tensor", sparse_gather: str = "gather") -> Manifest:
    """int8_attention: the encoder's attention products in int8 too (INT8_ATTENTION; needs dtype int8).
    int8_weights: one scale per weight matrix or per output column (INT8_WEIGHTS; dtype int8 only).
    attention (Longformer only, LONGFORMER_ATTENTION): "sparse" = the checkpoint's window and global
    tokens; "full" = a benchmark baseline, dense attention over every token with the ordinary
    projections (`build_longformer_encoder`), which equals Longformer only when the window covers
    the whole input. The manifest records it as the `dense` attention pattern.
    sparse_gather (BigBird's windows, SPARSE_GATHER): how the block-sparse attention gathers its
    key/value blocks; every choice is exact, and the manifest records it (the runtime feeds a
    "window" graph tables without the window).

    Writes a temporary sibling of `output_dir` and renames it into place at the end: an interrupted
    export leaves nothing half-written, and an export it replaces (`overwrite`) stays whole until then."""
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    check_output_dir(output_dir, checkpoint_dir, overwrite)
    if dtype not in ("fp32", "fp16", "int8"):
        raise CheckpointError(f"dtype {dtype!r} is not one of fp32, fp16, int8")
    if int8_attention not in INT8_ATTENTION:
        raise CheckpointError(f"int8 attention {int8_attention!r} is not one of {', '.join(INT8_ATTENTION)}")
    if int8_attention != "off" and dtype != "int8":
        raise CheckpointError(f"--int8-attention {int8_attention} needs --dtype int8 (got {dtype})")
    if int8_weights not in INT8_WEIGHTS:
        raise CheckpointError(f"int8 weights {int8_weights!r} is not one of {', '.join(INT8_WEIGHTS)}")
    if int8_weights != "per-tensor" and dtype != "int8":
        raise CheckpointError(f"--int8-weights {int8_weights} needs --dtype int8 (got {dtype})")
    if sparse_gather not in SPARSE_GATHER:
        raise CheckpointError(f"sparse gather {sparse_gather!r} is not one of {', '.join(SPARSE_GATHER)}")
    if sparse_gather in ("onehot", "window") and int8_attention != "off":
        raise CheckpointError(f"--sparse-gather {sparse_gather} is built for float attention products "
                              f"(got --int8-attention {int8_attention})")
    if plan not in PLANS:
        raise CheckpointError(f"plan {plan!r} is not one of {', '.join(PLANS)}")
    if attention not in LONGFORMER_ATTENTION:
        raise CheckpointError(f"attention {attention!r} is not one of {', '.join(LONGFORMER_ATTENTION)}")
    embedding = None
    if task == "embed":  # a sentence-transformers folder: its Transformer module is the checkpoint
        embedding = sentence_embedding(checkpoint_dir)
        progress(f"reading {embedding.described}")
        checkpoint_dir = embedding.checkpoint_dir
    config = read_config(checkpoint_dir)
    task = task_of(config, task)
    lowering = lowering_of(config)
    record = lowering.model
    if attention == "full" and not lowering.full_attention:
        raise CheckpointError(f"--attention full is a Longformer benchmark baseline; a {config['model_type']} "
                              "checkpoint exports its own attention (BigBird: attention_type original_full in "
                              "config.json is full attention)")
    if int8_attention != "off" and lowering.no_int8_attention:
        raise CheckpointError(f"--int8-attention {int8_attention}: the int8 attention products are built for the "
                              f"block-sparse BigBird attention; {lowering.no_int8_attention} "
                              "(use --int8-attention off)")
    if sparse_gather != "gather" and lowering.no_sparse_gather:
        raise CheckpointError(f"--sparse-gather {sparse_gather}: {config['model_type']} {lowering.no_sparse_gather}")
    bs = encoder_block_size(config)
    wpath = weights_path(checkpoint_dir)
    tokenizer = checkpoint_tokenizer(checkpoint_dir, progress)
    mismatches = special_token_mismatches(checkpoint_dir, tokenizer, config, record.config_token_ids.get(task, ()),
                                          record.tasks[task])
    if mismatches:
        raise CheckpointError(f"{checkpoint_dir}: the config and the tokenizer disagree on special tokens: "
                              + "; ".join(mismatches))
    progress(f"reading {wpath}")
    weights = Weights(read_weights(checkpoint_dir))
    graph_dtype = "fp16" if dtype == "fp16" else "fp32"

    built = lowering.build(weights, config, BuildRequest(task=task, dtype=graph_dtype, int8_attention=int8_attention,
                                                         attention=attention, progress=progress,
                                                         pooling=embedding.pooling if embedding else "mean",
                                                         sparse_gather=sparse_gather))
    graphs, decoder = built.graphs, built.decoder
    if decoder is not None:
        decoder = {**decoder, "generation": generation_defaults(checkpoint_dir, config)}
    E, H, L = record.encoder_dims(config)
    unused = sorted(set(weights.tensors) - weights.used - set(lowering.unused))
    if unused:
        progress(f"note: {len(unused)} checkpoint tensors not used by the {task} graph: {', '.join(unused[:5])}")

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", suffix=".partial", dir=output_dir.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's directory is private
        for name, model in graphs.items():
            path = staging / f"{name}.onnx"
            if dtype == "int8":
                progress(f"quantizing {name} graph to int8 (dynamic, MatMul weights {int8_weights}; "
                         f"attention: {int8_attention})")
                quantize_int8(model, path, per_channel=int8_weights == "per-channel")
            else:
                save_model(model, path)
            progress(f"wrote {path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
        cuts = [name for name, value in (("truncation", tokenizer.truncation), ("padding", tokenizer.padding)) if value]
        if cuts:  # the service windows whole documents: a tokenizer that cuts or pads them would lose text
            progress(f"{TOKENIZER_NAME}: dropped the checkpoint tokenizer's {' and '.join(cuts)}")
            tokenizer.no_truncation()
            tokenizer.no_padding()
            tokenizer.save(str(staging / TOKENIZER_NAME))
        elif (checkpoint_dir / TOKENIZER_NAME).is_file():  # byte for byte
            shutil.copyfile(checkpoint_dir / TOKENIZER_NAME, staging / TOKENIZER_NAME)
        else:
            tokenizer.save(str(staging / TOKENIZER_NAME))

        labels = None
        if task == "classify":
            id2label = config.get("id2label") or {str(i): f"LABEL_{i}" for i in range(config.get("num_labels", 2))}
            labels = [id2label[str(i)] for i in range(len(id2label))]
        special = special_token_ids(checkpoint_dir, tokenizer=tokenizer)
        min_length, max_length, full_max = length_bounds(config, attention)
        if embedding is not None and embedding.max_seq_length:  # the window sentence-transformers embeds
            max_length = min(max_length, embedding.max_seq_length // bs * bs)
            full_max = min(full_max, max_length)
        layers = layer_attention_dicts(config, plan)
        manifest = Manifest(
            task=task, architecture=(config.get("architectures") or [record.tasks[task]])[0], dtype=dtype,
            graphs={name: f"{name}.onnx" for name in graphs},
            attention=(AttentionSpec(pattern="dense", block_size=bs).to_dict() if attention == "full"
                       else layers[0]),
            layer_attention=None if attention == "full" or all(a == layers[0] for a in layers) else layers,
            num_layers=L, num_heads=H, hidden_size=E, block_size=bs, min_length=min_length, max_length=max_length,
            full_attention_max_length=full_max, labels=labels,
            global_tokens="none" if attention == "full" else record.global_tokens_of(task),
            special_tokens=special, decoder=decoder, int8_attention=int8_attention,
            int8_weights=int8_weights, sparse_gather=sparse_gather,
            summarize_input=record.summarize_input if task == "summarize" else "doc-eos",
            embedding=embedding.manifest_entry() if embedding else None,
            source={"checkpoint": str(checkpoint_dir.resolve()), "sha256": sha256_of(wpath)},
            versions=_versions(), files=file_checksums(staging, _graph_files(staging, graphs) + [TOKENIZER_NAME]))
        manifest.save(staging)
        replace_dir(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress(f"wrote {output_dir}")
    return manifest


def _graph_files(output_dir: Path, graphs) -> list[str]:
    """Each graph's file and its external-data side file (`NAME.onnx.data`, graphs over 2 GiB)."""
    return [p.name for p in sorted(output_dir.iterdir())
            if any(p.name in (f"{g}.onnx", f"{g}.onnx.data") for g in graphs)]


def replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing `target` is moved aside first and deleted after."""
    if not target.exists():
        new.rename(target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    target.rename(old / target.name)
    new.rename(target)
    shutil.rmtree(old)


# the manifest's generation defaults; eos and pad come from its special tokens (longdoc.export.generation)
GENERATION_KEYS = tuple(k for k in GENERATION_FIELDS if k not in ("eos_token_id", "pad_token_id"))


def generation_defaults(checkpoint_dir: Path, config: dict) -> dict:
    """The checkpoint's generation settings (`longdoc.model.search.checkpoint_generation_defaults`)."""
    try:
        defaults = checkpoint_generation_defaults(checkpoint_dir, config)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return {k: v for k, v in defaults.items() if k in GENERATION_KEYS}


def quantize_int8(model, path: Path, per_channel: bool = False) -> None:
    """Dynamic int8 quantization of the MatMuls with constant weights (the dense layers);
    attention MatMuls multiply two activations and stay fp32. per_channel: one weight scale per
    output column instead of one per matrix (docs/notes/summarizer-training.md: the BERT2BERT summarizer
    keeps the fp32 export's greedy summary on 607 of 901 pages per column, 241 per matrix)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    # ONNX Runtime logs "Please consider to run pre-processing before quantization" on the root
    # logger for every graph without its pre-processing metadata; that pre-processing (symbolic shape
    # inference, graph optimization) serves static quantization, and our graphs are built already
    # shaped and plain. A NullHandler keeps the root logger from configuring itself to print it.
    root, hint, quiet = logging.getLogger(), _NoPreprocessingHint(), logging.NullHandler()
    root.addFilter(hint)
    root.addHandler(quiet)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            fp32 = Path(tmp) / "fp32.onnx"
            save_model(model, fp32)
            quantize_dynamic(str(fp32), str(path), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                             per_channel=per_channel,
                             use_external_data_format=model.ByteSize() > 1_800_000_000)
    finally:
        root.removeFilter(hint)
        root.removeHandler(quiet)


class _NoPreprocessingHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()
