"""BigBird encoder (Zaheer et al. 2020) in PyTorch, weight-compatible with Hugging Face's
`BigBirdModel` and its heads, top-down in one file:

    activations -> config -> embeddings -> attention -> layer -> encoder -> BigBirdModel -> heads

Submodules carry exactly the names of `transformers.models.big_bird.modeling_big_bird`, so
`state_dict()` keys equal the checkpoint keys one to one (`bert.encoder.layer.0.attention.self.query.weight`).

What differs from the reference is *when* decisions are made. Transformers decides the attention
mode inside `forward` (and switches the whole model to full attention on a short input, for good),
and draws its random blocks from NumPy's global RNG inside `forward`. Here:

- `longdoc.model.lengths.plan_length` decides, from the sequence length alone, how far to pad and
  whether to use full or block-sparse attention (transformers' rule, made explicit);
- the attention pattern is data: `longdoc.model.layout.build_layout(spec, n_blocks, num_heads, layer)`
  gives each layer a table of key blocks per (head, query block); the spec (`attention_spec`,
  with its plan "hf-train" / "hf-eval" / "seeded") is fixed when the model is built;
- `longdoc.model.attention.block_sparse_attention` consumes any such table.

`encode` is the export-friendly core: padded inputs in, hidden states out, layout tables as
ordinary tensor inputs, no Python branching on data. `forward_blocks` on every model wraps it
with stacked per-layer layout tensors for ONNX export (dynamic length, layout as graph inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longdoc.model.activations import ACTIVATIONS, check_activation
from longdoc.model.config import HFConfig
from longdoc.model.attention import LayoutTensors, block_sparse_attention, layout_tensors
from longdoc.model.layout import AttentionSpec, build_layout, checkpoint_attention_spec
from longdoc.model.lengths import plan_length

# ----------------------------------------------------------------------------------------------
# config


@dataclass
class BigBirdConfig(HFConfig):
    """The fields of a Hugging Face BigBird `config.json` that change the computation.

    Every other key of the file is kept in `extra` and written back unchanged by `to_dict`.
    """

    vocab_size: int = 50358
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu_new"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 4096
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    sep_token_id: int = 66
    attention_type: str = "block_sparse"  # "block_sparse" | "original_full"
    use_bias: bool = True  # bias of the query/key/value projections
    rescale_embeddings: bool = False  # multiply word embeddings by sqrt(hidden_size)
    block_size: int = 64
    num_random_blocks: int = 3
    position_embedding_type: str = "absolute"
    classifier_dropout: float | None = None
    id2label: dict[int, str] | None = None
    problem_type: str | None = None  # "regression" | "single_label_classification" | "multi_label_classification"
    tie_word_embeddings: bool = True
    architectures: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    model_type = "big_bird"  # class attribute, not a field

    def __post_init__(self):
        if self.attention_type not in ("block_sparse", "original_full"):
            raise ValueError(
                f"attention_type must be 'block_sparse' or 'original_full', got {self.attention_type!r}"
            )
        check_activation(self.hidden_act)
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"position_embedding_type {self.position_embedding_type!r} is not supported (only 'absolute')"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.extra.get("is_decoder") or self.extra.get("add_cross_attention"):
            raise ValueError("BigBird as a decoder (is_decoder / add_cross_attention) is not supported")
        if self.id2label is not None:
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def attention_spec_for(config: BigBirdConfig, plan: str = "hf-train") -> AttentionSpec:
    """The layout spec a BigBird config implies (`longdoc.model.layout.checkpoint_attention_spec`)."""
    return checkpoint_attention_spec(config.to_dict(), plan)


# ----------------------------------------------------------------------------------------------
# outputs (transformers' field names)


@dataclass
class BigBirdModelOutput:
    last_hidden_state: torch.Tensor  # (B, S, H)
    pooler_output: torch.Tensor | None = None  # (B, H)


@dataclass
class QuestionAnsweringOutput:
    loss: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None  # (B, S)
    end_logits: torch.Tensor | None = None  # (B, S)
    pooler_output: torch.Tensor | None = None


@dataclass
class SequenceClassifierOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (B, num_labels)


@dataclass
class MaskedLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (B, S, vocab)


# ----------------------------------------------------------------------------------------------
# modules (names as in transformers)


class BigBirdEmbeddings(nn.Module):
    """word + token type + absolute position embeddings -> dropout -> LayerNorm (the reference's order)."""

    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.scale = config.hidden_size**0.5 if config.rescale_embeddings else None

    def forward(self, input_ids, token_type_ids, position_ids):
        x = self.word_embeddings(input_ids)  # (B, S, H)
        if self.scale is not None:
            x = x * self.scale
        x = x + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return self.LayerNorm(self.dropout(x))


class BigBirdSelfAttention(nn.Module):
    """Multi-head self-attention: full (layout None) or block-sparse over a layout table."""

    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.n_head = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size, bias=config.use_bias)
        self.key = nn.Linear(config.hidden_size, config.hidden_size, bias=config.use_bias)
        self.value = nn.Linear(config.hidden_size, config.hidden_size, bias=config.use_bias)
        # transformers applies attention dropout in full attention only (its sparse path has none)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, x, key_mask, layout: LayoutTensors | None):
        # x: (B, S, H); key_mask: (B, S) float, 1 = real token
        B, S, _ = x.shape
        q = self.query(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        k = self.key(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        v = self.value(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        if layout is None:
            y = self.full_attention(q, k, v, key_mask)  # (B, nh, S, hd)
        else:
            y = block_sparse_attention(q, k, v, layout, key_mask)  # (B, nh, S, hd), zero at padding
        return y.transpose(1, 2).reshape(B, S, self.n_head * self.head_dim)  # (B, S, H)

    def full_attention(self, q, k, v, key_mask):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, S, S)
        # padded keys: a large negative (half the dtype minimum, so fp16 sums stay finite)
        att = att + (1.0 - key_mask[:, None, None, :]) * (torch.finfo(att.dtype).min / 2)
        att = self.dropout(F.softmax(att, dim=-1))
        return att @ v  # (B, nh, S, hd)


class BigBirdSelfOutput(nn.Module):
    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)  # post-LN


class BigBirdAttention(nn.Module):
    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.self = BigBirdSelfAttention(config)
        self.output = BigBirdSelfOutput(config)

    def forward(self, x, key_mask, layout):
        return self.output(self.self(x, key_mask, layout), x)


class BigBirdIntermediate(nn.Module):
    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.act(self.dense(x))


class BigBirdOutput(nn.Module):
    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)  # post-LN


class BigBirdLayer(nn.Module):
    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.attention = BigBirdAttention(config)
        self.intermediate = BigBirdIntermediate(config)
        self.output = BigBirdOutput(config)

    def forward(self, x, key_mask, layout):
        x = self.attention(x, key_mask, layout)
        return self.output(self.intermediate(x), x)


class BigBirdEncoder(nn.Module):
    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.layer = nn.ModuleList([BigBirdLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, x, key_mask, layouts: list[LayoutTensors] | None):
        for i, layer in enumerate(self.layer):
            x = layer(x, key_mask, None if layouts is None else layouts[i])
        return x


def init_weights(module: nn.Module, std: float) -> None:
    """BERT initialisation (for training from scratch; loading overwrites it)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


# ----------------------------------------------------------------------------------------------
# the encoder


class BigBirdModel(nn.Module):
    """Embeddings + encoder (+ tanh pooler over the first token).

    `forward` takes any length up to `max_position_embeddings`: it pads to the length plan
    (`longdoc.model.lengths.plan_length`), runs full or block-sparse attention as planned, and strips
    the padding from the outputs.
    """

    base_model_prefix = "bert"  # the encoder's key prefix inside a task checkpoint

    def __init__(self, config: BigBirdConfig, plan: str = "hf-train", add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.attention_spec = attention_spec_for(config, plan)
        self.embeddings = BigBirdEmbeddings(config)
        self.encoder = BigBirdEncoder(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if add_pooling_layer else None
        self._layout_cache: dict[tuple[int, str], list[LayoutTensors]] = {}
        self.apply(lambda m: init_weights(m, config.initializer_range))

    # --- layouts -------------------------------------------------------------------------------

    def layouts(self, n_blocks: int, device: torch.device | str = "cpu") -> list[LayoutTensors]:
        """Per-layer layout tensors for a padded length of `n_blocks` blocks (cached)."""
        key = (n_blocks, str(device))
        if key not in self._layout_cache:
            H = self.config.num_attention_heads
            self._layout_cache[key] = [
                layout_tensors(build_layout(self.attention_spec, n_blocks, H, layer=i), device)
                for i in range(self.config.num_hidden_layers)
            ]
        return self._layout_cache[key]

    def stacked_layouts(self, n_blocks: int, device="cpu") -> dict[str, torch.Tensor]:
        """The layout inputs of `forward_blocks`, every layer's `LayoutTensors` stacked on a
        leading layer axis: key_blocks (L, H, nb, K) long, valid (L, H, nb, K) bool,
        global_index (L, G) long, row_source (L, nb) long. Layers with fewer slots are padded
        with invalid slots (key block 0, valid False)."""
        per_layer = self.layouts(n_blocks, device)
        K = max(lay.key_blocks.shape[-1] for lay in per_layer)
        if len({lay.global_index.shape[0] for lay in per_layer}) != 1:
            raise ValueError("layers with different numbers of global blocks cannot be stacked")
        return {
            "key_blocks": torch.stack([F.pad(lay.key_blocks, (0, K - lay.key_blocks.shape[-1])) for lay in per_layer]),
            "valid": torch.stack([F.pad(lay.valid, (0, K - lay.valid.shape[-1]), value=False) for lay in per_layer]),
            "global_index": torch.stack([lay.global_index for lay in per_layer]),
            "row_source": torch.stack([lay.row_source for lay in per_layer]),
        }

    # --- forward -------------------------------------------------------------------------------

    def encode(self, input_ids, attention_mask, token_type_ids, layouts: list[LayoutTensors] | None):
        """The export-friendly core. input_ids, attention_mask, token_type_ids: (B, P) with P the
        padded length (a block multiple when `layouts` is given); layouts: one per layer, or None
        for full attention. Returns hidden states (B, P, H)."""
        P = input_ids.shape[1]
        position_ids = torch.arange(P, device=input_ids.device).clamp(max=self.config.max_position_embeddings - 1)
        x = self.embeddings(input_ids, token_type_ids, position_ids[None, :])  # (B, P, H)
        key_mask = attention_mask.to(x.dtype)  # (B, P)
        return self.encoder(x, key_mask, layouts)

    def pool(self, hidden):
        return torch.tanh(self.pooler(hidden[:, 0])) if self.pooler is not None else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> BigBirdModelOutput:
        B, S = input_ids.shape
        if S > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {S} exceeds max_position_embeddings {self.config.max_position_embeddings}"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        c = self.config
        lp = plan_length(S, c.block_size, c.num_random_blocks, c.attention_type)
        pad = lp.padded_len - S
        if pad:
            input_ids = F.pad(input_ids, (0, pad), value=c.pad_token_id)
            attention_mask = F.pad(attention_mask, (0, pad), value=0)
            token_type_ids = F.pad(token_type_ids, (0, pad), value=0)
        layouts = None
        if lp.attention == "block_sparse":
            layouts = self.layouts(lp.padded_len // c.block_size, input_ids.device)
        hidden = self.encode(input_ids, attention_mask, token_type_ids, layouts)  # (B, P, H)
        return BigBirdModelOutput(last_hidden_state=hidden[:, :S], pooler_output=self.pool(hidden))

    def forward_blocks(self, input_ids, attention_mask, token_type_ids, key_blocks, valid, global_index, row_source):
        """Export entry point: padded inputs (B, P), P a multiple of block_size, and the stacked
        layout tensors of `stacked_layouts`. Returns (last_hidden_state,) or
        (last_hidden_state, pooler_output), see `export_output_names`."""
        hidden = self.encode(input_ids, attention_mask, token_type_ids, unstack_layouts(key_blocks, valid, global_index, row_source))
        return (hidden,) if self.pooler is None else (hidden, self.pool(hidden))

    @property
    def export_output_names(self) -> tuple[str, ...]:
        return ("last_hidden_state",) if self.pooler is None else ("last_hidden_state", "pooler_output")


def unstack_layouts(key_blocks, valid, global_index, row_source) -> list[LayoutTensors]:
    # key_blocks, valid: (L, H, nb, K); global_index: (L, G); row_source: (L, nb)
    nb = row_source.shape[1]
    return [
        LayoutTensors(key_blocks[i], valid[i], row_source[i] >= nb, global_index[i], row_source[i])
        for i in range(key_blocks.shape[0])
    ]


class _Head(nn.Module):
    """Shared plumbing of the task models: `bert` is the encoder."""

    bert: BigBirdModel

    @property
    def attention_spec(self) -> AttentionSpec:
        return self.bert.attention_spec

    def layouts(self, n_blocks: int, device="cpu") -> list[LayoutTensors]:
        return self.bert.layouts(n_blocks, device)

    def stacked_layouts(self, n_blocks: int, device="cpu") -> dict[str, torch.Tensor]:
        return self.bert.stacked_layouts(n_blocks, device)


# ----------------------------------------------------------------------------------------------
# heads


class BigBirdForQuestionAnsweringHead(nn.Module):
    """dropout -> (intermediate, output: a feed-forward block with residual + LN) -> 2 logits."""

    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.intermediate = BigBirdIntermediate(config)
        self.output = BigBirdOutput(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

    def forward(self, hidden):
        x = self.dropout(hidden)
        x = self.output(self.intermediate(x), hidden)
        return self.qa_outputs(x)  # (B, S, 2)


def question_mask(input_ids, question_lengths, sep_token_id: int):
    """(B, S) long, 1 on question tokens. Without `question_lengths` the question is taken to end
    at the first [SEP] (input laid out as `[CLS] question [SEP] context [SEP]`), as transformers does."""
    S = input_ids.shape[1]
    if question_lengths is None:
        question_lengths = torch.argmax(input_ids.eq(sep_token_id).int(), dim=-1) + 1  # (B,)
    question_lengths = question_lengths.reshape(-1, 1)  # (B, 1)
    return (torch.arange(S, device=input_ids.device)[None, :] < question_lengths).long()  # (B, S)


def span_loss(start_logits, end_logits, start_positions, end_positions) -> torch.Tensor | None:
    """transformers' extractive-QA loss: mean of the start and end cross-entropies; positions
    outside the input are ignored. None without both position tensors."""
    if start_positions is None or end_positions is None:
        return None
    ignored = start_logits.shape[1]
    start_positions = start_positions.reshape(-1).clamp(0, ignored)
    end_positions = end_positions.reshape(-1).clamp(0, ignored)
    return (
        F.cross_entropy(start_logits, start_positions, ignore_index=ignored)
        + F.cross_entropy(end_logits, end_positions, ignore_index=ignored)
    ) / 2


class BigBirdForQuestionAnswering(_Head):
    """Extractive QA. Question tokens (all but [CLS]) get start/end logits lowered by 1e6 so they
    never win; token types default to 0 on the question and 1 on the context."""

    def __init__(self, config: BigBirdConfig, plan: str = "hf-train", add_pooling_layer: bool = False):
        super().__init__()
        self.config = config
        self.bert = BigBirdModel(config, plan=plan, add_pooling_layer=add_pooling_layer)
        self.qa_classifier = BigBirdForQuestionAnsweringHead(config)
        self.qa_classifier.apply(lambda m: init_weights(m, config.initializer_range))

    def _logits(self, hidden, qmask):
        logits = self.qa_classifier(hidden)  # (B, S, 2)
        qmask = qmask.clone()
        qmask[:, 0] = 0  # [CLS] stays a candidate ("no answer")
        logits = logits - qmask[:, :, None] * 1e6
        return logits[..., 0], logits[..., 1]  # (B, S) each

    def forward(
        self,
        input_ids,
        attention_mask=None,
        question_lengths=None,
        token_type_ids=None,
        start_positions=None,
        end_positions=None,
    ) -> QuestionAnsweringOutput:
        qmask = question_mask(input_ids, question_lengths, self.config.sep_token_id)
        if token_type_ids is None:
            token_type_ids = 1 - qmask
        out = self.bert(input_ids, attention_mask, token_type_ids)
        start_logits, end_logits = self._logits(out.last_hidden_state, qmask)
        loss = span_loss(start_logits, end_logits, start_positions, end_positions)
        return QuestionAnsweringOutput(
            loss=loss, start_logits=start_logits, end_logits=end_logits, pooler_output=out.pooler_output
        )

    def forward_blocks(self, input_ids, attention_mask, token_type_ids, key_blocks, valid, global_index, row_source):
        """Export entry point (see `BigBirdModel.forward_blocks`). token_type_ids may be None:
        then they are derived from the question mask, as in `forward`. The question ends at
        the first [SEP]. Returns (start_logits, end_logits), each (B, P)."""
        qmask = question_mask(input_ids, None, self.config.sep_token_id)
        if token_type_ids is None:
            token_type_ids = 1 - qmask
        layouts = unstack_layouts(key_blocks, valid, global_index, row_source)
        hidden = self.bert.encode(input_ids, attention_mask, token_type_ids, layouts)
        return self._logits(hidden, qmask)

    export_output_names = ("start_logits", "end_logits")


class BigBirdClassificationHead(nn.Module):
    """[CLS] -> dropout -> dense -> activation -> dropout -> out_proj."""

    def __init__(self, config: BigBirdConfig, activation: str | None = None):
        super().__init__()
        p = getattr(config, "classifier_dropout", None)
        p = p if p is not None else config.hidden_dropout_prob
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(p)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.act = ACTIVATIONS[activation or config.hidden_act]  # Longformer's head: always tanh

    def forward(self, hidden):
        x = self.dropout(hidden[:, 0])  # (B, H), the first token
        x = self.dropout(self.act(self.dense(x)))
        return self.out_proj(x)  # (B, num_labels)


def sequence_classification_loss(logits, labels, config) -> torch.Tensor:
    """transformers' loss for `config.problem_type` (inferred as transformers does when unset,
    without writing it back to the config)."""
    n = config.num_labels
    problem = config.problem_type
    if problem is None:
        if n == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype)) if n == 1 else F.mse_loss(logits, labels)
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, n), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


class BigBirdForSequenceClassification(_Head):
    def __init__(self, config: BigBirdConfig, plan: str = "hf-train"):
        super().__init__()
        self.config = config
        self.bert = BigBirdModel(config, plan=plan)
        self.classifier = BigBirdClassificationHead(config)
        self.classifier.apply(lambda m: init_weights(m, config.initializer_range))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> SequenceClassifierOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids)
        logits = self.classifier(out.last_hidden_state)
        loss = None if labels is None else sequence_classification_loss(logits, labels, self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def forward_blocks(self, input_ids, attention_mask, token_type_ids, key_blocks, valid, global_index, row_source):
        """Export entry point. Returns (logits,) of shape (B, num_labels)."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        layouts = unstack_layouts(key_blocks, valid, global_index, row_source)
        return (self.classifier(self.bert.encode(input_ids, attention_mask, token_type_ids, layouts)),)

    export_output_names = ("logits",)


class BigBirdPredictionHeadTransform(nn.Module):
    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x):
        return self.LayerNorm(self.act(self.dense(x)))


class BigBirdLMPredictionHead(nn.Module):
    """transform -> decoder. With `tie_word_embeddings` (the default) the decoder's weight is the
    word embeddings' and its bias *is* `predictions.bias` (one parameter, two names); without it,
    as in transformers 5, both are parameters of their own and the decoder's bias is the one used."""

    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.transform = BigBirdPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = self.decoder.bias if config.tie_word_embeddings else nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x):
        return self.decoder(self.transform(x))  # (B, S, vocab)


class BigBirdOnlyMLMHead(nn.Module):
    def __init__(self, config: BigBirdConfig):
        super().__init__()
        self.predictions = BigBirdLMPredictionHead(config)

    def forward(self, x):
        return self.predictions(x)


class BigBirdForMaskedLM(_Head):
    def __init__(self, config: BigBirdConfig, plan: str = "hf-train"):
        super().__init__()
        self.config = config
        self.bert = BigBirdModel(config, plan=plan)
        self.cls = BigBirdOnlyMLMHead(config)
        self.cls.apply(lambda m: init_weights(m, config.initializer_range))
        nn.init.zeros_(self.cls.predictions.bias)
        if config.tie_word_embeddings:
            self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> MaskedLMOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids)
        logits = self.cls(out.last_hidden_state)  # (B, S, vocab)
        loss = None
        if labels is not None:  # -100 = not a prediction target
            loss = F.cross_entropy(logits.view(-1, self.config.vocab_size), labels.view(-1))
        return MaskedLMOutput(loss=loss, logits=logits)

    def forward_blocks(self, input_ids, attention_mask, token_type_ids, key_blocks, valid, global_index, row_source):
        """Export entry point. Returns (logits,) of shape (B, P, vocab)."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        layouts = unstack_layouts(key_blocks, valid, global_index, row_source)
        return (self.cls(self.bert.encode(input_ids, attention_mask, token_type_ids, layouts)),)

    export_output_names = ("logits",)


# architecture name in config.json -> class
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BigBirdModel": BigBirdModel,
    "BigBirdForQuestionAnswering": BigBirdForQuestionAnswering,
    "BigBirdForSequenceClassification": BigBirdForSequenceClassification,
    "BigBirdForMaskedLM": BigBirdForMaskedLM,
}
