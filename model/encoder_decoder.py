"""BigBird-RoBERTa encoder-decoder (the BigBird paper's base summarizer, Sec. 4 / App. E.5: a
block-sparse encoder and a full-attention decoder, both warm started from one BERT-family
checkpoint, the BERT2BERT recipe of Rothe et al. 2020), weight-compatible key for key with
transformers' `EncoderDecoderModel` holding a `big_bird` encoder and a `bert` decoder
(`is_decoder=True, add_cross_attention=True`).

Read top-down:
  decoder modules (attention with a KV cache, layer) -> BertDecoderConfig, EncoderDecoderConfig
  -> BertDecoder (`decoder.bert`) -> EncoderDecoderModel (`encoder` + `decoder.bert` + `decoder.cls`).

What is reused rather than copied: the encoder is `longdoc.model.bigbird.BigBirdModel` (its length
plan, layouts and block-sparse attention), the decoder's sub-blocks are BigBird's BERT-named
modules (`BigBirdSelfOutput`, `BigBirdIntermediate`, `BigBirdOutput`, the MLM head), and the search
is `longdoc.model.generation.generate` over `encode` / `cross_attention_kv` / `decoder_step`, the
same entry points as `longdoc.model.pegasus` (so `longdoc.export` drives both the same way).

Keys (transformers'): `encoder.embeddings.*`, `encoder.encoder.layer.N.*`, `encoder.pooler.*`
(a BigBirdModel keeps its pooler; unused here), `decoder.bert.embeddings.*`,
`decoder.bert.encoder.layer.N.{attention,crossattention,intermediate,output}.*`,
`decoder.cls.predictions.*`. When the decoder config says `tie_word_embeddings`,
`decoder.cls.predictions.decoder.weight` is the decoder's word embedding and its bias is
`decoder.cls.predictions.bias`; untied, transformers keeps both as separate tensors and the
logits use `decoder.cls.predictions.decoder.{weight,bias}` (`predictions.bias` is then unused).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longdoc.model.activations import check_activation
from longdoc.model.config import GenerationDefaults
from longdoc.model.bigbird import (BigBirdConfig, BigBirdEmbeddings, BigBirdIntermediate, BigBirdModel,
                                   BigBirdOnlyMLMHead, BigBirdOutput, BigBirdSelfOutput, HFConfig, init_weights)
from longdoc.model.pegasus import EncoderOutput, Seq2SeqLM, Seq2SeqLMOutput, shift_tokens_right, teacher_forced

# ----------------------------------------------------------------------------------------------
# decoder modules (names as in transformers' BERT)


class QKV(nn.Module):
    """The query/key/value projections (`attention.self.query.weight`, ...)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)


class DecoderAttention(nn.Module):
    """Full multi-head attention followed by BERT's post-LN output block; causal self-attention
    (the caller keeps the KV cache) or cross-attention over the encoder output."""

    def __init__(self, config: BertDecoderConfig):
        super().__init__()
        self.n_head = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.self = QKV(config.hidden_size)
        self.output = BigBirdSelfOutput(config)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = x.shape
        k = self.self.key(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        v = self.self.value(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        return k, v

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C); k, v: (B, H, S, D); allowed: (B, 1 | T, S) bool, True = may attend
        B, T, C = x.shape
        q = self.self.query(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5  # (B, H, T, S)
        scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
        y = self.dropout(F.softmax(scores, dim=-1)) @ v  # (B, H, T, D)
        return self.output(y.transpose(1, 2).reshape(B, T, C), x)


class DecoderLayer(nn.Module):
    def __init__(self, config: BertDecoderConfig):
        super().__init__()
        self.attention = DecoderAttention(config)
        self.crossattention = DecoderAttention(config)
        self.intermediate = BigBirdIntermediate(config)
        self.output = BigBirdOutput(config)

    def forward(self, x, self_allowed, past_kv, cross_kv, cross_allowed):
        # x: (B, T, C); past_kv: (k, v) each (B, H, P, D) or None; cross_kv: (k, v) each (B, H, S, D)
        k, v = self.attention.project_kv(x)  # (B, H, T, D)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)  # (B, H, P+T, D)
            v = torch.cat([past_kv[1], v], dim=2)
        x = self.attention(x, k, v, self_allowed)
        x = self.crossattention(x, cross_kv[0], cross_kv[1], cross_allowed)
        return self.output(self.intermediate(x), x), (k, v)


# ----------------------------------------------------------------------------------------------
# configs


@dataclass
class BertDecoderConfig(HFConfig):
    """The decoder's `config.json` section (model_type "bert", transformers' defaults)."""

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
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    is_decoder: bool = True
    add_cross_attention: bool = True
    tie_word_embeddings: bool = True
    position_embedding_type: str = "absolute"
    id2label: dict[int, str] | None = None
    architectures: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    model_type = "bert"
    rescale_embeddings = False  # read by BigBirdEmbeddings.__init__; BERT never rescales (not a config key)

    def __post_init__(self):
        if not (self.is_decoder and self.add_cross_attention):
            raise ValueError("the decoder config must say is_decoder=True and add_cross_attention=True")
        check_activation(self.hidden_act)
        if self.position_embedding_type != "absolute":
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} is not supported")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class EncoderDecoderConfig(GenerationDefaults):
    """A `config.json` with model_type "encoder-decoder": the encoder's and the decoder's configs
    nested, the special tokens and generation defaults at the top (transformers reads them there)."""

    encoder: BigBirdConfig
    decoder: BertDecoderConfig
    decoder_start_token_id: int | None = None
    pad_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    tie_encoder_decoder: bool = False

    model_type = "encoder-decoder"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EncoderDecoderConfig:
        d = dict(d)
        if d.pop("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"model_type is not {cls.model_type!r}")
        enc, dec = d.pop("encoder", None), d.pop("decoder", None)
        if not isinstance(enc, dict) or not isinstance(dec, dict):
            raise ValueError("an encoder-decoder config needs 'encoder' and 'decoder' objects")
        if enc.get("model_type") != "big_bird" or dec.get("model_type") != "bert":
            raise ValueError(f"supported: a 'big_bird' encoder and a 'bert' decoder, not "
                             f"{enc.get('model_type')!r} and {dec.get('model_type')!r}")
        encoder, decoder = BigBirdConfig.from_dict(enc), BertDecoderConfig.from_dict(dec)
        if encoder.hidden_size != decoder.hidden_size:  # transformers would add an enc_to_dec_proj
            raise ValueError(f"encoder hidden_size {encoder.hidden_size} != decoder hidden_size {decoder.hidden_size}")
        names = {f.name for f in fields(cls)} - {"encoder", "decoder", "extra"}
        known = {k: d.pop(k) for k in list(d) if k in names}
        cfg = cls(encoder=encoder, decoder=decoder, **known, extra=d)
        if cfg.tie_encoder_decoder:
            raise ValueError("tie_encoder_decoder=True (encoder and decoder sharing weights) is not supported")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("encoder", "decoder", "extra")}
        d = {k: v for k, v in d.items() if v is not None or k in ("pad_token_id", "decoder_start_token_id")}
        d.update(self.extra)
        d.update(encoder=self.encoder.to_dict(), decoder=self.decoder.to_dict(), model_type=self.model_type,
                 is_encoder_decoder=True)
        return d


def attention_spec_from_config(config: EncoderDecoderConfig, plan: str = "hf-train"):
    """The encoder's AttentionSpec (`longdoc.model.bigbird.attention_spec_for`)."""
    from longdoc.model.bigbird import attention_spec_for

    return attention_spec_for(config.encoder, plan)


# ----------------------------------------------------------------------------------------------
# the decoder


class BertDecoderStack(nn.Module):
    """`decoder.bert.encoder`: the layers."""

    def __init__(self, config: BertDecoderConfig):
        super().__init__()
        self.layer = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])


class BertEmbeddings(BigBirdEmbeddings):
    """BigBird's embedding modules in BERT's order: LayerNorm, then dropout (BigBird drops out first)."""

    def forward(self, input_ids, token_type_ids, position_ids):
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)  # (B, T, C)
        return self.dropout(self.LayerNorm(x + self.position_embeddings(position_ids)))


class BertDecoder(nn.Module):
    """`decoder.bert`: BERT embeddings (token type 0) + causal layers with cross-attention."""

    def __init__(self, config: BertDecoderConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertDecoderStack(config)

    def forward(self, input_ids, position_ids, self_attention_mask, cross_kv, encoder_attention_mask, past_kv=None):
        """input_ids, position_ids: (B, T); self_attention_mask: (B, P+T), 1 = attend (causality
        among the T new tokens is added: new token i sees past+current j <= P + i); cross_kv: per
        layer (k, v) each (B, H, S, D); encoder_attention_mask: (B, S); past_kv: per layer (k, v)
        each (B, H, P, D) or None. Returns hidden (B, T, C) and per layer (k, v) (B, H, P+T, D)."""
        from longdoc.model.pegasus import decoder_step_masks

        B, T = input_ids.shape
        P = 0 if past_kv is None else past_kv[0][0].shape[2]
        x = self.embeddings(input_ids, torch.zeros_like(input_ids), position_ids)  # (B, T, C)
        self_allowed, cross_allowed = decoder_step_masks(T, P, self_attention_mask, encoder_attention_mask)
        present = []
        for i, layer in enumerate(self.encoder.layer):
            x, kv = layer(x, self_allowed, None if past_kv is None else past_kv[i], cross_kv[i], cross_allowed)
            present.append(kv)
        return x, present


class BertLMHeadDecoder(nn.Module):
    """`decoder`: transformers' BertLMHeadModel (no pooler)."""

    def __init__(self, config: BertDecoderConfig):
        super().__init__()
        self.bert = BertDecoder(config)
        self.cls = BigBirdOnlyMLMHead(config)


# ----------------------------------------------------------------------------------------------
# the full model


class EncoderDecoderModel(nn.Module):
    # aliases when the decoder config says tie_word_embeddings (transformers unties both otherwise)
    TIED_WEIGHTS = {
        "decoder.cls.predictions.decoder.bias": "decoder.cls.predictions.bias",
        "decoder.cls.predictions.decoder.weight": "decoder.bert.embeddings.word_embeddings.weight",
    }

    def __init__(self, config: EncoderDecoderConfig, attention_spec=None, plan: str = "hf-train"):
        super().__init__()
        self.config = config
        self.encoder = BigBirdModel(config.encoder, plan=plan)
        if attention_spec is not None:
            self.encoder.attention_spec = attention_spec
        self.attention_spec = self.encoder.attention_spec
        self.decoder = BertLMHeadDecoder(config.decoder)
        self.decoder.apply(lambda m: init_weights(m, config.decoder.initializer_range))
        nn.init.zeros_(self.decoder.cls.predictions.bias)
        if config.decoder.tie_word_embeddings:  # (untied, the head keeps its two biases apart too)
            self.decoder.cls.predictions.decoder.weight = self.decoder.bert.embeddings.word_embeddings.weight

    def tied_weights(self) -> dict[str, str]:
        return dict(self.TIED_WEIGHTS) if self.config.decoder.tie_word_embeddings else {}

    # ---- the entry points `longdoc.model.generation` and the exporter's checks drive

    @property
    def max_decoder_positions(self) -> int:
        """The decoder's position table size (generation refuses positions beyond it)."""
        return self.decoder.bert.embeddings.position_embeddings.num_embeddings

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> EncoderOutput:
        """(B, L) -> EncoderOutput(last_hidden_state (B, L, C)); BigBirdModel plans the length."""
        return EncoderOutput(last_hidden_state=self.encoder(input_ids, attention_mask).last_hidden_state)

    def cross_attention_kv(self, encoder_hidden_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per decoder layer (k, v), each (B, H, S, D), computed once per document."""
        return [layer.crossattention.project_kv(encoder_hidden_states) for layer in self.decoder.bert.encoder.layer]

    def decoder_step(self, input_ids, position_ids, self_attention_mask, cross_kv, encoder_attention_mask,
                     past_kv=None):
        """Logits (B, T, V) for T new tokens and the updated cache; arguments as
        `longdoc.model.pegasus.BigBirdPegasusForConditionalGeneration.decoder_step`."""
        h, present = self.decoder.bert(input_ids, position_ids, self_attention_mask, cross_kv,
                                       encoder_attention_mask, past_kv)
        return self.decoder.cls(h), present

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, encoder_outputs: EncoderOutput | None = None) -> Seq2SeqLMOutput:
        """A full (non-cached) pass, as transformers' forward: with labels and no decoder inputs,
        decoder_input_ids = labels shifted right and decoder_attention_mask = (those != pad).
        Loss = mean cross-entropy over labels != -100."""
        cfg = self.config
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("pass decoder_input_ids or labels")
            decoder_input_ids = shift_tokens_right(labels, cfg.pad_token_id, cfg.decoder_start_token_id)
            if decoder_attention_mask is None:
                decoder_attention_mask = (decoder_input_ids != cfg.pad_token_id).long()
        return teacher_forced(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels,
                              encoder_outputs)

    generate = Seq2SeqLM.generate  # the one greedy / beam search driver (longdoc.model.generation)


