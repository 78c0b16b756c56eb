"""manifest.json of an exported model directory (docs/DESIGN.md, "export/ model directory").

A frozen dataclass, written by `longdoc export` and read by `export.runtime.OnnxModel` and
the service. No torch: the serving path imports this module.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TASKS = ("qa", "classify", "mlm", "summarize")
DTYPES = ("fp32", "fp16", "int8")
# the names of the encoder outputs per task (what OnnxModel.run_encoder returns)
TASK_OUTPUTS = {
    "qa": ("start_logits", "end_logits"),
    "classify": ("logits",),
    "mlm": ("logits",),
    "summarize": ("last_hidden_state",),
}


# the special-token ids each task's runtime uses (the windows' [CLS]/[SEP], padding, decoding)
REQUIRED_SPECIAL_TOKENS = {"qa": ("pad", "cls", "sep"), "classify": ("pad", "cls", "sep"), "mlm": ("pad",),
                           "summarize": ("pad", "eos", "decoder_start")}
# the outputs with one row per token, (B, S, ...), per task: the runtime strips padding from them and
# the batcher cuts them to each sequence's own length (the others are (B, ...) per sequence)
PER_TOKEN_OUTPUTS = {"qa": frozenset({"start_logits", "end_logits"}), "classify": frozenset(),
                     "mlm": frozenset({"logits"}), "summarize": frozenset({"last_hidden_state"})}


class ManifestError(ValueError):
    """A manifest.json that is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Manifest:
    task: str
    architecture: str
    dtype: str
    graphs: dict[str, str]
    attention: dict[str, Any]  # model.layout.AttentionSpec as a dict (asdict)
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
    if not isinstance(m.attention, dict) or "pattern" not in m.attention:
        problems.append("attention must be an AttentionSpec dict with a 'pattern'")
    if m.labels is not None and not (isinstance(m.labels, list) and all(isinstance(x, str) for x in m.labels)):
        problems.append("labels must be a list of strings or null")
    if m.task == "classify" and not m.labels:
        problems.append("task 'classify' needs labels")
    needed = REQUIRED_SPECIAL_TOKENS.get(m.task, ())
    missing = [name for name in needed if not isinstance((m.special_tokens or {}).get(name), int)]
    if missing:
        problems.append(f"special_tokens has no {', '.join(missing)} id (exports before longdoc 0.2 left them to "
                        "the service; export the checkpoint again)")
    return problems
