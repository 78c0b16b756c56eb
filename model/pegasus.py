"""BigBird-Pegasus encoder-decoder, weight-compatible with transformers'
`BigBirdPegasusForConditionalGeneration` (google/bigbird-pegasus-large-arxiv, -pubmed, -bigpatent).

Read top-down:
  small modules (activation, encoder attention, encoder layer, decoder attention, decoder layer)
  -> BigBirdPegasusConfig -> encoder -> decoder -> BigBirdPegasusModel
  -> BigBirdPegasusForConditionalGeneration (lm_head, final_logits_bias, generate()).

Architecture (what the checkpoints hold):
- Pre-LN transformer layers (LayerNorm -> sublayer -> residual); a final LayerNorm named
  `layernorm_embedding` after the last layer of each stack (the name is historical).
- Learned absolute position embeddings (`embed_positions`, one per stack) added to the token
  embeddings, which are multiplied by sqrt(d_model) when `scale_embedding`.
- With `tie_word_embeddings` (the checkpoints' setting) one token embedding table `model.shared`, used
  by the encoder, the decoder and the LM head; without, four tables (shared, encoder's, decoder's,
  lm_head), as transformers 5 builds them. `state_dict()` holds the same keys as transformers'
  module, tied aliases included (`model.encoder.embed_tokens.weight`, ...); `tied_weights()` says
  which keys are aliases, so a checkpoint that stores only `model.shared.weight` (what transformers
  writes) loads, and `final_logits_bias` may be absent (`OPTIONAL_KEYS`).
- `Seq2SeqLM` (the decoder stack's owner: decoder step, forward, generate) is shared with LED
  (`longdoc.model.led`), whose decoder is this one with post-LN layers.
- Encoder self-attention is block-sparse (BigBird, paper App. D) via `longdoc.model.attention` with a
  layout table from `longdoc.model.layout`, or full attention for short inputs; which one is decided by
  `longdoc.model.lengths.plan_length` before `forward`, never by changing the config.
- Decoder: causal full self-attention with a KV cache, full cross-attention over the encoder output.

Export-friendly entry points (the ONNX export's reference, `longdoc export verify`, calls these):
- `BigBirdPegasusEncoder.forward(input_ids, attention_mask, layouts)`: padded input, per-layer layout
  tensors as inputs (or `layouts=None` for full attention).
- `BigBirdPegasusForConditionalGeneration.cross_attention_kv(encoder_hidden_states)`: per-layer
  cross-attention K/V, computed once per request.
- `BigBirdPegasusForConditionalGeneration.decoder_step(input_ids, position_ids, self_attention_mask,
  cross_kv, encoder_attention_mask, past_kv)`: explicit positions and a mask over past+current
  positions, so sequences of different ages can share a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from longdoc.model.activations import ACTIVATIONS, check_activation
from longdoc.model.config import Seq2SeqConfig

if TYPE_CHECKING:  # longdoc.model.attention is imported when a block-sparse layout is first used
    from longdoc.model.attention import LayoutTensors

# ----------------------------------------------------------------------------------------------
# small modules


def _mask_value(dtype: torch.dtype) -> float:
    # transformers fills masked attention logits with the dtype's most negative value
    return torch.finfo(dtype).min


class EncoderQKV(nn.Module):
    """The query/key/value projections; a separate module only so that parameter names are
    `self_attn.self.query.weight` etc. as in the checkpoints."""

    def __init__(self, d_model: int, bias: bool):
        super().__init__()
        self.query = nn.Linear(d_model, d_model, bias=bias)
        self.key = nn.Linear(d_model, d_model, bias=bias)
        self.value = nn.Linear(d_model, d_model, bias=bias)


class EncoderSelfAttention(nn.Module):
    """Encoder self-attention: block-sparse when given a layout, full otherwise."""

    def __init__(self, d_model: int, n_heads: int, bias: bool, attention_dropout: float):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.attention_dropout = attention_dropout
        self.self = EncoderQKV(d_model, bias)
        self.output = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor, layout: LayoutTensors | None) -> torch.Tensor:
        B, S, C = x.shape
        H, D = self.n_heads, self.head_dim
        q = self.self.query(x).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        k = self.self.key(x).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        v = self.self.value(x).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        if layout is None:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (B, H, S, S)
            scores = scores.masked_fill(~key_mask.bool()[:, None, None, :], _mask_value(scores.dtype))
            probs = F.dropout(F.softmax(scores, dim=-1), self.attention_dropout, self.training)
            y = probs @ v  # (B, H, S, D)
        else:
            from longdoc.model.attention import block_sparse_attention

            # transformers' block-sparse path has no attention dropout
            y = block_sparse_attention(q, k, v, layout, key_mask)  # (B, H, S, D)
        y = y.transpose(1, 2).reshape(B, S, C)  # (B, S, C)
        return self.output(y)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: BigBirdPegasusConfig):
        super().__init__()
        C = cfg.d_model
        self.self_attn = EncoderSelfAttention(C, cfg.encoder_attention_heads, cfg.use_bias, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(C)
        self.fc1 = nn.Linear(C, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, C)
        self.final_layer_norm = nn.LayerNorm(C)
        self.act = ACTIVATIONS[cfg.activation_function]
        self.dropout = cfg.dropout
        self.activation_dropout = cfg.activation_dropout

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor, layout: LayoutTensors | None) -> torch.Tensor:
        h = self.self_attn(self.self_attn_layer_norm(x), key_mask, layout)
        x = x + F.dropout(h, self.dropout, self.training)
        h = F.dropout(self.act(self.fc1(self.final_layer_norm(x))), self.activation_dropout, self.training)
        x = x + F.dropout(self.fc2(h), self.dropout, self.training)
        return x


class DecoderAttention(nn.Module):
    """Full multi-head attention; self-attention (with a KV cache) or cross-attention.

    scale_queries: multiply q by head_dim**-0.5 before q @ k^T (BART / LED, as transformers'
    `LEDDecoderAttention`) instead of the scores after it (Pegasus' eager attention). The two agree
    exactly for power-of-two scales (head_dim 64) and to an ulp otherwise."""

    def __init__(self, d_model: int, n_heads: int, bias: bool, attention_dropout: float, scale_queries: bool = False):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.attention_dropout = attention_dropout
        self.scale_queries = scale_queries
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = x.shape
        k = self.k_proj(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        v = self.v_proj(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        return k, v

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C); k, v: (B, H, S, D); allowed: (B, 1 | T, S) bool, True = may attend
        B, T, C = x.shape
        scale = self.head_dim**-0.5
        if self.scale_queries:
            q = (self.q_proj(x) * scale).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
            scores = q @ k.transpose(-1, -2)  # (B, H, T, S)
        else:
            q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
            scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
        scores = scores.masked_fill(~allowed[:, None], _mask_value(scores.dtype))
        probs = F.dropout(F.softmax(scores, dim=-1), self.attention_dropout, self.training)
        y = (probs @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out_proj(y)


class DecoderLayer(nn.Module):
    """pre_norm: LayerNorm -> sublayer -> residual (Pegasus); else sublayer -> residual -> LayerNorm
    (BART / LED, which also scale the queries first: `DecoderAttention.scale_queries`)."""

    def __init__(self, cfg: BigBirdPegasusConfig, pre_norm: bool = True):
        super().__init__()
        C, H = cfg.d_model, cfg.decoder_attention_heads
        self.pre_norm = pre_norm
        self.self_attn = DecoderAttention(C, H, cfg.use_bias, cfg.attention_dropout, scale_queries=not pre_norm)
        self.self_attn_layer_norm = nn.LayerNorm(C)
        self.encoder_attn = DecoderAttention(C, H, cfg.use_bias, cfg.attention_dropout, scale_queries=not pre_norm)
        self.encoder_attn_layer_norm = nn.LayerNorm(C)
        self.fc1 = nn.Linear(C, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, C)
        self.final_layer_norm = nn.LayerNorm(C)
        self.act = ACTIVATIONS[cfg.activation_function]
        self.dropout = cfg.dropout
        self.activation_dropout = cfg.activation_dropout

    def forward(self, x, self_allowed, past_kv, cross_kv, cross_allowed):
        # x: (B, T, C); past_kv: (k, v) each (B, H, P, D) or None; cross_kv: (k, v) each (B, H, S, D)
        pre = self.pre_norm
        h = self.self_attn_layer_norm(x) if pre else x
        k, v = self.self_attn.project_kv(h)  # (B, H, T, D)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)  # (B, H, P+T, D)
            v = torch.cat([past_kv[1], v], dim=2)
        x = x + F.dropout(self.self_attn(h, k, v, self_allowed), self.dropout, self.training)
        if not pre:
            x = self.self_attn_layer_norm(x)
        h = self.encoder_attn(self.encoder_attn_layer_norm(x) if pre else x, cross_kv[0], cross_kv[1], cross_allowed)
        x = x + F.dropout(h, self.dropout, self.training)
        if not pre:
            x = self.encoder_attn_layer_norm(x)
        h = F.dropout(self.act(self.fc1(self.final_layer_norm(x) if pre else x)), self.activation_dropout, self.training)
        x = x + F.dropout(self.fc2(h), self.dropout, self.training)
        if not pre:
            x = self.final_layer_norm(x)
        return x, (k, v)


# ----------------------------------------------------------------------------------------------
# config


@dataclass
class BigBirdPegasusConfig(Seq2SeqConfig):
    """The fields of a Hugging Face `config.json` with model_type "bigbird_pegasus" (defaults are
    transformers' defaults); `Seq2SeqConfig` reads and writes it."""

    vocab_size: int = 96103
    max_position_embeddings: int = 4096
    encoder_layers: int = 16
    encoder_ffn_dim: int = 4096
    encoder_attention_heads: int = 16
    decoder_layers: int = 16
    decoder_ffn_dim: int = 4096
    decoder_attention_heads: int = 16
    encoder_layerdrop: float = 0.0
    decoder_layerdrop: float = 0.0
    activation_function: str = "gelu_new"
    d_model: int = 1024
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    init_std: float = 0.02
    scale_embedding: bool = True
    use_bias: bool = False
    attention_type: str = "block_sparse"  # encoder only: "block_sparse" | "original_full"
    block_size: int = 64
    num_random_blocks: int = 3
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    decoder_start_token_id: int = 2

    model_type = "bigbird_pegasus"
    ARCHITECTURE = "BigBirdPegasusForConditionalGeneration"
    # transformers' aliases (attribute_map) for a few fields
    ALIASES = {"hidden_size": "d_model", "num_attention_heads": "encoder_attention_heads",
               "num_hidden_layers": "encoder_layers", "attention_probs_dropout_prob": "attention_dropout"}

    def __post_init__(self):
        if self.attention_type not in ("block_sparse", "original_full"):
            raise ValueError(f"attention_type must be 'block_sparse' or 'original_full', not {self.attention_type!r}")
        check_activation(self.activation_function, "activation_function")


def attention_spec_from_config(cfg: BigBirdPegasusConfig, plan: str = "hf-train"):
    """The encoder's AttentionSpec (`longdoc.model.layout.checkpoint_attention_spec`: BigBird ITC, as the
    checkpoints were trained). The spec is block-sparse even for `original_full` configs: the
    encoder's length plan decides full attention there, and the spec is then unused."""
    from longdoc.model.layout import checkpoint_attention_spec

    return checkpoint_attention_spec({**cfg.to_dict(), "attention_type": "block_sparse"}, plan)


# ----------------------------------------------------------------------------------------------
# encoder and decoder stacks


class ScaledEmbedding(nn.Embedding):
    """Token embedding times sqrt(d_model) when the config says scale_embedding."""

    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None, scale: float):
        super().__init__(vocab_size, d_model, padding_idx)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


class BigBirdPegasusEncoder(nn.Module):
    def __init__(self, cfg: BigBirdPegasusConfig, embed_tokens: ScaledEmbedding):
        super().__init__()
        self.embed_tokens = embed_tokens  # model.shared itself when the embeddings are tied
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.d_model)
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.layernorm_embedding = nn.LayerNorm(cfg.d_model)
        self.dropout = cfg.dropout
        self.layerdrop = cfg.encoder_layerdrop

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                layouts: list[LayoutTensors] | None = None) -> torch.Tensor:
        """input_ids, attention_mask: (B, S), 1 = real token. With `layouts` (one per layer) S must be
        a multiple of block_size (pad with pad_token_id / mask 0); without, attention is full.
        Returns the last hidden state (B, S, C), padding positions included."""
        B, S = input_ids.shape
        # Block padding beyond max_position_embeddings reuses the last position: those positions are
        # masked keys whose outputs are cut off, so their embedding never reaches a real token
        # (`encode` refuses real tokens beyond the table).
        positions = torch.arange(S, device=input_ids.device).clamp(max=self.embed_positions.num_embeddings - 1)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)  # (B, S, C)
        x = F.dropout(x, self.dropout, self.training)
        key_mask = attention_mask.to(torch.long)
        for i, layer in enumerate(self.layers):
            if self.training and self.layerdrop > 0.0 and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x, key_mask, None if layouts is None else layouts[i])
        return self.layernorm_embedding(x)


def decoder_step_masks(T: int, P: int, self_attention_mask: torch.Tensor, encoder_attention_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The boolean masks of one cached decoder step over T new tokens after P past ones (True = may
    attend), shared by every decoder here (Pegasus, `longdoc.model.encoder_decoder`):
    self (B, T, P+T) = self_attention_mask (B, P+T) and causality (new token i sees j <= P + i);
    cross (B, 1, S) = encoder_attention_mask (B, S)."""
    device = self_attention_mask.device
    key_pos = torch.arange(P + T, device=device)  # (P+T,)
    query_pos = P + torch.arange(T, device=device)  # (T,)
    causal = key_pos[None, :] <= query_pos[:, None]  # (T, P+T)
    self_allowed = causal[None] & self_attention_mask.bool()[:, None, :]  # (B, T, P+T)
    return self_allowed, encoder_attention_mask.bool()[:, None, :]  # (B, 1, S)


class BigBirdPegasusDecoder(nn.Module):
    """Token + learned position embeddings -> decoder layers, with `layernorm_embedding` after the
    last layer (Pegasus, pre_norm) or right after the embeddings (BART / LED, post-LN layers).
    LED builds this same stack with pre_norm=False and its own position-table size."""

    def __init__(self, cfg: BigBirdPegasusConfig, embed_tokens: ScaledEmbedding, max_positions: int | None = None,
                 pre_norm: bool = True):
        super().__init__()
        self.embed_tokens = embed_tokens  # model.shared itself when the embeddings are tied
        self.embed_positions = nn.Embedding(max_positions or cfg.max_position_embeddings, cfg.d_model)
        self.layers = nn.ModuleList([DecoderLayer(cfg, pre_norm) for _ in range(cfg.decoder_layers)])
        self.layernorm_embedding = nn.LayerNorm(cfg.d_model)
        self.pre_norm = pre_norm
        self.dropout = cfg.dropout
        self.layerdrop = cfg.decoder_layerdrop

    def cross_attention_kv(self, encoder_hidden_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v), each (B, H, S, D): the cross-attention keys/values, computed once."""
        return [layer.encoder_attn.project_kv(encoder_hidden_states) for layer in self.layers]

    def forward(self, input_ids, position_ids, self_attention_mask, cross_kv, encoder_attention_mask,
                past_kv=None):
        """One decoder pass over T new tokens.

        input_ids, position_ids: (B, T); self_attention_mask: (B, P+T), 1 = that past/current position
        may be attended (a causal rule is added for the T current positions: current token i sees
        past+current positions j <= P + i); cross_kv: per layer (k, v) each (B, H, S, D);
        encoder_attention_mask: (B, S), 1 = real encoder token; past_kv: per layer (k, v) each
        (B, H, P, D) or None (P = 0). Returns hidden (B, T, C) and per layer the present (k, v)
        each (B, H, P+T, D).
        """
        B, T = input_ids.shape
        P = 0 if past_kv is None else past_kv[0][0].shape[2]
        x = self.embed_tokens(input_ids) + self.embed_positions(position_ids)  # (B, T, C)
        if not self.pre_norm:
            x = self.layernorm_embedding(x)
        x = F.dropout(x, self.dropout, self.training)
        self_allowed, cross_allowed = decoder_step_masks(T, P, self_attention_mask, encoder_attention_mask)
        present = []
        for i, layer in enumerate(self.layers):
            if self.training and self.layerdrop > 0.0 and torch.rand([]) < self.layerdrop:
                present.append(None if past_kv is None else past_kv[i])
                continue
            x, kv = layer(x, self_allowed, None if past_kv is None else past_kv[i], cross_kv[i], cross_allowed)
            present.append(kv)
        return (self.layernorm_embedding(x) if self.pre_norm else x), present


def token_embeddings(cfg, scale: float) -> tuple[ScaledEmbedding, ScaledEmbedding, ScaledEmbedding]:
    """(shared, encoder's, decoder's) token embeddings: one module under three names when
    `tie_word_embeddings`, else three tables, as transformers 5 builds them (the checkpoint then
    holds `shared`, `encoder.embed_tokens` and `decoder.embed_tokens` separately, and the stacks
    use their own)."""
    def table():
        return ScaledEmbedding(cfg.vocab_size, cfg.d_model, cfg.pad_token_id, scale)

    shared = table()
    if cfg.tie_word_embeddings:
        return shared, shared, shared
    return shared, table(), table()


class BigBirdPegasusModel(nn.Module):
    def __init__(self, cfg: BigBirdPegasusConfig):
        super().__init__()
        scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.shared, encoder_tokens, decoder_tokens = token_embeddings(cfg, scale)
        self.encoder = BigBirdPegasusEncoder(cfg, encoder_tokens)
        self.decoder = BigBirdPegasusDecoder(cfg, decoder_tokens)


# ----------------------------------------------------------------------------------------------
# the full model


@dataclass
class EncoderOutput:
    last_hidden_state: torch.Tensor  # (B, L, C)


@dataclass
class Seq2SeqLMOutput:
    logits: torch.Tensor  # (B, T, V)
    loss: torch.Tensor | None = None
    encoder_last_hidden_state: torch.Tensor | None = None  # (B, L, C)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher forcing: decoder input = [start] + labels[:-1]; label -100 (ignored) becomes pad."""
    shifted = torch.full_like(labels, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_token_id)


def teacher_forced(model, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels,
                   encoder_outputs, **encoder_inputs) -> Seq2SeqLMOutput:
    """The full (non-cached) pass of an encoder-decoder once its decoder inputs are decided (each
    model's `forward` decides them as its transformers class does): encode unless given, every
    decoder position at once through `model.decoder_step`, loss = mean cross-entropy over labels
    != -100. Shared by `Seq2SeqLM` (Pegasus, LED) and longdoc.model.encoder_decoder."""
    if encoder_outputs is None:
        encoder_outputs = model.encode(input_ids, attention_mask, **encoder_inputs)
    enc = encoder_outputs.last_hidden_state
    B, T = decoder_input_ids.shape
    if T > model.max_decoder_positions:
        raise ValueError(f"{T} decoder tokens exceed the decoder's position table ({model.max_decoder_positions})")
    if decoder_attention_mask is None:
        decoder_attention_mask = torch.ones_like(decoder_input_ids)
    positions = torch.arange(T, device=decoder_input_ids.device).expand(B, T)
    logits, _ = model.decoder_step(decoder_input_ids, positions, decoder_attention_mask,
                                   model.cross_attention_kv(enc), attention_mask)
    loss = None
    if labels is not None:
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    return Seq2SeqLMOutput(logits=logits, loss=loss, encoder_last_hidden_state=enc)


class Seq2SeqLM(nn.Module):
    """What BigBird-Pegasus and LED (longdoc.model.led) share around their own encoders: the
    decoder stack `backbone.decoder`, `lm_head` + `final_logits_bias`, the cached decoder step,
    the teacher-forced forward and generate(). A subclass sets `backbone` (the module under the
    checkpoint's prefix: `model` here, `led` in LED), `PREFIX`, and `encode(input_ids,
    attention_mask, **encoder_inputs) -> EncoderOutput`."""

    PREFIX = "model"
    # keys a checkpoint may lack (transformers also tolerates a missing bias; it is zeros)
    OPTIONAL_KEYS = ("final_logits_bias",)
    config: Any

    @property
    def backbone(self) -> nn.Module:
        return getattr(self, self.PREFIX)

    def _init_lm_head(self, config) -> None:
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.shared.weight
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))

    def _init_weights(self, m: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()

    def tied_weights(self) -> dict[str, str]:
        """state_dict key -> the key it is an alias of (the same tensor): with
        `tie_word_embeddings` the encoder's, the decoder's and the LM head's weights are
        `{PREFIX}.shared.weight`; without, there are no aliases (transformers 5 unties all four)."""
        if not self.config.tie_word_embeddings:
            return {}
        shared = f"{self.PREFIX}.shared.weight"
        return {f"{self.PREFIX}.encoder.embed_tokens.weight": shared,
                f"{self.PREFIX}.decoder.embed_tokens.weight": shared, "lm_head.weight": shared}

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **encoder_inputs) -> EncoderOutput:
        raise NotImplementedError

    @property
    def max_decoder_positions(self) -> int:
        return self.backbone.decoder.embed_positions.num_embeddings

    # ---- decoder

    def cross_attention_kv(self, encoder_hidden_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.backbone.decoder.cross_attention_kv(encoder_hidden_states)

    def decoder_step(self, input_ids, position_ids, self_attention_mask, cross_kv, encoder_attention_mask,
                     past_kv=None):
        """Logits for T new decoder tokens and the updated self-attention cache.

        input_ids, position_ids: (B, T) long; self_attention_mask: (B, P+T), 1 = attend (causal
        within the T new tokens is added); cross_kv: from `cross_attention_kv`, per layer (k, v)
        each (B, H, S, D); encoder_attention_mask: (B, S); past_kv: per layer (k, v) each
        (B, H, P, D), or None when P = 0.
        Returns logits (B, T, V) and present_kv: per layer (k, v) each (B, H, P+T, D).
        """
        h, present = self.backbone.decoder(input_ids, position_ids, self_attention_mask, cross_kv,
                                           encoder_attention_mask, past_kv)
        logits = self.lm_head(h) + self.final_logits_bias  # (B, T, V)
        return logits, present

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, encoder_outputs: EncoderOutput | None = None,
                **encoder_inputs) -> Seq2SeqLMOutput:
        """A full (non-cached) pass, as transformers' forward: decoder_input_ids default to
        labels shifted right, else to input_ids shifted right. Loss = mean cross-entropy over
        labels != -100. encoder_inputs go to `encode` (LED: global_attention_mask)."""
        cfg = self.config
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if decoder_input_ids is None:
            source = labels if labels is not None else input_ids
            decoder_input_ids = shift_tokens_right(source, cfg.pad_token_id, cfg.decoder_start_token_id)
        return teacher_forced(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels,
                              encoder_outputs, **encoder_inputs)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Greedy or beam search; see longdoc.model.generation.generate for the arguments. Returns a
        LongTensor (B, T) that starts with decoder_start_token_id, as transformers does."""
        from longdoc.model.generation import generate

        return generate(self, input_ids, attention_mask, **kwargs)


class BigBirdPegasusForConditionalGeneration(Seq2SeqLM):
    PREFIX = "model"

    def __init__(self, config: BigBirdPegasusConfig, attention_spec=None):
        super().__init__()
        self.config = config
        self.model = BigBirdPegasusModel(config)
        self._init_lm_head(config)
        self.attention_spec = attention_spec if attention_spec is not None else attention_spec_from_config(config)
        self._layout_cache: dict[tuple, list[LayoutTensors]] = {}
        self.apply(self._init_weights)

    # ---- encoder

    def layouts_for(self, padded_len: int) -> list[LayoutTensors]:
        """Per-layer layout tensors for a padded length (cached by spec and length: layouts are
        deterministic in both)."""
        from longdoc.model.attention import layout_tensors
        from longdoc.model.layout import build_layout

        cfg = self.config
        key = (self.attention_spec, padded_len // cfg.block_size)
        if key not in self._layout_cache:
            self._layout_cache[key] = [
                layout_tensors(build_layout(self.attention_spec, key[1], cfg.encoder_attention_heads, layer))
                for layer in range(cfg.encoder_layers)
            ]
        return self._layout_cache[key]

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> EncoderOutput:
        """input_ids, attention_mask: (B, L) -> EncoderOutput(last_hidden_state (B, L, C)).
        Decides full vs block-sparse attention and the block padding from the length (longdoc.model.lengths),
        pads with pad_token_id / mask 0, runs the encoder and cuts the padding off again."""
        from longdoc.model.lengths import plan_length

        cfg = self.config
        B, L = input_ids.shape
        if L > cfg.max_position_embeddings:  # transformers fails on the position lookup
            raise ValueError(f"input length {L} exceeds the encoder's position table (max_position_embeddings "
                             f"{cfg.max_position_embeddings})")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        plan = plan_length(L, cfg.block_size, cfg.num_random_blocks, cfg.attention_type)
        if plan.attention == "full":
            h = self.model.encoder(input_ids, attention_mask, None)
            return EncoderOutput(last_hidden_state=h)
        pad = plan.padded_len - L
        ids = F.pad(input_ids, (0, pad), value=cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        mask = F.pad(attention_mask.to(torch.long), (0, pad), value=0)
        layouts = [lay.to(input_ids.device) for lay in self.layouts_for(plan.padded_len)]
        h = self.model.encoder(ids, mask, layouts)  # (B, padded_len, C)
        return EncoderOutput(last_hidden_state=h[:, :L])
