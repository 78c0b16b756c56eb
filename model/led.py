"""LED, the Longformer Encoder-Decoder (Beltagy et al. 2020, Sec. 5), weight-compatible with
transformers' `LEDForConditionalGeneration` (allenai/led-base-16384, led-large-16384 and their
fine-tunes), top-down in one file:

    LEDConfig -> encoder layer -> encoder -> LEDModel -> LEDForConditionalGeneration

Submodules carry transformers' names (`led.encoder.layers.0.self_attn.longformer_self_attn.query_global.weight`),
so `state_dict()` keys equal the checkpoint keys one to one. Nothing here is new computation:
- the encoder's self-attention is Longformer's (`longdoc.model.longformer.LongformerSelfAttention`:
  the sliding window of `attention_window` tokens per layer as a `longformer` layout from
  `window_layouts`, the request's global tokens with their own projections), inside BART's
  post-LN layer (attention -> residual -> LayerNorm, fc1 -> act -> fc2 -> residual -> LayerNorm);
- the decoder is BigBird-Pegasus' decoder stack (`longdoc.model.pegasus.BigBirdPegasusDecoder`)
  with post-LN layers, queries scaled before the matmul and `layernorm_embedding` right after the
  embeddings, as BART;
- the LM head, decoder step, forward and generate() are `longdoc.model.pegasus.Seq2SeqLM`'s.

What is LED's own:
- learned positions `LEDLearnedPositionalEmbedding`: position i is row i (no offset of 2, unlike
  BART), separate tables for the encoder (max_encoder_position_embeddings, 16384) and the
  decoder (max_decoder_position_embeddings, 1024);
- `layernorm_embedding` on the embeddings of both stacks; token embeddings are not scaled (LED
  has no scale_embedding);
- sequences are padded to a multiple of every layer's window (transformers pads to the largest
  attention_window; padded keys never count, so the real tokens' outputs are the same).

Global attention: `forward` and `encode` take `global_attention_mask` as transformers does (none
by default); `generate` defaults to the first token global, LED's summarization recipe
(allenai's notebooks and the model cards: `global_attention_mask[:, 0] = 1`). Pass
`global_attention_mask` explicitly to compare with transformers' `generate`.

Not implemented: attention dropout in the encoder (the block-sparse attention has none), the
classification / QA heads, `inputs_embeds`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longdoc.model.attention import GlobalTokens, LayoutTensors, global_tokens
from longdoc.model.layout import AttentionSpec, longformer_attention_specs
from longdoc.model.longformer import LongformerSelfAttention, padded_length, window_layouts
from longdoc.model.activations import ACTIVATIONS, check_activation
from longdoc.model.config import Seq2SeqConfig
from longdoc.model.pegasus import (
    BigBirdPegasusDecoder,
    EncoderOutput,
    Seq2SeqLM,
    token_embeddings,
)

# ----------------------------------------------------------------------------------------------
# config


@dataclass
class LEDConfig(Seq2SeqConfig):
    """The fields of a Hugging Face `config.json` with model_type "led" (defaults are transformers'
    `LEDConfig` defaults, led-large's shape). Keys we do not model are kept in `extra` and written
    back by `to_dict`, so a round trip loses nothing."""

    vocab_size: int = 50265
    max_encoder_position_embeddings: int = 16384
    max_decoder_position_embeddings: int = 1024
    encoder_layers: int = 12
    encoder_ffn_dim: int = 4096
    encoder_attention_heads: int = 16
    decoder_layers: int = 12
    decoder_ffn_dim: int = 4096
    decoder_attention_heads: int = 16
    encoder_layerdrop: float = 0.0
    decoder_layerdrop: float = 0.0
    activation_function: str = "gelu"
    d_model: int = 1024
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    init_std: float = 0.02
    attention_window: int | list[int] = 512  # one value, or one per encoder layer; even
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int = 2

    model_type = "led"
    ARCHITECTURE = "LEDForConditionalGeneration"
    # transformers' attribute_map
    ALIASES = {"num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model",
               "attention_probs_dropout_prob": "attention_dropout", "initializer_range": "init_std",
               "num_hidden_layers": "encoder_layers"}

    def __post_init__(self):
        check_activation(self.activation_function, "activation_function")
        if self.d_model % self.encoder_attention_heads or self.d_model % self.decoder_attention_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of the attention heads")
        longformer_attention_specs(self._window_config())  # a bad attention_window fails here, by name

    # the names LongformerSelfAttention and the decoder layers read
    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_attention_heads(self) -> int:
        return self.encoder_attention_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def use_bias(self) -> bool:  # BART's linear layers all have biases
        return True

    @property
    def attention_specs(self) -> tuple[AttentionSpec, ...]:
        """One `longformer` layout spec per encoder layer (`longdoc.model.layout.longformer_attention_specs`)."""
        return longformer_attention_specs(self._window_config())

    def _window_config(self) -> dict[str, Any]:
        return {"num_hidden_layers": self.encoder_layers, "attention_window": self.attention_window}


# ----------------------------------------------------------------------------------------------
# encoder (names as in transformers)


class LEDEncoderAttention(nn.Module):
    def __init__(self, config: LEDConfig):
        super().__init__()
        self.longformer_self_attn = LongformerSelfAttention(config)
        self.output = nn.Linear(config.d_model, config.d_model)

    def forward(self, x, key_mask, layout: LayoutTensors, globals_: GlobalTokens | None):
        return self.output(self.longformer_self_attn(x, key_mask, layout, globals_))  # (B, S, C)


class LEDEncoderLayer(nn.Module):
    """BART's post-LN layer around Longformer's attention."""

    def __init__(self, config: LEDConfig):
        super().__init__()
        C = config.d_model
        self.self_attn = LEDEncoderAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(C)
        self.fc1 = nn.Linear(C, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, C)
        self.final_layer_norm = nn.LayerNorm(C)
        self.act = ACTIVATIONS[config.activation_function]
        self.dropout = config.dropout
        self.activation_dropout = config.activation_dropout

    def forward(self, x, key_mask, layout: LayoutTensors, globals_: GlobalTokens | None):
        h = self.self_attn(x, key_mask, layout, globals_)
        x = self.self_attn_layer_norm(x + F.dropout(h, self.dropout, self.training))
        h = F.dropout(self.act(self.fc1(x)), self.activation_dropout, self.training)
        return self.final_layer_norm(x + F.dropout(self.fc2(h), self.dropout, self.training))  # (B, S, C)


class LEDEncoder(nn.Module):
    def __init__(self, config: LEDConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens  # led.shared itself when the embeddings are tied
        self.embed_positions = nn.Embedding(config.max_encoder_position_embeddings, config.d_model)
        self.layers = nn.ModuleList([LEDEncoderLayer(config) for _ in range(config.encoder_layers)])
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.dropout = config.dropout
        self.layerdrop = config.encoder_layerdrop

    def forward(self, input_ids, attention_mask, global_attention_mask, layouts: list[LayoutTensors]):
        """input_ids, attention_mask, global_attention_mask: (B, P), P a multiple of every layer's
        window block (pad with pad_token_id / mask 0). Returns the hidden states (B, P, C)."""
        B, P = input_ids.shape
        # padding beyond the table reuses its last row: masked keys whose outputs are cut off
        positions = torch.arange(P, device=input_ids.device).clamp(max=self.embed_positions.num_embeddings - 1)
        x = self.layernorm_embedding(self.embed_tokens(input_ids) + self.embed_positions(positions))  # (B, P, C)
        x = F.dropout(x, self.dropout, self.training)
        key_mask = attention_mask.to(x.dtype)  # (B, P)
        globals_ = global_tokens(global_attention_mask, attention_mask)
        for layer, layout in zip(self.layers, layouts):
            if self.training and self.layerdrop > 0.0 and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x, key_mask, layout, globals_)
        return x


class LEDModel(nn.Module):
    def __init__(self, config: LEDConfig):
        super().__init__()
        self.shared, encoder_tokens, decoder_tokens = token_embeddings(config, scale=1.0)
        self.encoder = LEDEncoder(config, encoder_tokens)
        self.decoder = BigBirdPegasusDecoder(config, decoder_tokens, max_positions=config.max_decoder_position_embeddings,
                                             pre_norm=False)


# ----------------------------------------------------------------------------------------------
# the full model


class LEDForConditionalGeneration(Seq2SeqLM):
    PREFIX = "led"

    def __init__(self, config: LEDConfig):
        super().__init__()
        self.config = config
        self.attention_specs = config.attention_specs
        self.led = LEDModel(config)
        self._init_lm_head(config)
        self._layout_cache: dict[tuple[int, str], list[LayoutTensors]] = {}
        self.apply(self._init_weights)

    def layouts(self, padded_len: int, device: torch.device | str = "cpu") -> list[LayoutTensors]:
        return window_layouts(self.attention_specs, padded_len, self.config.encoder_attention_heads, device,
                              self._layout_cache)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               global_attention_mask: torch.Tensor | None = None) -> EncoderOutput:
        """input_ids, attention_mask, global_attention_mask (1 = global token; none by default, as
        transformers): (B, S) -> EncoderOutput(last_hidden_state (B, S, C)). Pads to a multiple of
        every layer's window block, runs the encoder, cuts the padding off again."""
        cfg = self.config
        B, S = input_ids.shape
        if S > cfg.max_encoder_position_embeddings:  # transformers fails on the position lookup
            raise ValueError(f"input length {S} exceeds the encoder's position table "
                             f"(max_encoder_position_embeddings {cfg.max_encoder_position_embeddings})")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if global_attention_mask is None:
            global_attention_mask = torch.zeros_like(input_ids)
        P = padded_length(S, self.attention_specs)
        pad = P - S
        ids = F.pad(input_ids, (0, pad), value=cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        mask = F.pad(attention_mask.to(torch.long), (0, pad), value=0)
        glob = F.pad(global_attention_mask.to(torch.long), (0, pad), value=0)
        h = self.led.encoder(ids, mask, glob, self.layouts(P, input_ids.device))  # (B, P, C)
        return EncoderOutput(last_hidden_state=h[:, :S])

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 global_attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """`Seq2SeqLM.generate` with LED's default global attention: the first token."""
        if global_attention_mask is None:
            global_attention_mask = first_token_global(input_ids)
        return super().generate(input_ids, attention_mask, global_attention_mask=global_attention_mask, **kwargs)


def first_token_global(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) long, 1 on the first token: LED's global attention for summarization."""
    mask = torch.zeros_like(input_ids)
    mask[:, 0] = 1
    return mask
