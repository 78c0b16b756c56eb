"""BERT (Devlin et al. 2019) as transformers' `BertModel`: the plain encoder of the sentence
embedding models (sentence-transformers' all-MiniLM-L6-v2, its MiniLM and BERT kin).

BigBird is BERT with a sparse attention pattern and the same parameters under the same names
(`embeddings.*`, `encoder.layer.N.attention.self.query`, ...), and with `attention_type
"original_full"` BigBird attends densely, exactly as BERT does. So a BERT here is
`longdoc.model.bigbird.BigBirdModel` with full attention fixed, BERT's defaults (exact GELU, no
block size in its config.json) and BERT's pooler (`pooler.dense`, where BigBird's is a bare
Linear). Two differences from transformers' `BertModel` that change nothing: BERT applies
dropout after the embeddings' LayerNorm and BigBird before it (dropout is off in eval), and
padded keys are masked with half the dtype minimum instead of the minimum (both give them
exactly zero weight).

`block_size` is not BERT's: it is the multiple a sequence is padded to (`BERT_BLOCK_SIZE`, 8),
which the export and the batcher round lengths by; padding is masked, so it changes no output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longdoc.model.bigbird import BigBirdConfig, BigBirdModel, init_weights
from longdoc.model.registry import BERT_BLOCK_SIZE


@dataclass
class BertConfig(BigBirdConfig):
    """The fields of a BERT `config.json` that change the computation (BigBird's, less its sparse
    attention); every other key is kept in `extra` and written back unchanged."""

    vocab_size: int = 30522
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    sep_token_id: int = 102  # bert-base-uncased's [SEP]
    attention_type: str = "original_full"
    block_size: int = BERT_BLOCK_SIZE  # padding multiple only (module docstring)

    model_type = "bert"  # class attribute, not a field

    def __post_init__(self):
        if self.attention_type != "original_full":
            raise ValueError(f"BERT attends densely; attention_type {self.attention_type!r} is BigBird's")
        super().__post_init__()


class BertPooler(nn.Module):
    """tanh(dense(first token)): transformers' `BertPooler` (keys `pooler.dense.*`)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden):
        return torch.tanh(self.dense(hidden[:, 0]))  # (B, H)


class BertModel(BigBirdModel):
    """transformers' `BertModel`: embeddings + encoder (+ pooler), keys without a prefix."""

    def __init__(self, config: BertConfig, plan: str = "hf-train", add_pooling_layer: bool = True):
        super().__init__(config, plan, add_pooling_layer=False)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        if self.pooler is not None:
            self.pooler.apply(lambda m: init_weights(m, config.initializer_range))

    def pool(self, hidden):
        return self.pooler(hidden) if self.pooler is not None else None
