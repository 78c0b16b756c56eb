"""ModernBERT encoder (Warner et al. 2024) in PyTorch, weight-compatible with Hugging Face's
`ModernBertModel` and its heads, top-down in one file:

    config -> rotary embeddings -> attention -> MLP -> layer -> ModernBertModel -> heads

Submodules carry exactly the names of `transformers.models.modernbert.modeling_modernbert`, so
`state_dict()` keys equal the checkpoint keys one to one (`model.layers.1.attn.Wqkv.weight`).

What a layer computes (pre-LN; the first layer has no attention norm, `attn_norm` = identity):

    x = x + Wo(attention(rope(Wqkv(attn_norm(x)))))     # band or full, by the layer's type
    x = x + Wo(act(in) * gate),  (in, gate) = Wi(mlp_norm(x)).chunk(2)   # GeGLU
    ...  final_norm after the last layer

- Layer types are fixed when the model is built: `layer_types` from the config, or transformers'
  rule when it gives none (layer i is "full_attention" when i % global_attn_every_n_layers == 0,
  else "sliding_attention").
- Sliding layers attend within a band: query i sees key j when |i - j| <= local_attention // 2
  (transformers' `sliding_window_bidirectional_overlay`; a band of local_attention + 1 tokens).
- Rotary embeddings (Su et al. 2021, rotate-half form) with one base per layer type: the
  "full_attention" theta (`global_rope_theta`, 160000 in the released checkpoints) and the
  "sliding_attention" theta (`local_rope_theta`, 10000). Positions are 0..S-1 for every row
  (transformers' default position_ids): batches are right-padded.
- LayerNorms without bias when `norm_bias` is false; no token type ids, no position table.

The attention is the slow, obviously-correct reference: dense scores with an additive mask
(transformers' eager path, the same large negative constant, so fully masked rows of padding behave
alike). It is not a block layout of `longdoc.model.layout` yet (issue 28: per-layer layouts); the
ONNX export refuses ModernBERT until then (`longdoc.export.registry`).

Not implemented: attention / MLP / embedding dropout are kept as modules but the dense reference
has no attention-probability dropout (attention_dropout is 0.0 in the released configs and the
model is for inference); `inputs_embeds`; explicit `position_ids`; `sparse_prediction` (MLM logits
are always dense; the loss is the same); rope types other than "default".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longdoc.model.activations import ACTIVATIONS, check_activation
from longdoc.model.bigbird import (
    BigBirdModelOutput,
    MaskedLMOutput,
    QuestionAnsweringOutput,
    SequenceClassifierOutput,
    sequence_classification_loss,
    span_loss,
)
from longdoc.model.config import HFConfig

LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # transformers' defaults

# ----------------------------------------------------------------------------------------------
# config


@dataclass
class ModernBertConfig(HFConfig):
    """The fields of a Hugging Face ModernBERT `config.json` that change the computation (every
    other key is kept in `extra`). Defaults are transformers' `ModernBertConfig` defaults.

    Two spellings of the per-layer attention are read: the older files' `global_attn_every_n_layers`
    with `global_rope_theta` / `local_rope_theta`, and newer transformers' `layer_types` with
    `rope_parameters` ({layer type: {"rope_type": "default", "rope_theta": ...}}). `layer_type_list`
    and `rope_theta` hold the result."""

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    norm_eps: float = 1e-5
    norm_bias: bool = False
    pad_token_id: int | None = 50283
    eos_token_id: int | None = 50282
    bos_token_id: int | None = 50281
    cls_token_id: int | None = 50281
    sep_token_id: int | None = 50282
    attention_bias: bool = False
    attention_dropout: float = 0.0
    local_attention: int = 128
    embedding_dropout: float = 0.0
    mlp_bias: bool = False
    mlp_dropout: float = 0.0
    decoder_bias: bool = True
    classifier_pooling: str = "cls"  # "cls" | "mean"
    classifier_dropout: float = 0.0
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    # the per-layer attention, in either spelling (None: not in the file, not written back)
    layer_types: list[str] | None = None
    global_attn_every_n_layers: int | None = None
    rope_parameters: dict[str, Any] | None = None
    global_rope_theta: float | None = None
    local_rope_theta: float | None = None
    id2label: dict[int, str] | None = None
    problem_type: str | None = None
    tie_word_embeddings: bool = True
    architectures: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    model_type = "modernbert"  # class attribute, not a field
    _OPTIONAL = ("layer_types", "global_attn_every_n_layers", "rope_parameters", "global_rope_theta", "local_rope_theta")

    def __post_init__(self):
        check_activation(self.hidden_activation, "hidden_activation")
        check_activation(self.classifier_activation, "classifier_activation")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: rotary embeddings rotate pairs of dimensions")
        if self.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling must be 'cls' or 'mean', got {self.classifier_pooling!r}")
        if self.local_attention < 0:
            raise ValueError(f"local_attention must be >= 0, got {self.local_attention}")
        if self.extra.get("rope_scaling") is not None:
            raise ValueError(f"rope_scaling {self.extra['rope_scaling']!r} is not supported (only default rotary)")
        if self.layer_types is not None:
            types = list(self.layer_types)
        else:
            every = 3 if self.global_attn_every_n_layers is None else int(self.global_attn_every_n_layers)
            if every < 1:
                raise ValueError(f"global_attn_every_n_layers must be >= 1, got {every}")
            types = ["sliding_attention" if i % every else "full_attention" for i in range(self.num_hidden_layers)]
        if len(types) != self.num_hidden_layers or set(types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types must be {self.num_hidden_layers} of {LAYER_TYPES}, got {types!r}")
        self.layer_type_list: list[str] = types
        legacy = {"full_attention": self.global_rope_theta, "sliding_attention": self.local_rope_theta}
        self.rope_theta: dict[str, float] = {}
        for layer_type in LAYER_TYPES:
            params = (self.rope_parameters or {}).get(layer_type) or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters[{layer_type!r}]: rope_type {params['rope_type']!r} is not "
                                 f"supported (only 'default')")
            theta = params.get("rope_theta", legacy[layer_type])
            self.rope_theta[layer_type] = float(DEFAULT_THETA[layer_type] if theta is None else theta)
        if self.id2label is not None:
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}

    def to_dict(self) -> dict[str, Any]:
        # the per-layer attention as the file spelled it: an unset spelling is left out (transformers
        # reads a global_rope_theta of None as a rotary base of None)
        d = super().to_dict()
        for key in self._OPTIONAL:
            if d[key] is None:
                del d[key]
        return d

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def half_window(self) -> int:
        """Query i sees key j in a sliding layer when |i - j| <= half_window (transformers' `sliding_window`)."""
        return self.local_attention // 2


# ----------------------------------------------------------------------------------------------
# outputs (transformers' field names)


@dataclass
class TokenClassifierOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (B, S, num_labels)


# ----------------------------------------------------------------------------------------------
# modules (names as in transformers)


def layer_norm(config: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertEmbeddings(nn.Module):
    """token embeddings -> LayerNorm -> dropout; no position table (rotary), no token types."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = layer_norm(config)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, input_ids):
        return self.drop(self.norm(self.tok_embeddings(input_ids)))  # (B, S, C)


class ModernBertRotaryEmbedding(nn.Module):
    """cos / sin tables per layer type: inv_freq = theta^(-2i/d), angle = position * inv_freq, each
    angle twice (rotate-half layout). Buffers are not persistent: checkpoints hold none."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        d = config.head_dim
        for layer_type, theta in config.rope_theta.items():
            inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))  # (d/2,)
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, layer_type: str):
        # positions: (S,) long
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        freqs = positions[:, None].float() * inv_freq  # (S, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, d)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    # x: (B, nh, S, hd); cos, sin: (S, hd)
    return x * cos + rotate_half(x) * sin


class ModernBertAttention(nn.Module):
    """Fused q/k/v projection, rotary on q and k, dense softmax attention under an additive mask
    (a band for sliding layers, padding for all), output projection."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.n_head = config.num_attention_heads
        self.head_dim = config.head_dim
        C = config.hidden_size
        self.Wqkv = nn.Linear(C, 3 * C, bias=config.attention_bias)
        self.Wo = nn.Linear(C, C, bias=config.attention_bias)
        self.out_drop = nn.Dropout(config.attention_dropout)

    def forward(self, x, mask, cos, sin):
        # x: (B, S, C); mask: (B, 1, S, S) additive, 0 = attend
        B, S, C = x.shape
        qkv = self.Wqkv(x).view(B, S, 3, self.n_head, self.head_dim)  # (B, S, 3, nh, hd)
        q, k, v = qkv.unbind(dim=2)  # each (B, S, nh, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, S, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        att = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5 + mask  # (B, nh, S, S)
        y = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype) @ v  # (B, nh, S, hd)
        y = y.transpose(1, 2).reshape(B, S, C)  # (B, S, C)
        return self.out_drop(self.Wo(y))


class ModernBertMLP(nn.Module):
    """GeGLU (Shazeer 2020): Wo(act(in) * gate), (in, gate) = Wi(x).chunk(2)."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_activation]
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        inp, gate = self.Wi(x).chunk(2, dim=-1)  # (B, S, I) each
        return self.Wo(self.drop(self.act(inp) * gate))


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config: ModernBertConfig, layer: int):
        super().__init__()
        self.attn_norm = nn.Identity() if layer == 0 else layer_norm(config)  # the embeddings are normed already
        self.attn = ModernBertAttention(config)
        self.mlp_norm = layer_norm(config)
        self.mlp = ModernBertMLP(config)
        self.attention_type = config.layer_type_list[layer]

    def forward(self, x, mask, cos, sin):
        x = x + self.attn(self.attn_norm(x), mask, cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def attention_masks(key_mask: torch.Tensor, half_window: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The additive masks per layer type, (B, 1, S, S): 0 where query i may see key j, the dtype's
    minimum elsewhere (transformers' eager masks). key_mask: (B, S), 1 = real token.
    full: every real key; sliding: the real keys with |i - j| <= half_window."""
    S = key_mask.shape[1]
    keys = key_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
    pos = torch.arange(S, device=key_mask.device)
    band = (pos[:, None] - pos[None, :]).abs() <= half_window  # (S, S)
    neg = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=key_mask.device)
    return {"full_attention": torch.where(keys, zero, neg),
            "sliding_attention": torch.where(keys & band, zero, neg)}


def init_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) weights, zero biases, unit norms (for training from scratch; loading overwrites it)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


# ----------------------------------------------------------------------------------------------
# the encoder


class ModernBertModel(nn.Module):
    """Embeddings, the layers and the final norm. `forward(input_ids, attention_mask)` ->
    `last_hidden_state` (B, S, C); padded positions carry values but mean nothing."""

    base_model_prefix = "model"  # a task checkpoint's encoder keys (longdoc.model.checkpoint)

    def __init__(self, config: ModernBertConfig, add_pooling_layer: bool = False):
        # add_pooling_layer: the checkpoint loader's argument for BERT-style encoders; ModernBERT has no pooler
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = layer_norm(config)
        self.rotary_emb = ModernBertRotaryEmbedding(config)
        self.apply(lambda m: init_weights(m, config.initializer_range))

    def forward(self, input_ids, attention_mask=None) -> BigBirdModelOutput:
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long, device=input_ids.device)
        x = self.embeddings(input_ids)  # (B, S, C)
        masks = attention_masks(attention_mask, self.config.half_window, x.dtype)
        positions = torch.arange(S, device=input_ids.device)
        rope = {t: self.rotary_emb(positions, t) for t in set(self.config.layer_type_list)}
        for layer in self.layers:
            cos, sin = rope[layer.attention_type]
            x = layer(x, masks[layer.attention_type], cos.to(x.dtype), sin.to(x.dtype))
        return BigBirdModelOutput(last_hidden_state=self.final_norm(x))


# ----------------------------------------------------------------------------------------------
# heads


class ModernBertPredictionHead(nn.Module):
    """dense -> activation -> norm, before every head's output projection."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = ACTIVATIONS[config.classifier_activation]
        self.norm = layer_norm(config)

    def forward(self, x):
        return self.norm(self.act(self.dense(x)))


class _Head(nn.Module):
    """The encoder under `model.` and a prediction head under `head.`."""

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)


class ModernBertForMaskedLM(_Head):
    def __init__(self, config: ModernBertConfig):
        super().__init__(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)
        init_weights(self.decoder, config.initializer_range)
        if config.tie_word_embeddings:
            self.decoder.weight = self.model.embeddings.tok_embeddings.weight

    def forward(self, input_ids, attention_mask=None, labels=None) -> MaskedLMOutput:
        hidden = self.model(input_ids, attention_mask).last_hidden_state  # (B, S, C)
        logits = self.decoder(self.head(hidden))  # (B, S, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """(B, S, C) -> (B, C): the first token ("cls") or the mean over real tokens ("mean")."""
    if mode == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    return (hidden * attention_mask.unsqueeze(-1)).sum(dim=1) / attention_mask.sum(dim=1, keepdim=True)


class ModernBertForSequenceClassification(_Head):
    def __init__(self, config: ModernBertConfig):
        super().__init__(config)
        self.drop = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        init_weights(self.classifier, config.initializer_range)

    def forward(self, input_ids, attention_mask=None, labels=None) -> SequenceClassifierOutput:
        hidden = self.model(input_ids, attention_mask).last_hidden_state  # (B, S, C)
        pooled = pool(hidden, attention_mask, self.config.classifier_pooling)  # (B, C)
        logits = self.classifier(self.drop(self.head(pooled)))  # (B, num_labels)
        loss = None if labels is None else sequence_classification_loss(logits, labels, self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class ModernBertForTokenClassification(_Head):
    def __init__(self, config: ModernBertConfig):
        super().__init__(config)
        self.drop = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        init_weights(self.classifier, config.initializer_range)

    def forward(self, input_ids, attention_mask=None, labels=None) -> TokenClassifierOutput:
        hidden = self.model(input_ids, attention_mask).last_hidden_state  # (B, S, C)
        logits = self.classifier(self.drop(self.head(hidden)))  # (B, S, num_labels)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return TokenClassifierOutput(loss=loss, logits=logits)


class ModernBertForQuestionAnswering(_Head):
    """Start / end logits from a 2-way classifier (num_labels, 2 in QA checkpoints) over every token."""

    def __init__(self, config: ModernBertConfig):
        super().__init__(config)
        self.drop = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        init_weights(self.classifier, config.initializer_range)

    def forward(self, input_ids, attention_mask=None, start_positions=None, end_positions=None) -> QuestionAnsweringOutput:
        hidden = self.model(input_ids, attention_mask).last_hidden_state  # (B, S, C)
        logits = self.classifier(self.drop(self.head(hidden)))  # (B, S, 2)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))  # (B, S) each
        return QuestionAnsweringOutput(loss=span_loss(start_logits, end_logits, start_positions, end_positions),
                                       start_logits=start_logits, end_logits=end_logits)
