"""The config base classes: `config.json` <-> dataclass, every key the dataclass does not model
kept in `extra` and written back unchanged, so a round trip loses nothing. `HFConfig` for the
BERT-style configs (BigBird, Longformer, a BERT2BERT decoder), `Seq2SeqConfig` for the BART-style
ones (BigBird-Pegasus, LED). No torch."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar


def read_json_object(path, error: type[Exception] = ValueError, missing: dict | None = None) -> dict:
    """A JSON-object file (config.json, tokenizer_config.json, ...): `missing` when there is no
    such file (None: an error), else the object; `error` (the caller's error type) names the path
    when the file is not valid JSON or holds another type. The one reader of the project's JSON
    configs (checkpoint loading, export, training, tokenizers)."""
    path = Path(path)
    if not path.is_file():
        if missing is not None:
            return dict(missing)
        raise error(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def eos_token_ids(eos_token_id) -> list[int]:
    """A config's `eos_token_id` (None, one id or a list) as a list."""
    e = eos_token_id
    return [] if e is None else ([e] if isinstance(e, int) else list(e))


class HFConfig:
    """`config.json` <-> dataclass for the model configs (BigBird, Longformer): the dataclass
    fields are the keys that change the computation, every other key is kept in `extra` and
    written back unchanged, so a round trip loses nothing. Subclasses set `model_type`."""

    model_type: str  # class attribute, not a field
    id2label: dict[int, str] | None
    extra: dict[str, Any]

    @property
    def num_labels(self) -> int:
        return len(self.id2label) if self.id2label else 2

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        d = dict(d)
        model_type = d.pop("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"model_type {model_type!r} is not {cls.model_type!r}")
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        num_labels = d.pop("num_labels", None)
        d.pop("label2id", None)  # derived from id2label
        if known.get("id2label") is None and num_labels is not None:
            known["id2label"] = {i: f"LABEL_{i}" for i in range(int(num_labels))}
        return cls(**known, extra=d)

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` content transformers reads (model_type included)."""
        d = dict(self.extra)
        for f in fields(self):
            if f.name != "extra":
                d[f.name] = getattr(self, f.name)
        d["model_type"] = self.model_type
        if self.id2label is not None:
            d["id2label"] = {str(k): v for k, v in self.id2label.items()}
            d["label2id"] = {v: k for k, v in self.id2label.items()}
        if d["architectures"] is None:
            del d["architectures"]
        return d


@dataclass(kw_only=True)
class GenerationDefaults:
    """The generation defaults some checkpoints carry at their config's top level (None = not
    set; transformers' names), and the keys a config class does not model (`extra`, written back by
    `to_dict`): declared once for the encoder-decoders (Seq2SeqConfig's BigBird-Pegasus and LED,
    and the BERT2BERT EncoderDecoderConfig). Keyword-only, so that a subclass's own fields may come
    without defaults."""

    max_length: int | None = None
    min_length: int | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    early_stopping: bool | str | None = None
    forced_eos_token_id: int | list[int] | None = None
    forced_bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.eos_token_id)


@dataclass
class Seq2SeqConfig(GenerationDefaults):
    """`config.json` <-> dataclass for the BART-style encoder-decoders (BigBird-Pegasus, LED):
    transformers' aliases (`ALIASES`, its attribute_map) read under the field's name; `to_dict`
    leaves unset (None) options out. Subclasses (dataclasses) add their architecture's fields and
    set `model_type`, `ARCHITECTURE` and `ALIASES`."""

    model_type = ""  # class attributes, not fields
    ARCHITECTURE = ""  # the architecture written to config.json
    ALIASES: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        if d.get("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"model_type {d.get('model_type')!r} is not {cls.model_type!r}")
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs, extra = {}, {}
        for key, value in d.items():
            key2 = cls.ALIASES.get(key, key)
            if key2 in known:
                kwargs[key2] = value
            elif key != "model_type":
                extra[key] = value
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d = {k: v for k, v in d.items() if v is not None or k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        d.update({"architectures": [self.ARCHITECTURE], "is_encoder_decoder": True})
        d.update(extra)
        d["model_type"] = self.model_type
        return d
