"""manifest.json of an exported model directory (docs/DESIGN.md, "export/ model directory").

A frozen dataclass, written by `longdoc export` and read by `longdoc.export.runtime.OnnxModel` and
the service. No torch: the serving path imports this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from longdoc.model.registry import TASKS
from longdoc.model.tokenization import SUMMARIZE_INPUTS

log = logging.getLogger("longdoc.export")
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
GLOBAL_TOKENS = ("question", "first", "none")
DTYPES = ("fp32", "fp16", "int8")
# how an int8 export runs its encoder attention's products (export/sparse_attention.py's docstring)
INT8_ATTENTION = ("off", "dynamic", "dynamic-s8", "per-row", "static-p")
# int8 exports: one scale per weight matrix, or one per output column (onnxruntime's
# quantize_dynamic per_channel); "per-tensor" in manifests written before the choice existed
INT8_WEIGHTS = ("per-tensor", "per-channel")
# how the block-sparse attention gathers its key/value blocks (`longdoc export --sparse-gather`,
# export/sparse_attention.py): one Gather per head group (the default), one for all heads at once,
# a product with a one-hot table, or the window's blocks as slices of a shifted copy (then the
# layout tables fed hold only the other blocks: export/layout_feed.py `without_window`)
SPARSE_GATHER = ("gather", "all-heads", "onehot", "window")
# the names of the encoder outputs per task (what OnnxModel.run_encoder returns)
TASK_OUTPUTS = {
    "qa": ("start_logits", "end_logits"),
    "classify": ("logits",),
    "mlm": ("logits",),
    "summarize": ("last_hidden_state",),
    "embed": ("embedding",),
}
# task "embed": sentence-transformers' Pooling modes the export computes in the graph
EMBEDDING_POOLING = ("mean", "cls")


# the special-token ids each task's runtime uses (the windows' [CLS]/[SEP], padding, decoding)
REQUIRED_SPECIAL_TOKENS = {"qa": ("pad", "cls", "sep"), "classify": ("pad", "cls", "sep"), "mlm": ("pad",),
                           "summarize": ("pad", "eos", "decoder_start"), "embed": ("pad", "cls", "sep")}
# the outputs with one row per token, (B, S, ...), per task: the runtime strips padding from them and
# the batcher cuts them to each sequence's own length (the others are (B, ...) per sequence)
PER_TOKEN_OUTPUTS = {"qa": frozenset({"start_logits", "end_logits"}), "classify": frozenset(),
                     "mlm": frozenset({"logits"}), "summarize": frozenset({"last_hidden_state"}),
                     "embed": frozenset()}


class ManifestError(ValueError):
    """A manifest.json that is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Manifest:
    task: str
    architecture: str
    dtype: str
    graphs: dict[str, str]
    attention: dict[str, Any]  # longdoc.model.layout.AttentionSpec as a dict (asdict)
    num_layers: int
    num_heads: int
    hidden_size: int
    block_size: int
    min_length: int
    max_length: int
    full_attention_max_length: int  # seq_len <= this runs full attention (transformers' rule)
    labels: list[str] | None = None
    special_tokens: dict[str, int | None] = field(default_factory=dict)
    decoder: dict[str, Any] | None = None  # summarize: num_layers, num_heads, head_dim, max_positions, generation
    source: dict[str, str] = field(default_factory=dict)  # checkpoint, sha256
    versions: dict[str, Any] = field(default_factory=dict)  # longdoc, torch, onnx, opset
    format_version: int = FORMAT_VERSION
    # file name (relative to the model directory) -> sha256 hex of every graph and tokenizer.json,
    # written at export and checked at load: a corrupted file fails start-up instead of serving
    # different answers. Empty in manifests written before checksums (a warning at load).
    files: dict[str, str] = field(default_factory=dict)
    # which tokens attend globally when the caller names none (Longformer; the runtime builds the
    # encoder's global_attention_mask from it): "question" = the tokens before the first separator
    # (QA), "first" = the first token (classification), "none" = the graph takes no such mask
    global_tokens: str = "none"
    # int8 exports: the attention's Q.K^T and P.V as MatMulInteger too (INT8_ATTENTION; "off" = fp32)
    int8_attention: str = "off"
    # int8 exports: the dense layers' weight scales (INT8_WEIGHTS)
    int8_weights: str = "per-tensor"
    # the block-sparse attention's key/value gathers (SPARSE_GATHER)
    sparse_gather: str = "gather"
    # summarize: the encoder input's template (longdoc.model.tokenization.SUMMARIZE_INPUTS)
    summarize_input: str = "doc-eos"
    # one AttentionSpec dict per encoder layer when the layers' attention differs (a Longformer's
    # per-layer attention_window); None: every layer's is `attention`. See `layer_attention_specs`.
    layer_attention: list[dict[str, Any]] | None = None
    # task "embed": {"pooling": EMBEDDING_POOLING (computed in the graph), "normalize": bool (the
    # service scales each text's vector to unit length)}, read from the checkpoint's
    # sentence-transformers modules (longdoc.export.sentence_transformers); None for other tasks
    embedding: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise ManifestError("invalid manifest: " + "; ".join(problems))

    @property
    def outputs(self) -> tuple[str, ...]:
        return TASK_OUTPUTS[self.task]

    @property
    def per_token_outputs(self) -> frozenset[str]:
        return PER_TOKEN_OUTPUTS[self.task]

    def layer_attention_specs(self) -> list[dict[str, Any]]:
        """Each encoder layer's AttentionSpec dict: what the runtime builds the layout tables from."""
        return list(self.layer_attention) if self.layer_attention is not None else [self.attention] * self.num_layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ManifestError(f"unknown manifest keys: {', '.join(unknown)}")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ManifestError(f"manifest is missing keys: {', '.join(missing)}")
        return cls(**data)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    def path_of(self, directory: str | Path, filename: str) -> Path:
        """`directory / filename`, refused unless it resolves inside the model directory (a
        manifest names files, it cannot reach outside; symlinks are resolved first)."""
        root = Path(directory).resolve()
        path = (root / filename).resolve()
        if not path.is_relative_to(root):
            raise ManifestError(f"{Path(directory) / MANIFEST_NAME}: {filename!r} resolves outside the model "
                                "directory")
        return path

    def check_files(self, directory: str | Path) -> None:
        """Every file named in `files` exists and has its recorded sha256 (ManifestError if not)."""
        where = Path(directory) / MANIFEST_NAME
        if not self.files:
            log.warning("%s records no file checksums (exported before checksums): graphs and tokenizer "
                        "are loaded unchecked; re-export to add them", where)
            return
        for name in [*self.graphs.values(), TOKENIZER_NAME]:
            if name not in self.files:
                raise ManifestError(f"{where}: no checksum for {name!r} in 'files'")
        for name, expected in self.files.items():
            path = self.path_of(directory, name)
            if not path.is_file():
                raise ManifestError(f"{path}: missing (named in the manifest's 'files')")
            actual = sha256_of(path)
            if actual != expected:
                raise ManifestError(f"{path}: sha256 {actual} does not match the manifest's {expected}; "
                                    "the file is corrupted or was replaced (re-export or restore it)")

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(f"{path}: no manifest.json (is {directory} an exported model directory?)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc})") from None
        try:
            return cls.from_dict(data)
        except (ManifestError, TypeError) as exc:
            raise ManifestError(f"{path}: {exc}") from None


def validate(m: Manifest) -> list[str]:
    """Every problem with a manifest, as readable sentences (empty list = valid)."""
    problems = []
    if m.format_version != FORMAT_VERSION:
        problems.append(f"format_version {m.format_version} is not supported (expected {FORMAT_VERSION})")
    if m.task not in TASKS:
        problems.append(f"task {m.task!r} is not one of {', '.join(TASKS)}")
    if m.dtype not in DTYPES:
        problems.append(f"dtype {m.dtype!r} is not one of {', '.join(DTYPES)}")
    if m.int8_attention not in INT8_ATTENTION:
        problems.append(f"int8_attention {m.int8_attention!r} is not one of {', '.join(INT8_ATTENTION)}")
    elif m.int8_attention != "off" and m.dtype != "int8":
        problems.append(f"int8_attention {m.int8_attention!r} needs dtype 'int8', got {m.dtype!r}")
    if m.sparse_gather not in SPARSE_GATHER:
        problems.append(f"sparse_gather {m.sparse_gather!r} is not one of {', '.join(SPARSE_GATHER)}")
    if m.int8_weights not in INT8_WEIGHTS:
        problems.append(f"int8_weights {m.int8_weights!r} is not one of {', '.join(INT8_WEIGHTS)}")
    elif m.int8_weights != "per-tensor" and m.dtype != "int8":
        problems.append(f"int8_weights {m.int8_weights!r} needs dtype 'int8', got {m.dtype!r}")
    if not isinstance(m.graphs, dict) or "encoder" not in m.graphs:
        problems.append("graphs must name an 'encoder' graph")
    elif m.task == "summarize" and "decoder" not in m.graphs:
        problems.append("task 'summarize' needs a 'decoder' graph")
    if m.task == "summarize" and not m.decoder:
        problems.append("task 'summarize' needs the 'decoder' dimensions")
    for name in ("num_layers", "num_heads", "hidden_size", "block_size", "min_length", "max_length"):
        value = getattr(m, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if not problems:
        if m.hidden_size % m.num_heads:
            problems.append(f"hidden_size {m.hidden_size} is not a multiple of num_heads {m.num_heads}")
        if m.max_length % m.block_size:
            problems.append(f"max_length {m.max_length} is not a multiple of block_size {m.block_size}")
        if m.min_length > m.max_length:
            problems.append(f"min_length {m.min_length} exceeds max_length {m.max_length}")
    if m.summarize_input not in SUMMARIZE_INPUTS:
        problems.append(f"summarize_input {m.summarize_input!r} is not one of {', '.join(SUMMARIZE_INPUTS)}")
    elif (SUMMARIZE_INPUTS[m.summarize_input] is not None
          and not isinstance((m.special_tokens or {}).get(SUMMARIZE_INPUTS[m.summarize_input]), int)):
        problems.append(f"summarize_input {m.summarize_input!r} needs a {SUMMARIZE_INPUTS[m.summarize_input]} id "
                        "in special_tokens")
    if m.global_tokens not in GLOBAL_TOKENS:
        problems.append(f"global_tokens {m.global_tokens!r} is not one of {', '.join(GLOBAL_TOKENS)}")
    if not isinstance(m.attention, dict) or "pattern" not in m.attention:
        problems.append("attention must be an AttentionSpec dict with a 'pattern'")
    if m.layer_attention is not None:
        if not (isinstance(m.layer_attention, list) and all(isinstance(a, dict) and "pattern" in a
                                                             for a in m.layer_attention)):
            problems.append("layer_attention must be a list of AttentionSpec dicts or null")
        elif len(m.layer_attention) != m.num_layers:
            problems.append(f"layer_attention has {len(m.layer_attention)} entries for {m.num_layers} layers")
        elif any(a.get("block_size") != m.block_size for a in m.layer_attention):
            problems.append(f"every layer_attention block_size must be block_size {m.block_size}")
    if m.labels is not None and not (isinstance(m.labels, list) and all(isinstance(x, str) for x in m.labels)):
        problems.append("labels must be a list of strings or null")
    if m.task == "classify" and not m.labels:
        problems.append("task 'classify' needs labels")
    if m.task == "embed":
        e = m.embedding
        if not (isinstance(e, dict) and e.get("pooling") in EMBEDDING_POOLING
                and isinstance(e.get("normalize"), bool) and set(e) == {"pooling", "normalize"}):
            problems.append(f"task 'embed' needs embedding {{\"pooling\": {' or '.join(EMBEDDING_POOLING)}, "
                            f"\"normalize\": true or false}}, got {e!r}")
    elif m.embedding is not None:
        problems.append(f"embedding is for task 'embed', not {m.task!r}")
    needed = REQUIRED_SPECIAL_TOKENS.get(m.task, ())
    missing = [name for name in needed if not isinstance((m.special_tokens or {}).get(name), int)]
    if missing:
        problems.append(f"special_tokens has no {', '.join(missing)} id (exports before longdoc 0.2 left them to "
                        "the service; export the checkpoint again)")
    names = list(m.graphs.values()) if isinstance(m.graphs, dict) else []
    if not isinstance(m.files, dict) or not all(isinstance(v, str) and len(v) == 64 for v in m.files.values()):
        problems.append("files must map file names to sha256 hex digests")
    else:
        names += list(m.files)
    for name in names:
        if not _is_plain_relative(name):
            problems.append(f"file {name!r} must be a relative path inside the model directory")
    return problems


def _is_plain_relative(name: object) -> bool:
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    path = Path(name)
    return not path.is_absolute() and ".." not in path.parts


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_checksums(directory: str | Path, names: list[str]) -> dict[str, str]:
    """{name: sha256} of files in a model directory (what `Manifest.files` records)."""
    return {name: sha256_of(Path(directory) / name) for name in names}
