"""Longformer encoder (Beltagy et al. 2020) in PyTorch, weight-compatible with Hugging Face's
`LongformerModel` and its heads, top-down in one file:

    config -> embeddings -> attention -> layer -> encoder -> LongformerModel -> heads

Submodules carry exactly the names of `transformers.models.longformer.modeling_longformer`, so
`state_dict()` keys equal the checkpoint keys one to one
(`longformer.encoder.layer.0.attention.self.query_global.weight`). The feed-forward and output
blocks are BigBird's (`longdoc.model.bigbird`): the same BERT modules under the same names.

Attention (paper Sec. 3.1) is the one block-sparse attention of `longdoc.model.attention`:
- the sliding window of `attention_window` tokens (w = attention_window / 2 each side, per layer
  when the config gives a list) is a `longformer` layout: blocks of w tokens, each query block
  attends to its 3 neighbouring key blocks under a band of w tokens
  (`longdoc.model.layout.longformer_attention_specs`, one spec per layer, decided when the model is
  built);
- the global tokens come with each request (`global_attention_mask`: the question for QA, the
  first token for classification): every token attends to them (extra key slots, with the local
  key/value projections, as in transformers), and they attend to every token with their own
  projections `query_global` / `key_global` / `value_global`.
Sequences are padded to a multiple of every layer's w (transformers pads to a multiple of the
largest attention_window; padded keys never count, so the real tokens' outputs are the same).

Not implemented: attention dropout (transformers drops out Longformer's attention probabilities
in training; the block-sparse attention has no dropout), `inputs_embeds`, explicit `position_ids`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longdoc.model.attention import GlobalTokens, LayoutTensors, block_sparse_attention, global_tokens, layout_tensors
from longdoc.model.activations import check_activation
from longdoc.model.bigbird import (
    BigBirdClassificationHead,
    BigBirdIntermediate,
    BigBirdModelOutput,
    BigBirdOutput,
    BigBirdSelfOutput,
    HFConfig,
    MaskedLMOutput,
    QuestionAnsweringOutput,
    SequenceClassifierOutput,
    init_weights,
    question_mask,
    sequence_classification_loss,
    span_loss,
)
from longdoc.model.layout import AttentionSpec, build_layout, longformer_attention_specs

# ----------------------------------------------------------------------------------------------
# config


@dataclass
class LongformerConfig(HFConfig):
    """The fields of a Hugging Face Longformer `config.json` that change the computation (every
    other key is kept in `extra`). Defaults are transformers' `LongformerConfig` defaults."""

    attention_window: int | list[int] = 512  # one value, or one per layer; even
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2
    sep_token_id: int = 2
    position_embedding_type: str = "absolute"
    id2label: dict[int, str] | None = None
    problem_type: str | None = None
    tie_word_embeddings: bool = True
    architectures: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    model_type = "longformer"  # class attribute, not a field

    def __post_init__(self):
        check_activation(self.hidden_act)
        if self.position_embedding_type != "absolute":
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} is not supported (only 'absolute')")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.extra.get("is_decoder") or self.extra.get("add_cross_attention"):
            raise ValueError("Longformer as a decoder (is_decoder / add_cross_attention) is not supported")
        # a bad attention_window fails here, by name
        longformer_attention_specs({"num_hidden_layers": self.num_hidden_layers, "attention_window": self.attention_window})
        if self.id2label is not None:
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def attention_specs_for(config: LongformerConfig) -> tuple[AttentionSpec, ...]:
    """One layout spec per layer (`longdoc.model.layout.longformer_attention_specs`)."""
    return longformer_attention_specs(config.to_dict())


def padded_length(seq_len: int, specs: tuple[AttentionSpec, ...]) -> int:
    """seq_len rounded up to a multiple of every layer's block size (w tokens)."""
    multiple = math.lcm(*(s.block_size for s in specs))
    return -(-seq_len // multiple) * multiple


def window_layouts(specs: tuple[AttentionSpec, ...], padded_len: int, num_heads: int, device: torch.device | str,
                   cache: dict) -> list[LayoutTensors]:
    """Per-layer layout tensors of the sliding windows for a padded length; layer i has
    padded_len / w_i blocks. Cached in `cache` by (padded_len, device): layouts are deterministic
    in both. The one windowing of Longformer and LED (longdoc.model.led)."""
    key = (padded_len, str(device))
    if key not in cache:
        cache[key] = [layout_tensors(build_layout(spec, padded_len // spec.block_size, num_heads, layer=i), device)
                      for i, spec in enumerate(specs)]
    return cache[key]


def position_ids_from(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """RoBERTa's positions (transformers' `create_position_ids_from_input_ids`): non-pad tokens
    count up from pad_token_id + 1, pad tokens sit at pad_token_id. (B, S) long."""
    not_pad = input_ids.ne(pad_token_id).long()
    return torch.cumsum(not_pad, dim=1) * not_pad + pad_token_id


# ----------------------------------------------------------------------------------------------
# modules (names as in transformers)


class LongformerEmbeddings(nn.Module):
    """word + position + token type embeddings -> LayerNorm -> dropout (the reference's order)."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, padding_idx=config.pad_token_id)

    def forward(self, input_ids, token_type_ids, position_ids):
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))  # (B, S, H)


class LongformerSelfAttention(nn.Module):
    """Local projections for the window rows, global ones for the global tokens' rows. Also LED's
    encoder self-attention (`longformer_self_attn`); config needs hidden_size, num_attention_heads
    and head_dim."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.n_head = config.num_attention_heads
        self.head_dim = config.head_dim
        C = config.hidden_size
        self.query = nn.Linear(C, C)
        self.key = nn.Linear(C, C)
        self.value = nn.Linear(C, C)
        self.query_global = nn.Linear(C, C)
        self.key_global = nn.Linear(C, C)
        self.value_global = nn.Linear(C, C)

    def _heads(self, x):
        B, S, _ = x.shape
        return x.view(B, S, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)

    def forward(self, x, key_mask, layout: LayoutTensors, globals_: GlobalTokens | None):
        # x: (B, S, C); key_mask: (B, S), 1 = real token
        B, S, C = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))  # (B, nh, S, hd)
        global_qkv = None
        if globals_ is not None:
            G = globals_.index.shape[1]
            x_glob = torch.gather(x, 1, globals_.index.view(B, G, 1).expand(B, G, C))  # (B, G, C)
            global_qkv = (self._heads(self.query_global(x_glob)), self._heads(self.key_global(x)), self._heads(self.value_global(x)))
        y = block_sparse_attention(q, k, v, layout, key_mask, global_tokens=globals_, global_qkv=global_qkv)  # (B, nh, S, hd)
        return y.transpose(1, 2).reshape(B, S, C)  # (B, S, C)


class LongformerAttention(nn.Module):
    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.self = LongformerSelfAttention(config)
        self.output = BigBirdSelfOutput(config)  # dense -> dropout -> LayerNorm(+ residual)

    def forward(self, x, key_mask, layout, globals_):
        return self.output(self.self(x, key_mask, layout, globals_), x)


class LongformerLayer(nn.Module):
    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.attention = LongformerAttention(config)
        self.intermediate = BigBirdIntermediate(config)
        self.output = BigBirdOutput(config)

    def forward(self, x, key_mask, layout, globals_):
        x = self.attention(x, key_mask, layout, globals_)
        return self.output(self.intermediate(x), x)


class LongformerEncoder(nn.Module):
    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.layer = nn.ModuleList([LongformerLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, x, key_mask, layouts: list[LayoutTensors], globals_: GlobalTokens | None):
        for layer, layout in zip(self.layer, layouts):
            x = layer(x, key_mask, layout, globals_)
        return x


class LongformerPooler(nn.Module):
    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden):
        return torch.tanh(self.dense(hidden[:, 0]))  # (B, C), the first token


# ----------------------------------------------------------------------------------------------
# the encoder


class LongformerModel(nn.Module):
    """Embeddings + encoder (+ tanh pooler over the first token).

    `forward` takes any length up to the position table: it pads to a multiple of every layer's
    w, runs the windowed attention with the request's global tokens, strips the padding.
    """

    base_model_prefix = "longformer"  # the encoder's key prefix inside a task checkpoint

    def __init__(self, config: LongformerConfig, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.attention_specs = attention_specs_for(config)
        self.embeddings = LongformerEmbeddings(config)
        self.encoder = LongformerEncoder(config)
        self.pooler = LongformerPooler(config) if add_pooling_layer else None
        self._layout_cache: dict[tuple[int, str], list[LayoutTensors]] = {}
        self.apply(lambda m: init_weights(m, config.initializer_range))

    def layouts(self, padded_len: int, device: torch.device | str = "cpu") -> list[LayoutTensors]:
        """Per-layer layout tensors for a padded length (`window_layouts`, cached)."""
        return window_layouts(self.attention_specs, padded_len, self.config.num_attention_heads, device, self._layout_cache)

    def encode(self, input_ids, attention_mask, global_attention_mask, token_type_ids, layouts: list[LayoutTensors]):
        """input_ids, attention_mask, global_attention_mask, token_type_ids: (B, P), P padded
        (a multiple of every layer's block size). Returns hidden states (B, P, C)."""
        x = self.embeddings(input_ids, token_type_ids, position_ids_from(input_ids, self.config.pad_token_id))  # (B, P, C)
        key_mask = attention_mask.to(x.dtype)  # (B, P)
        globals_ = global_tokens(global_attention_mask, attention_mask)
        return self.encoder(x, key_mask, layouts, globals_)

    def pool(self, hidden):
        return self.pooler(hidden) if self.pooler is not None else None

    def forward(self, input_ids, attention_mask=None, global_attention_mask=None, token_type_ids=None) -> BigBirdModelOutput:
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if global_attention_mask is None:
            global_attention_mask = torch.zeros_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        P = padded_length(S, self.attention_specs)
        # RoBERTa positions: the last real token sits at S + pad_token_id (the padding at pad_token_id)
        if S + self.config.pad_token_id >= self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {S} exceeds the position table: max_position_embeddings "
                f"{self.config.max_position_embeddings} holds {self.config.max_position_embeddings - self.config.pad_token_id - 1} tokens"
            )
        pad = P - S
        if pad:
            input_ids = F.pad(input_ids, (0, pad), value=self.config.pad_token_id)
            attention_mask = F.pad(attention_mask, (0, pad), value=0)
            global_attention_mask = F.pad(global_attention_mask, (0, pad), value=0)
            token_type_ids = F.pad(token_type_ids, (0, pad), value=0)
        hidden = self.encode(input_ids, attention_mask, global_attention_mask, token_type_ids, self.layouts(P, input_ids.device))
        return BigBirdModelOutput(last_hidden_state=hidden[:, :S], pooler_output=self.pool(hidden))


class _Head(nn.Module):
    """Shared plumbing of the task models: `longformer` is the encoder."""

    longformer: LongformerModel

    @property
    def attention_specs(self) -> tuple[AttentionSpec, ...]:
        return self.longformer.attention_specs


# ----------------------------------------------------------------------------------------------
# heads


def question_global_mask(input_ids, sep_token_id: int) -> torch.Tensor:
    """(B, S) long, 1 on the tokens before the first separator: transformers' default global
    attention for QA (`[CLS] question [SEP] [SEP] context [SEP]`, the separator itself local)."""
    has_sep = input_ids.eq(sep_token_id).any(dim=1)
    if not bool(has_sep.all()):
        raise ValueError(
            f"QA input without sep_token_id {sep_token_id} in row(s) {torch.nonzero(~has_sep).flatten().tolist()}: "
            "pass global_attention_mask (the question's tokens) explicitly"
        )
    first_sep = torch.argmax(input_ids.eq(sep_token_id).int(), dim=-1)  # (B,)
    return question_mask(input_ids, first_sep, sep_token_id)


class LongformerForQuestionAnswering(_Head):
    """Extractive QA: a linear layer to start/end logits. Global attention defaults to the
    question (the tokens before the first separator)."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.config = config
        self.longformer = LongformerModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        init_weights(self.qa_outputs, config.initializer_range)

    def forward(self, input_ids, attention_mask=None, global_attention_mask=None, token_type_ids=None,
                start_positions=None, end_positions=None) -> QuestionAnsweringOutput:
        if global_attention_mask is None:
            global_attention_mask = question_global_mask(input_ids, self.config.sep_token_id)
        hidden = self.longformer(input_ids, attention_mask, global_attention_mask, token_type_ids).last_hidden_state
        logits = self.qa_outputs(hidden)  # (B, S, 2)
        start_logits, end_logits = logits[..., 0], logits[..., 1]  # (B, S) each
        loss = span_loss(start_logits, end_logits, start_positions, end_positions)
        return QuestionAnsweringOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)


class LongformerForSequenceClassification(_Head):
    """First token -> dense -> tanh -> out_proj. Global attention defaults to the first token."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.config = config
        self.longformer = LongformerModel(config, add_pooling_layer=False)
        self.classifier = BigBirdClassificationHead(config, activation="tanh")
        self.classifier.apply(lambda m: init_weights(m, config.initializer_range))

    def forward(self, input_ids, attention_mask=None, global_attention_mask=None, token_type_ids=None,
                labels=None) -> SequenceClassifierOutput:
        if global_attention_mask is None:
            global_attention_mask = torch.zeros_like(input_ids)
            global_attention_mask[:, 0] = 1
        hidden = self.longformer(input_ids, attention_mask, global_attention_mask, token_type_ids).last_hidden_state
        logits = self.classifier(hidden)  # (B, num_labels)
        loss = None if labels is None else sequence_classification_loss(logits, labels, self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class LongformerLMHead(nn.Module):
    """dense -> GELU (erf) -> layer_norm -> decoder. With `tie_word_embeddings` (the default)
    `LongformerForMaskedLM` ties the decoder's weight to the word embeddings and its bias to
    `lm_head.bias` (one parameter, two names); without it, as in transformers 5, both are
    parameters of their own and the decoder's bias is the one used."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x):
        return self.decoder(self.layer_norm(F.gelu(self.dense(x))))  # (B, S, vocab)


class LongformerForMaskedLM(_Head):
    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.config = config
        self.longformer = LongformerModel(config, add_pooling_layer=False)
        self.lm_head = LongformerLMHead(config)
        self.lm_head.apply(lambda m: init_weights(m, config.initializer_range))
        if config.tie_word_embeddings:
            self.lm_head.decoder.weight = self.longformer.embeddings.word_embeddings.weight
            self.lm_head.decoder.bias = self.lm_head.bias

    def forward(self, input_ids, attention_mask=None, global_attention_mask=None, token_type_ids=None,
                labels=None) -> MaskedLMOutput:
        hidden = self.longformer(input_ids, attention_mask, global_attention_mask, token_type_ids).last_hidden_state
        logits = self.lm_head(hidden)  # (B, S, vocab)
        loss = None
        if labels is not None:  # -100 = not a prediction target
            loss = F.cross_entropy(logits.view(-1, self.config.vocab_size), labels.view(-1))
        return MaskedLMOutput(loss=loss, logits=logits)
