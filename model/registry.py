"""One record per architecture (`model_type` in config.json): everything checkpoint loading,
training, export and verify need to know about it. Generic code reads the record and never asks
which architecture a checkpoint is; the export's part of the record (the build step that lowers a
checkpoint to ONNX graphs) is registered beside this one, in `longdoc.export.registry`.

Adding an architecture: its model file (`longdoc.model.NAME`: a config class with `from_dict` /
`to_dict` and the model classes), its lowering (`longdoc.export.lowering`), one `register(...)` here
and one `register_lowering(...)` in `longdoc.export.registry`, and its tests (docs/DESIGN.md,
"Adding an architecture").

No torch at module level: the service imports `TASKS` through `longdoc.export.manifest`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from longdoc.model.layout import (AttentionSpec, checkpoint_attention_spec, longformer_attention_specs, longformer_block_size,
                                 longformer_layer_specs, modernbert_layer_specs)
from longdoc.model.tokenization import SUMMARIZE_INPUTS

# every task a model can be trained, exported and served for (a record lists its own); "embed":
# one vector per text, the encoder's last hidden states pooled as sentence-transformers' Pooling does
TASKS = ("qa", "classify", "mlm", "summarize", "embed")
# a BERT's padding multiple (its config has no block size; longdoc.model.bert)
BERT_BLOCK_SIZE = 8


def _itself(config: dict) -> dict:
    return config


def _bert_names(config: dict) -> dict:
    """A BART-style config (d_model, encoder_*) with its encoder under BERT's names too."""
    return {**config, "hidden_size": config.get("d_model"), "num_attention_heads": config.get("encoder_attention_heads"),
            "num_hidden_layers": config.get("encoder_layers")}


def led_window_config(config: dict) -> dict:
    """An LED config under the names the Longformer helpers read (`longformer_block_size`,
    `longformer_attention_specs`, the manifest's dimensions): the encoder's."""
    return {**_bert_names(config), "max_position_embeddings": config.get("max_encoder_position_embeddings")}


def _nested_encoder(config: dict) -> dict:
    return config["encoder"]


def bert_blocks(config: dict) -> dict:
    """A BERT config under BigBird's names: full attention, padded to BERT_BLOCK_SIZE (longdoc.model.bert)."""
    return {"block_size": BERT_BLOCK_SIZE, **config, "attention_type": "original_full"}


def block_sparse_lengths(config: dict, enc: dict, block_size: int, attention: str) -> tuple[int, int, int]:
    """BigBird: whole blocks of the position table; full attention up to (5 + 2r) blocks (its switch)."""
    max_length = (int(enc["max_position_embeddings"]) // block_size) * block_size
    sparse = enc.get("attention_type", "block_sparse") == "block_sparse"
    return (block_size, max_length,
            (5 + 2 * int(enc.get("num_random_blocks", 3))) * block_size if sparse else max_length)


def dense_lengths(config: dict, enc: dict, block_size: int, attention: str) -> tuple[int, int, int]:
    """BERT: any length up to the position table (rounded down to the padding multiple), full attention."""
    max_length = int(enc["max_position_embeddings"]) // block_size * block_size
    return 1, max_length, max_length


def roberta_window_lengths(config: dict, enc: dict, block_size: int, attention: str) -> tuple[int, int, int]:
    """Longformer: RoBERTa positions start after pad_token_id (window padding takes pad's position);
    no switch to full attention (except the `--attention full` baseline)."""
    max_length = ((int(enc["max_position_embeddings"]) - int(enc.get("pad_token_id", 1)) - 1)
                  // block_size * block_size)
    return 1, max_length, (max_length if attention == "full" else 0)


def padded_window_lengths(config: dict, enc: dict, block_size: int, attention: str) -> tuple[int, int, int]:
    """LED: transformers pads the input to a multiple of attention_window (2w) and then looks up
    positions 0..padded-1 of the encoder's table: a length whose padding runs past the table cannot
    run (1013 -> 1032 of 1024 with window 24). Per-layer windows: transformers pads to the largest."""
    window = max(2 * spec.band for spec in longformer_attention_specs(enc))
    return 1, int(enc["max_position_embeddings"]) // window * window, 0


def rotary_lengths(config: dict, enc: dict, block_size: int, attention: str) -> tuple[int, int, int]:
    """ModernBERT: rotary positions, no table to run past; the lengths of max_position_embeddings
    (rounded down to a whole block: the band's padding); no switch to full attention."""
    return 1, int(enc["max_position_embeddings"]) // block_size * block_size, 0


def bert_dropout(config: dict, p: float) -> dict:
    return {**config, "hidden_dropout_prob": p, "attention_probs_dropout_prob": p,
            **({"classifier_dropout": p} if config.get("classifier_dropout") is not None else {})}


def bart_dropout(config: dict, p: float) -> dict:
    return {**config, "dropout": p, "attention_dropout": p, "activation_dropout": p}


def encoder_decoder_dropout(config: dict, p: float) -> dict:
    return {**config, **{part: {**config[part], "hidden_dropout_prob": p, "attention_probs_dropout_prob": p}
                         for part in ("encoder", "decoder")}}


@dataclass(frozen=True)
class Architecture:
    """What is particular to one `model_type`; see the module docstring."""

    model_type: str
    module: str  # the PyTorch model's module, imported when a model is built
    config_class: str  # its config class (from_dict / to_dict)
    classes: Mapping[str, str]  # architecture name in config.json -> class in `module` (loading)
    base_class: str  # the class of a config.json that names no architecture
    tasks: Mapping[str, str]  # task -> the architecture of its model (exports, manifests, training)
    # other architectures a checkpoint may name -> the task it exports as (None: a bare encoder, any task)
    other_architectures: Mapping[str, str | None] = field(default_factory=dict)
    # the encoder's part of a config under BERT's names (hidden_size, num_attention_heads,
    # num_hidden_layers, max_position_embeddings) plus its attention keys
    encoder_config: Callable[[dict], dict] = _itself
    windowed: bool = False  # Longformer attention (a window per layer, global tokens per request), else block-sparse
    # per-layer attention read from the encoder config, over one block size (the first spec's),
    # when the layers differ in kind (ModernBERT: band and dense layers); None: `windowed` decides
    layer_specs: Callable[[dict], tuple[AttentionSpec, ...]] | None = None
    # (config, encoder config, block size, attention) -> (min_length, max_length, full_attention_max_length)
    length_bounds: Callable[[dict, dict, int, str], tuple[int, int, int]] = block_sparse_lengths
    global_tokens: Mapping[str, str] = field(default_factory=dict)  # task -> the manifest's (default "none")
    summarize_input: str = "doc-eos"  # longdoc.model.tokenization.SUMMARIZE_INPUTS
    # task -> the special tokens whose id the model reads from the config (`*_token_id`) where the
    # export reads its tokenizer's: export refuses, and verify fails, a config that disagrees with
    # the tokenizer files on one (longdoc.model.tokenization.special_token_mismatches)
    config_token_ids: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    train_tasks: tuple[str, ...] = ()  # what `longdoc train` trains it for
    dropout: Callable[[dict, float], dict] | None = None  # config with every dropout probability set to p
    # checkpoint keys the model does not use, tolerated: architecture -> regexes
    ignored_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    # --- what generic code asks -------------------------------------------------------------
    def exports(self) -> dict[str, str | None]:
        """Architecture name -> the task a checkpoint naming it exports as (None: any of `tasks`)."""
        return {**{arch: task for task, arch in self.tasks.items()}, **self.other_architectures}

    def block_size(self, config: dict) -> int:
        """Tokens per layout block: BigBird's `block_size`, Longformer's w = attention_window / 2
        (per-layer windows: the greatest common divisor of the layers' w, `longformer_block_size`)."""
        enc = self.encoder_config(config)
        if self.layer_specs is not None:
            return self.layer_specs(enc)[0].block_size
        return longformer_block_size(enc) if self.windowed else int(enc.get("block_size", 64))

    def layer_attention_specs(self, config: dict, plan: str) -> tuple[AttentionSpec, ...]:
        """Each encoder layer's attention over the export's one block size (`block_size`): the
        tables the runtime builds per length and the graph's band read these."""
        enc = self.encoder_config(config)
        if self.layer_specs is not None:
            return self.layer_specs(enc)
        if self.windowed:
            return longformer_layer_specs(enc)
        return (checkpoint_attention_spec(enc, plan),) * int(enc["num_hidden_layers"])

    def attention_spec(self, config: dict, plan: str) -> AttentionSpec:
        """The first layer's attention (`layer_attention_specs`; the same for every layer unless
        a Longformer's window differs between layers)."""
        return self.layer_attention_specs(config, plan)[0]

    def lengths(self, config: dict, attention: str = "sparse") -> tuple[int, int, int]:
        """(min_length, max_length, full_attention_max_length): the lengths transformers runs on the
        checkpoint too (docs/export.md, "Length bounds"); 0: never switches to full attention."""
        return self.length_bounds(config, self.encoder_config(config), self.block_size(config), attention)

    def encoder_dims(self, config: dict) -> tuple[int, int, int]:
        """(hidden_size, heads, layers) of the encoder."""
        enc = self.encoder_config(config)
        return int(enc["hidden_size"]), int(enc["num_attention_heads"]), int(enc["num_hidden_layers"])

    def global_tokens_of(self, task: str) -> str:
        return self.global_tokens.get(task, "none")

    def load(self, name: str) -> Any:
        """A class or function of the model's module (imports torch)."""
        return getattr(importlib.import_module(self.module), name)

    def build_for_training(self, task: str, config: dict, plan: str, labels: list[str] | None = None,
                           dropout: float | None = None):
        """A randomly initialised `task` model for a config dict (`longdoc train`)."""
        from longdoc.model.checkpoint import construct

        config = dict(config)
        if labels is not None:
            config["id2label"] = {i: name for i, name in enumerate(labels)}
            config.pop("label2id", None)
            config.pop("num_labels", None)
        if dropout is not None and self.dropout is not None:
            config = self.dropout(config, dropout)
        cfg = self.load(self.config_class).from_dict(config)
        if hasattr(cfg, "architectures"):
            cfg.architectures = [self.tasks[task]]
        return construct(self.load(self.classes[self.tasks[task]]), cfg, plan)


REGISTRY: dict[str, Architecture] = {}


def register(record: Architecture) -> Architecture:
    if record.model_type in REGISTRY:
        raise ValueError(f"model_type {record.model_type!r} is registered already")
    unknown = set(record.tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"{record.model_type}: unknown tasks {sorted(unknown)} (tasks: {', '.join(TASKS)})")
    if record.summarize_input not in SUMMARIZE_INPUTS:
        raise ValueError(f"{record.model_type}: summarize_input {record.summarize_input!r} is not one of "
                         f"{', '.join(SUMMARIZE_INPUTS)}")
    REGISTRY[record.model_type] = record
    return record


def lookup(model_type: Any) -> Architecture | None:
    return REGISTRY.get(model_type) if isinstance(model_type, str) else None


def model_types_for(task: str, training: bool = False) -> list[str]:
    """The model types that export (training: train) for `task`."""
    return [t for t, r in REGISTRY.items() if task in (r.train_tasks if training else r.tasks)]


def summarize_input_of(model_type: str | None) -> str:
    """The summarize input template of a checkpoint's `model_type` ("doc-eos" for unknown ones)."""
    record = lookup(model_type)
    return record.summarize_input if record else "doc-eos"


# ----------------------------------------------------------------------------------------------
# the architectures

register(Architecture(
    model_type="big_bird", module="longdoc.model.bigbird", config_class="BigBirdConfig",
    classes={"BigBirdModel": "BigBirdModel", "BigBirdForQuestionAnswering": "BigBirdForQuestionAnswering",
             "BigBirdForSequenceClassification": "BigBirdForSequenceClassification",
             "BigBirdForMaskedLM": "BigBirdForMaskedLM",
             # google/bigbird-roberta-base|large: the MLM head is used, the next-sentence head is not
             "BigBirdForPreTraining": "BigBirdForMaskedLM"},
    base_class="BigBirdModel",
    tasks={"qa": "BigBirdForQuestionAnswering", "classify": "BigBirdForSequenceClassification",
           "mlm": "BigBirdForMaskedLM", "embed": "BigBirdModel"},
    other_architectures={"BigBirdForPreTraining": "mlm", "BigBirdModel": None},
    train_tasks=("mlm", "qa", "classify"), dropout=bert_dropout,
    config_token_ids={"qa": ("sep",)},  # the question ends at the first sep_token_id: its global tokens
    ignored_keys={"BigBirdForPreTraining": (r"^cls\.seq_relationship\.",),
                  "BigBirdForQuestionAnswering": (r"^bert\.pooler\.",)},  # QA has no pooler; some files carry one
))

register(Architecture(
    model_type="longformer", module="longdoc.model.longformer", config_class="LongformerConfig",
    classes={"LongformerModel": "LongformerModel", "LongformerForQuestionAnswering": "LongformerForQuestionAnswering",
             "LongformerForSequenceClassification": "LongformerForSequenceClassification",
             "LongformerForMaskedLM": "LongformerForMaskedLM"},
    base_class="LongformerModel",
    tasks={"qa": "LongformerForQuestionAnswering", "classify": "LongformerForSequenceClassification"},
    windowed=True, length_bounds=roberta_window_lengths,
    # the question for QA (transformers' LongformerForQuestionAnswering default), the first token for classification
    global_tokens={"qa": "question", "classify": "first"},
    # the question (global) ends at sep_token_id; positions count the tokens that are not pad_token_id
    config_token_ids={"qa": ("sep", "pad"), "classify": ("pad",)},
    # transformers' Longformer heads have no pooler (add_pooling_layer=False); a file may carry one
    ignored_keys={arch: (r"^longformer\.pooler\.",) for arch in (
        "LongformerForQuestionAnswering", "LongformerForSequenceClassification", "LongformerForMaskedLM")},
))

register(Architecture(
    model_type="bigbird_pegasus", module="longdoc.model.pegasus", config_class="BigBirdPegasusConfig",
    classes={"BigBirdPegasusForConditionalGeneration": "BigBirdPegasusForConditionalGeneration"},
    base_class="BigBirdPegasusForConditionalGeneration",
    tasks={"summarize": "BigBirdPegasusForConditionalGeneration"},
    encoder_config=_bert_names, train_tasks=("summarize",), dropout=bart_dropout,
    config_token_ids={"summarize": ("eos",)},  # generation ends at eos_token_id
))

register(Architecture(
    model_type="led", module="longdoc.model.led", config_class="LEDConfig",
    classes={"LEDForConditionalGeneration": "LEDForConditionalGeneration"},
    base_class="LEDForConditionalGeneration",
    tasks={"summarize": "LEDForConditionalGeneration"},
    encoder_config=led_window_config, windowed=True, length_bounds=padded_window_lengths,
    # the first token global (allenai's recipe; longdoc.model.led.first_token_global), and that
    # token is bos: its tokenizer reads `<s> document </s>`
    global_tokens={"summarize": "first"}, summarize_input="bos-doc-eos",
    config_token_ids={"summarize": ("eos",)},
))

# transformers' EncoderDecoderModel with a big_bird encoder and a bert decoder (BERT2BERT)
register(Architecture(
    model_type="encoder-decoder", module="longdoc.model.encoder_decoder", config_class="EncoderDecoderConfig",
    classes={"EncoderDecoderModel": "EncoderDecoderModel"}, base_class="EncoderDecoderModel",
    tasks={"summarize": "EncoderDecoderModel"},
    encoder_config=_nested_encoder, summarize_input="cls-doc-eos",
    train_tasks=("summarize",), dropout=encoder_decoder_dropout,
    config_token_ids={"summarize": ("eos",)},
))

# ModernBERT: alternating sliding-window (band) and full attention layers, one spec per layer
# (`modernbert_layer_specs`: a band of local_attention / 2 tokens, or dense); no training.
register(Architecture(
    model_type="modernbert", module="longdoc.model.modernbert", config_class="ModernBertConfig",
    classes={"ModernBertModel": "ModernBertModel", "ModernBertForMaskedLM": "ModernBertForMaskedLM",
             "ModernBertForSequenceClassification": "ModernBertForSequenceClassification",
             "ModernBertForTokenClassification": "ModernBertForTokenClassification",
             "ModernBertForQuestionAnswering": "ModernBertForQuestionAnswering"},
    base_class="ModernBertModel",
    tasks={"qa": "ModernBertForQuestionAnswering", "classify": "ModernBertForSequenceClassification",
           "mlm": "ModernBertForMaskedLM", "embed": "ModernBertModel"},
    other_architectures={"ModernBertModel": None},
    layer_specs=modernbert_layer_specs, length_bounds=rotary_lengths,
))

# BERT (transformers' BertModel, e.g. sentence-transformers' all-MiniLM-L6-v2): BigBird's layers with
# full attention (longdoc.model.bert); exported for embeddings
register(Architecture(
    model_type="bert", module="longdoc.model.bert", config_class="BertConfig",
    classes={"BertModel": "BertModel"}, base_class="BertModel",
    tasks={"embed": "BertModel"},
    encoder_config=bert_blocks, length_bounds=dense_lengths,
))
