"""Parity of longdoc.model.bert with transformers' BertModel (the encoder of sentence-transformers'
MiniLM and BERT models) on tiny random-init checkpoints written by transformers: hidden states and
pooler output at lengths that are multiples of nothing, one token, and the whole position table,
with padded batches; fp32 max abs difference <= 1e-5 on every real position."""

from __future__ import annotations

import pytest
import torch

from longdoc.model.bert import BertConfig, BertModel
from longdoc.model.checkpoint import load_pretrained
from tests.model.conftest import hf_checkpoints

TOL = 1e-5
VOCAB = 120
PAD = 0


def tiny_config(**overrides):
    from transformers import BertConfig as HFBertConfig

    cfg = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
               max_position_embeddings=64, pad_token_id=PAD, initializer_range=0.2, attn_implementation="eager")
    cfg.update(overrides)
    return HFBertConfig(**cfg)


@pytest.fixture
def hf_bert(tmp_path):
    return hf_checkpoints(tmp_path, tiny_config, 0.1)


@pytest.mark.parametrize("length", [1, 7, 37, 64])
@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_bert_model_matches_transformers(hf_bert, length, act):
    directory, reference = hf_bert("BertModel", hidden_act=act)
    ours = load_pretrained(directory)
    assert isinstance(ours, BertModel)
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, VOCAB, (3, length), generator=g)
    mask = torch.ones_like(ids)
    for b, real in ((1, max(1, 2 * length // 3)), (2, max(1, length // 3))):
        mask[b, real:] = 0
        ids[b, real:] = PAD
    types = torch.randint(0, 2, ids.shape, generator=g)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask, token_type_ids=types)
        got = ours(ids, mask, types)
    real = mask.bool()
    assert (got.last_hidden_state - want.last_hidden_state)[real].abs().max() <= TOL
    assert (got.pooler_output - want.pooler_output).abs().max() <= TOL


def test_bert_keys_are_transformers(hf_bert):
    """every key of transformers' BertModel file is loaded by name, pooler.dense included"""
    directory, reference = hf_bert("BertModel")
    ours = load_pretrained(directory)
    theirs = {k for k in reference.state_dict() if not k.endswith("position_ids")}
    assert set(ours.state_dict()) == theirs


def test_bert_refuses_sparse_attention():
    with pytest.raises(ValueError, match="densely"):
        BertConfig.from_dict({"model_type": "bert", "attention_type": "block_sparse"})
