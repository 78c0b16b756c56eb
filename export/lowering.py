"""BigBird and BigBird-Pegasus written out as ONNX graphs from a Hugging Face state dict.

Weight names are transformers' (what `longdoc.model.save_pretrained` writes and the public checkpoints
use). The graphs follow transformers' forward passes in eval mode (dropout off):

- BigBird encoder (post-LN), heads: QA (with transformers' question-token masking), sequence
  classification, masked LM.
- BigBird-Pegasus encoder (pre-LN, scaled embeddings, final LayerNorm), which also emits each
  decoder layer's cross-attention keys/values (computed once per document), and a one-step
  decoder graph with a growing self-attention KV cache, explicit position ids and an explicit
  self-attention mask so sequences of different ages can share a batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import TensorProto

from longdoc.export.graph import NEG_INF, GraphBuilder
from longdoc.export.sparse_attention import (AttentionContext, attention_context, block_sparse_attention,
                                             declare_layout_inputs, dense_attention, merge_heads, split_heads)

ENCODER_ARCHITECTURES = {
    "BigBirdForQuestionAnswering": "qa",
    "BigBirdForSequenceClassification": "classify",
    "BigBirdForMaskedLM": "mlm",
    "BigBirdForPreTraining": "mlm",
    "BigBirdModel": None,
}
SEQ2SEQ_ARCHITECTURES = {"BigBirdPegasusForConditionalGeneration": "summarize"}


class Weights:
    """A state dict (name -> np.ndarray) that remembers which names were read."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors = dict(tensors)
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise KeyError(f"checkpoint has no weight {name!r}")
        self.used.add(name)
        return np.asarray(self.tensors[name], dtype=np.float32)

    def get(self, name: str) -> np.ndarray | None:
        return self[name] if name in self.tensors else None

    def first(self, *names: str) -> np.ndarray:
        for name in names:
            if name in self.tensors:
                return self[name]
        raise KeyError(f"checkpoint has none of {', '.join(names)}")


def _embedding(g: GraphBuilder, table: np.ndarray, ids: str, name: str) -> str:
    return g.op("Gather", [g.weight(name, table), ids], axis=0)


def _positions(g: GraphBuilder, input_ids: str) -> str:
    """(S,) int64 0..S-1"""
    seq = g.op("Gather", [g.op("Shape", [input_ids]), g.const(1)], axis=0)
    return g.op("Range", [g.const(0), seq, g.const(1)])


# --- BigBird encoder -----------------------------------------------------------------------

def build_bigbird_encoder(w: Weights, config: dict, task: str, dtype: str, sparse: bool,
                          sep_token_id: int | None = None, int8_attention: str = "off"):
    """input_ids, attention_mask, token_type_ids (B, S) int64 [+ layout inputs] ->
    start_logits/end_logits (B, S) | logits (B, num_labels) | logits (B, S, V).
    int8_attention: export/sparse_attention.py's INT8_ATTENTION."""
    g = GraphBuilder(f"bigbird_{task}_encoder", dtype)
    E, H = config["hidden_size"], config["num_attention_heads"]
    bs, eps, act = config["block_size"], config.get("layer_norm_eps", 1e-12), config.get("hidden_act", "gelu_new")
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    types = g.input("token_type_ids", TensorProto.INT64, ["batch", "sequence"])
    if sparse:
        declare_layout_inputs(g)

    p = "bert."
    x = _embedding(g, w[p + "embeddings.word_embeddings.weight"], ids, "word_embeddings")
    if config.get("rescale_embeddings", False):
        x = g.op("Mul", [x, g.fconst(E ** 0.5)])
    x = g.op("Add", [x, _embedding(g, w[p + "embeddings.token_type_embeddings.weight"], types, "token_types")])
    x = g.op("Add", [x, _embedding(g, w[p + "embeddings.position_embeddings.weight"], _positions(g, ids),
                                   "positions")])  # (B, S, E)
    x = g.layer_norm(x, w[p + "embeddings.LayerNorm.weight"], w[p + "embeddings.LayerNorm.bias"], eps, "emb_ln")

    ctx = attention_context(g, mask, bs, H, E // H, sparse, int8=int8_attention)
    for i in range(config["num_hidden_layers"]):
        g.scope = f"layer{i}/"
        lp = f"{p}encoder.layer.{i}."
        q, k, v = (g.linear(x, w[f"{lp}attention.self.{n}.weight"], w.get(f"{lp}attention.self.{n}.bias"), n)
                   for n in ("query", "key", "value"))
        a = block_sparse_attention(g, q, k, v, i, ctx)  # (B, S, E)
        a = g.linear(a, w[f"{lp}attention.output.dense.weight"], w[f"{lp}attention.output.dense.bias"], "attn_out")
        x = g.layer_norm(g.op("Add", [a, x]), w[f"{lp}attention.output.LayerNorm.weight"],
                         w[f"{lp}attention.output.LayerNorm.bias"], eps, "attn_ln")
        f = g.activation(g.linear(x, w[f"{lp}intermediate.dense.weight"], w[f"{lp}intermediate.dense.bias"], "fc1"),
                         act)
        f = g.linear(f, w[f"{lp}output.dense.weight"], w[f"{lp}output.dense.bias"], "fc2")
        x = g.layer_norm(g.op("Add", [f, x]), w[f"{lp}output.LayerNorm.weight"], w[f"{lp}output.LayerNorm.bias"],
                         eps, "ffn_ln")
    g.scope = "head/"

    if task == "qa":
        hp = "qa_classifier."
        h = g.activation(g.linear(x, w[hp + "intermediate.dense.weight"], w[hp + "intermediate.dense.bias"],
                                  "fc1"), act)
        h = g.linear(h, w[hp + "output.dense.weight"], w[hp + "output.dense.bias"], "fc2")
        h = g.layer_norm(g.op("Add", [h, x]), w[hp + "output.LayerNorm.weight"], w[hp + "output.LayerNorm.bias"],
                         eps, "ln")
        logits = g.to_fp32(g.linear(h, w[hp + "qa_outputs.weight"], w[hp + "qa_outputs.bias"], "qa_outputs"))  # (B,S,2)
        # transformers: tokens up to and including the first [SEP] (the question) get -1e6,
        # except position 0
        is_sep = g.op("Cast", [g.op("Equal", [ids, g.const(sep_token_id)])], to=TensorProto.INT32)
        q_len = g.op("Add", [g.op("ArgMax", [is_sep], axis=1, keepdims=1), g.const(1)])  # (B, 1)
        pos = g.op("Unsqueeze", [_positions(g, ids), g.const([0])])  # (1, S)
        in_question = g.op("And", [g.op("Less", [pos, q_len]), g.op("Greater", [pos, g.const(0)])])
        penalty = g.op("Mul", [g.op("Cast", [in_question], to=TensorProto.FLOAT), g.const(1e6, np.float32)])
        logits = g.op("Sub", [logits, g.op("Unsqueeze", [penalty, g.const([2])])])
        start, end = g.op("Split", [logits, g.const([1, 1])], axis=2, n_out=2)
        g.output(g.op("Squeeze", [start, g.const([2])]), "start_logits", TensorProto.FLOAT, ["batch", "sequence"])
        g.output(g.op("Squeeze", [end, g.const([2])]), "end_logits", TensorProto.FLOAT, ["batch", "sequence"])
    elif task == "classify":
        cls = g.op("Gather", [x, g.const(0)], axis=1)  # (B, E)
        h = g.activation(g.linear(cls, w["classifier.dense.weight"], w["classifier.dense.bias"], "dense"), act)
        logits = g.linear(h, w["classifier.out_proj.weight"], w["classifier.out_proj.bias"], "out_proj")
        g.output(g.to_fp32(logits), "logits", TensorProto.FLOAT, ["batch", "labels"])
    elif task == "mlm":
        hp = "cls.predictions."
        h = g.activation(g.linear(x, w[hp + "transform.dense.weight"], w[hp + "transform.dense.bias"], "dense"), act)
        h = g.layer_norm(h, w[hp + "transform.LayerNorm.weight"], w[hp + "transform.LayerNorm.bias"], eps, "ln")
        decoder = w.first(hp + "decoder.weight", p + "embeddings.word_embeddings.weight")
        bias = w.first(hp + "bias", hp + "decoder.bias")
        if hp + "decoder.bias" in w:
            w.used.add(hp + "decoder.bias")
        g.output(g.to_fp32(g.linear(h, decoder, bias, "decoder")), "logits", TensorProto.FLOAT,
                 ["batch", "sequence", "vocab"])
    elif task == "encode":
        g.output(g.to_fp32(x), "last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", E])
    else:
        raise ValueError(f"task {task!r} is not an encoder task")
    return g.model(f"BigBird {task} encoder, block-sparse={sparse}")


# --- BigBird-Pegasus -----------------------------------------------------------------------

def _pegasus_dims(config: dict) -> dict:
    d = config["d_model"]
    return {"d_model": d, "enc_heads": config["encoder_attention_heads"],
            "dec_heads": config["decoder_attention_heads"], "dec_layers": config["decoder_layers"],
            "scale": d ** 0.5 if config.get("scale_embedding", True) else 1.0,
            "act": config.get("activation_function", "gelu_new")}


def build_pegasus_encoder(w: Weights, config: dict, dtype: str, sparse: bool, int8_attention: str = "off"):
    """input_ids, attention_mask (B, S) [+ layout inputs] -> last_hidden_state (B, S, E) and,
    per decoder layer l, cross_key_l / cross_value_l (B, H, S, D)."""
    dims = _pegasus_dims(config)
    E, H = dims["d_model"], dims["enc_heads"]
    g = GraphBuilder("bigbird_pegasus_encoder", dtype)
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    if sparse:
        declare_layout_inputs(g)
    p = "model.encoder."
    embed = w.first(p + "embed_tokens.weight", "model.shared.weight")
    x = g.op("Mul", [_embedding(g, embed, ids, "embed_tokens"), g.fconst(dims["scale"])])
    x = g.op("Add", [x, _embedding(g, w[p + "embed_positions.weight"], _positions(g, ids), "positions")])
    ctx = attention_context(g, mask, config["block_size"], H, E // H, sparse, int8=int8_attention)
    for i in range(config["encoder_layers"]):
        g.scope = f"enc{i}/"
        lp = f"{p}layers.{i}."
        h = g.layer_norm(x, w[lp + "self_attn_layer_norm.weight"], w[lp + "self_attn_layer_norm.bias"], 1e-5, "ln1")
        q, k, v = (g.linear(h, w[f"{lp}self_attn.self.{n}.weight"], w.get(f"{lp}self_attn.self.{n}.bias"), n)
                   for n in ("query", "key", "value"))
        a = block_sparse_attention(g, q, k, v, i, ctx)
        x = g.op("Add", [x, g.linear(a, w[lp + "self_attn.output.weight"], w.get(lp + "self_attn.output.bias"),
                                     "attn_out")])
        h = g.layer_norm(x, w[lp + "final_layer_norm.weight"], w[lp + "final_layer_norm.bias"], 1e-5, "ln2")
        h = g.activation(g.linear(h, w[lp + "fc1.weight"], w[lp + "fc1.bias"], "fc1"), dims["act"])
        x = g.op("Add", [x, g.linear(h, w[lp + "fc2.weight"], w[lp + "fc2.bias"], "fc2")])
    g.scope = "cross/"
    x = g.layer_norm(x, w[p + "layernorm_embedding.weight"], w[p + "layernorm_embedding.bias"], 1e-5, "final_ln")
    g.output(x, "last_hidden_state", None, ["batch", "sequence", E])
    dctx = AttentionContext(0, dims["dec_heads"], E // dims["dec_heads"], "", None, None, False)
    for i in range(dims["dec_layers"]):
        lp = f"model.decoder.layers.{i}.encoder_attn."
        for kind in ("k", "v"):
            t = g.linear(x, w[f"{lp}{kind}_proj.weight"], w.get(f"{lp}{kind}_proj.bias"), f"{kind}_proj{i}")
            name = f"cross_{'key' if kind == 'k' else 'value'}_{i}"
            g.output(split_heads(g, t, dctx), name, None, ["batch", dims["dec_heads"], "sequence", E // dims["dec_heads"]])
    return g.model("BigBird-Pegasus encoder with cross-attention keys/values")


def build_pegasus_decoder(w: Weights, config: dict, dtype: str):
    """One decoder step for T new tokens per sequence.

    inputs:  input_ids, position_ids (B, T); self_mask (B, P+T) 1 = attend (past and new);
             encoder_mask (B, Se); past_key_l, past_value_l (B, H, P, D);
             cross_key_l, cross_value_l (B, H, Se, D)
    outputs: logits (B, T, V); present_key_l, present_value_l (B, H, P+T, D)
    Causality among the T new tokens is added in the graph (new token t sees past + new <= t).
    """
    dims = _pegasus_dims(config)
    E, H, L = dims["d_model"], dims["dec_heads"], dims["dec_layers"]
    D = E // H
    g = GraphBuilder("bigbird_pegasus_decoder", dtype)
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "new"])
    pos_ids = g.input("position_ids", TensorProto.INT64, ["batch", "new"])
    self_mask = g.input("self_mask", TensorProto.INT64, ["batch", "total"])
    enc_mask = g.input("encoder_mask", TensorProto.INT64, ["batch", "source"])
    for i in range(L):
        g.input(f"past_key_{i}", g.float_type, ["batch", H, "past", D])
        g.input(f"past_value_{i}", g.float_type, ["batch", H, "past", D])
    for i in range(L):
        g.input(f"cross_key_{i}", g.float_type, ["batch", H, "source", D])
        g.input(f"cross_value_{i}", g.float_type, ["batch", H, "source", D])

    p = "model.decoder."
    embed = w.first(p + "embed_tokens.weight", "model.shared.weight")
    x = g.op("Mul", [_embedding(g, embed, ids, "embed_tokens"), g.fconst(dims["scale"])])
    x = g.op("Add", [x, _embedding(g, w[p + "embed_positions.weight"], pos_ids, "positions")])  # (B, T, E)

    # self-attention bias (B, 1, T, P+T): padding/age mask plus causality among new tokens
    new = g.op("Gather", [g.op("Shape", [ids]), g.const(1)], axis=0)
    total = g.op("Gather", [g.op("Shape", [self_mask]), g.const(1)], axis=0)
    past = g.op("Sub", [total, new])
    row = g.op("Unsqueeze", [g.op("Add", [g.op("Range", [g.const(0), new, g.const(1)]), past]), g.const([1])])
    col = g.op("Unsqueeze", [g.op("Range", [g.const(0), total, g.const(1)]), g.const([0])])
    causal = g.op("LessOrEqual", [col, row])  # (T, P+T)
    allowed = g.op("And", [g.op("Unsqueeze", [g.op("Cast", [self_mask], to=TensorProto.BOOL), g.const([1, 2])]),
                           causal])  # (B, 1, T, P+T)
    self_bias = g.op("Where", [allowed, g.fconst(0.0), g.fconst(NEG_INF)])
    enc_bias = g.op("Unsqueeze", [g.op("Mul", [g.op("Sub", [g.fconst(1.0), g.to_float(enc_mask)]),
                                               g.fconst(NEG_INF)]), g.const([1, 2])])  # (B, 1, 1, Se)
    ctx = AttentionContext(0, H, D, "", None, None, False)
    scale = D ** -0.5
    for i in range(L):
        g.scope = f"dec{i}/"
        lp = f"{p}layers.{i}."
        h = g.layer_norm(x, w[lp + "self_attn_layer_norm.weight"], w[lp + "self_attn_layer_norm.bias"], 1e-5, "ln1")
        q, k, v = (split_heads(g, g.linear(h, w[f"{lp}self_attn.{n}_proj.weight"], w.get(f"{lp}self_attn.{n}_proj.bias"),
                                           n), ctx) for n in ("q", "k", "v"))
        k = g.op("Concat", [f"past_key_{i}", k], axis=2)  # (B, H, P+T, D)
        v = g.op("Concat", [f"past_value_{i}", v], axis=2)
        g.output(k, f"present_key_{i}", None, ["batch", H, "total", D])
        g.output(v, f"present_value_{i}", None, ["batch", H, "total", D])
        a = merge_heads(g, dense_attention(g, q, k, v, self_bias, scale), ctx)
        x = g.op("Add", [x, g.linear(a, w[lp + "self_attn.out_proj.weight"], w.get(lp + "self_attn.out_proj.bias"),
                                     "self_out")])
        h = g.layer_norm(x, w[lp + "encoder_attn_layer_norm.weight"], w[lp + "encoder_attn_layer_norm.bias"], 1e-5,
                         "ln2")
        q = split_heads(g, g.linear(h, w[lp + "encoder_attn.q_proj.weight"], w.get(lp + "encoder_attn.q_proj.bias"),
                                    "cross_q"), ctx)
        a = merge_heads(g, dense_attention(g, q, f"cross_key_{i}", f"cross_value_{i}", enc_bias, scale), ctx)
        x = g.op("Add", [x, g.linear(a, w[lp + "encoder_attn.out_proj.weight"],
                                     w.get(lp + "encoder_attn.out_proj.bias"), "cross_out")])
        h = g.layer_norm(x, w[lp + "final_layer_norm.weight"], w[lp + "final_layer_norm.bias"], 1e-5, "ln3")
        h = g.activation(g.linear(h, w[lp + "fc1.weight"], w[lp + "fc1.bias"], "fc1"), dims["act"])
        x = g.op("Add", [x, g.linear(h, w[lp + "fc2.weight"], w[lp + "fc2.bias"], "fc2")])
    g.scope = "lm/"
    x = g.layer_norm(x, w[p + "layernorm_embedding.weight"], w[p + "layernorm_embedding.bias"], 1e-5, "final_ln")
    lm = w.first("lm_head.weight", "model.shared.weight")
    bias = w["final_logits_bias"].reshape(-1) if "final_logits_bias" in w else None
    g.output(g.to_fp32(g.linear(x, lm, bias, "lm_head")), "logits", TensorProto.FLOAT, ["batch", "new", "vocab"])
    return g.model("BigBird-Pegasus decoder step with KV cache")
