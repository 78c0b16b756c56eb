"""BigBird, Longformer, BigBird-Pegasus, LED and ModernBERT written out as ONNX graphs from a Hugging Face state dict.

Weight names are transformers' (what `longdoc.model.save_pretrained` writes and the public checkpoints
use). The graphs follow transformers' forward passes in eval mode (dropout off):

- BigBird encoder (post-LN), heads: QA (with transformers' question-token masking), sequence
  classification, masked LM.
- Longformer encoder (post-LN, RoBERTa positions; the per-layer rest is BigBird's,
  `_post_ln_layer_rest`), heads: QA, sequence classification; the window and the request's
  global tokens (`global_attention_mask` input) in export/sparse_attention.py; or, as a benchmark
  baseline (`--attention full`), BigBird's dense attention over every token instead.
- BigBird-Pegasus encoder (pre-LN, scaled embeddings, final LayerNorm), which also emits each
  decoder layer's cross-attention keys/values (computed once per document), and a one-step
  decoder graph with a growing self-attention KV cache, explicit position ids and an explicit
  self-attention mask so sequences of different ages can share a batch.
- BigBird-RoBERTa encoder-decoder (BERT2BERT: transformers' EncoderDecoderModel with a big_bird
  encoder and a bert decoder): the BigBird layer stack (`_bigbird_stack`, shared with the BigBird
  encoder) plus the cross-attention keys/values, and a BERT decoder step with the same inputs and
  outputs as Pegasus' (`_decoder_step_inputs`, `_decoder_step_biases`, `_cached_self_attention`).
- LED (transformers' LEDForConditionalGeneration): Longformer's attention (window + the request's
  global tokens) in BART's post-LN encoder layers with the cross-attention keys/values, and the
  Pegasus decoder step in its post-LN form (`_bart_decoder_step`, pre_norm False).
- ModernBERT (transformers' ModernBertFor*): pre-LN layers with rotary q/k (positions and angles
  computed in the graph, one base per layer type), GeGLU MLP, bias-free norms; "sliding_attention"
  layers run Longformer's band (the window table, no global tokens), "full_attention" layers the
  dense lowering. Heads: QA, sequence classification (cls or mean pooling), masked LM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
from onnx import TensorProto

from longdoc.export.graph import NEG_INF, GraphBuilder
from longdoc.export.manifest import EMBEDDING_POOLING
from longdoc.export.runtime import DecoderGraph
from longdoc.export.sparse_attention import (AttentionContext, attention_context, block_sparse_attention,
                                             declare_layout_inputs, dense_attention, for_layer, gather_tokens,
                                             longformer_context, merge_heads, split_heads)
from longdoc.model.layout import (checkpoint_attention_spec, longformer_block_size, longformer_layer_specs,
                                  modernbert_layer_specs)
from longdoc.model.registry import led_window_config

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

def _post_ln_layer_rest(g: GraphBuilder, w: Weights, lp: str, a: str, x: str, eps: float, act: str) -> str:
    """A BERT-style post-LN layer after its self-attention (BigBird and Longformer alike):
    attention output dense -> LayerNorm(+ x) -> FFN -> LayerNorm(+ residual). a, x: (B, S, E)."""
    a = g.linear(a, w[f"{lp}attention.output.dense.weight"], w[f"{lp}attention.output.dense.bias"], "attn_out")
    x = g.layer_norm(g.op("Add", [a, x]), w[f"{lp}attention.output.LayerNorm.weight"],
                     w[f"{lp}attention.output.LayerNorm.bias"], eps, "attn_ln")
    f = g.activation(g.linear(x, w[f"{lp}intermediate.dense.weight"], w[f"{lp}intermediate.dense.bias"], "fc1"), act)
    f = g.linear(f, w[f"{lp}output.dense.weight"], w[f"{lp}output.dense.bias"], "fc2")
    return g.layer_norm(g.op("Add", [f, x]), w[f"{lp}output.LayerNorm.weight"], w[f"{lp}output.LayerNorm.bias"],
                        eps, "ffn_ln")


def _bert_embeddings(g: GraphBuilder, w: Weights, config: dict, p: str, ids: str, types: str | None,
                     positions: str) -> str:
    """BERT/BigBird embeddings under prefix p: word (x sqrt(E) when `rescale_embeddings`) + token
    type (`types` None: type 0, transformers' default) + position -> LayerNorm. (B, S, E)"""
    E, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
    x = _embedding(g, w[p + "embeddings.word_embeddings.weight"], ids, "word_embeddings")
    if config.get("rescale_embeddings", False):
        x = g.op("Mul", [x, g.fconst(E ** 0.5)])
    table = w[p + "embeddings.token_type_embeddings.weight"]
    types = (g.weight("token_type_0", table[0]) if types is None  # (E,), broadcast
             else _embedding(g, table, types, "token_types"))
    x = g.op("Add", [x, types])
    x = g.op("Add", [x, _embedding(g, w[p + "embeddings.position_embeddings.weight"], positions, "positions")])
    return g.layer_norm(x, w[p + "embeddings.LayerNorm.weight"], w[p + "embeddings.LayerNorm.bias"], eps, "emb_ln")


def _bigbird_context(g: GraphBuilder, config: dict, mask: str, num_heads: int, head_dim: int, sparse: bool,
                     int8_attention: str, sparse_gather: str) -> AttentionContext:
    """BigBird's attention (BigBird, BigBird-Pegasus, the BERT2BERT encoder): its block size and, for
    `sparse_gather` "window" (SPARSE_GATHER), the window the layout spec gives every row."""
    return attention_context(g, mask, config["block_size"], num_heads, head_dim, sparse, int8=int8_attention,
                             gather=sparse_gather, window_blocks=checkpoint_attention_spec(config).window_blocks)


def pool_tokens(g: GraphBuilder, x: str, mask: str, pooling: str) -> str:
    """sentence-transformers' Pooling of the last hidden states x (B, S, E) over the real tokens of
    mask (B, S): "mean" (summed in fp32, divided by the real tokens' count) or "cls" (the first
    token). (B, E) in the graph's dtype."""
    if pooling == "cls":
        return g.op("Gather", [x, g.const(0)], axis=1)  # (B, E)
    if pooling != "mean":
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(EMBEDDING_POOLING)}")
    real = g.op("Unsqueeze", [g.op("Cast", [mask], to=TensorProto.FLOAT), g.const([2])])  # (B, S, 1)
    total = g.op("ReduceSum", [g.op("Mul", [g.to_fp32(x), real]), g.const([1])], keepdims=0)  # (B, E)
    pooled = g.op("Div", [total, g.op("ReduceSum", [real, g.const([1])], keepdims=0)])  # / (B, 1)
    return pooled if g.dtype == "fp32" else g.to_float(pooled)


def encoder_prefix(w: Weights, prefix: str, first_key: str) -> str:
    """The encoder's key prefix in this checkpoint: `prefix` in a task model's file ("bert.",
    "model."), none in a bare encoder's (transformers' BertModel / BigBirdModel / ModernBertModel)."""
    return prefix if prefix + first_key in w else ""


def _bigbird_stack(g: GraphBuilder, w: Weights, config: dict, p: str, x: str, mask: str, sparse: bool,
                   int8_attention: str = "off", sparse_gather: str = "gather") -> str:
    """The BigBird encoder layers under prefix p (`{p}encoder.layer.N.`), block-sparse over the
    layout inputs or full: (B, S, E) -> (B, S, E). BigBirdFor* (p "bert.") and the BERT2BERT
    encoder (p "encoder.") both run this. int8_attention: export/sparse_attention.py's INT8_ATTENTION;
    sparse_gather: export/manifest.py's SPARSE_GATHER."""
    E, H = config["hidden_size"], config["num_attention_heads"]
    eps, act = config.get("layer_norm_eps", 1e-12), config.get("hidden_act", "gelu_new")
    ctx = _bigbird_context(g, config, mask, H, E // H, sparse, int8_attention, sparse_gather)
    for i in range(config["num_hidden_layers"]):
        g.scope = f"layer{i}/"
        lp = f"{p}encoder.layer.{i}."
        q, k, v = (g.linear(x, w[f"{lp}attention.self.{n}.weight"], w.get(f"{lp}attention.self.{n}.bias"), n)
                   for n in ("query", "key", "value"))
        a = block_sparse_attention(g, q, k, v, i, ctx)  # (B, S, E)
        x = _post_ln_layer_rest(g, w, lp, a, x, eps, act)
    return x


def build_bigbird_encoder(w: Weights, config: dict, task: str, dtype: str, sparse: bool,
                          sep_token_id: int | None = None, int8_attention: str = "off", pooling: str = "mean",
                          sparse_gather: str = "gather"):
    """input_ids, attention_mask, token_type_ids (B, S) int64 [+ layout inputs] ->
    start_logits/end_logits (B, S) | logits (B, num_labels) | logits (B, S, V) | embedding (B, E).
    int8_attention: export/sparse_attention.py's INT8_ATTENTION; pooling: the embedding's
    (`pool_tokens`); sparse_gather: SPARSE_GATHER. BERT (longdoc.model.bert) is this graph with full
    attention."""
    g = GraphBuilder(f"bigbird_{task}_encoder", dtype)
    E = config["hidden_size"]
    eps, act = config.get("layer_norm_eps", 1e-12), config.get("hidden_act", "gelu_new")
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    types = g.input("token_type_ids", TensorProto.INT64, ["batch", "sequence"])
    if sparse:
        declare_layout_inputs(g)

    p = encoder_prefix(w, "bert.", "embeddings.word_embeddings.weight")
    x = _bert_embeddings(g, w, config, p, ids, types, _positions(g, ids))
    x = _bigbird_stack(g, w, config, p, x, mask, sparse, int8_attention, sparse_gather)
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
    elif task == "embed":
        g.output(g.to_fp32(pool_tokens(g, x, mask, pooling)), "embedding", TensorProto.FLOAT, ["batch", E])
    elif task == "encode":
        g.output(g.to_fp32(x), "last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", E])
    else:
        raise ValueError(f"task {task!r} is not an encoder task")
    return g.model(f"BigBird {task} encoder, block-sparse={sparse}")


# --- Longformer encoder ----------------------------------------------------------------------

def _windows(config: dict) -> str:
    """attention_window as the graph's doc string gives it: one number, or one per layer."""
    windows = [2 * spec.band for spec in longformer_layer_specs(config)]
    return str(windows[0]) if len(set(windows)) == 1 else str(windows)


def longformer_positions(g: GraphBuilder, ids: str, pad_token_id: int) -> str:
    """RoBERTa's position ids (longdoc.model.longformer.position_ids_from): (B, S) int64."""
    not_pad = g.op("Cast", [g.op("Not", [g.op("Equal", [ids, g.const(pad_token_id)])])], to=TensorProto.INT64)
    return g.op("Add", [g.op("Mul", [g.op("CumSum", [not_pad, g.const(1)]), not_pad]), g.const(pad_token_id)])


LONGFORMER_ATTENTION = ("sparse", "full")  # `longdoc export --attention`


def build_longformer_encoder(w: Weights, config: dict, task: str, dtype: str, attention: str = "sparse"):
    """input_ids, attention_mask, global_attention_mask (B, S) int64 (S a multiple of w) + the window
    table (layout_key_blocks, layout_valid) -> start_logits/end_logits (B, S) | logits (B, num_labels).
    Token types are transformers' default, all 0 (RoBERTa checkpoints have one type).

    attention "full": a benchmark baseline (what a plain ONNX export of Longformer runs), not the
    checkpoint's computation: every token attends to every real token with the layer's ordinary
    query/key/value (BigBird's dense lowering), no window, no global projections; inputs
    input_ids and attention_mask only. Equal to Longformer only when its window covers the input."""
    if attention not in LONGFORMER_ATTENTION:
        raise ValueError(f"attention {attention!r} is not one of {', '.join(LONGFORMER_ATTENTION)}")
    full = attention == "full"
    g = GraphBuilder(f"longformer_{task}_encoder", dtype)
    E, H = config["hidden_size"], config["num_attention_heads"]
    eps, act = config.get("layer_norm_eps", 1e-12), config.get("hidden_act", "gelu")
    bs = longformer_block_size(config)
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    if not full:
        global_mask = g.input("global_attention_mask", TensorProto.INT64, ["batch", "sequence"])
        declare_layout_inputs(g, layout_global_rows=False)

    p = "longformer."
    x = _bert_embeddings(g, w, config, p, ids, None, longformer_positions(g, ids, int(config.get("pad_token_id", 1))))

    ctx = (attention_context(g, mask, bs, H, E // H, sparse=False) if full
           else longformer_context(g, mask, global_mask, bs, H, E // H))
    specs = longformer_layer_specs(config)
    for i in range(config["num_hidden_layers"]):
        g.scope = f"layer{i}/"
        lp = f"{p}encoder.layer.{i}."
        q, k, v = (g.linear(x, w[f"{lp}attention.self.{n}.weight"], w[f"{lp}attention.self.{n}.bias"], n)
                   for n in ("query", "key", "value"))
        if full:
            a = block_sparse_attention(g, q, k, v, i, ctx)  # (B, S, E), dense over the real keys
        else:
            x_glob = gather_tokens(g, x, ctx.global_tokens.index)  # (B, G, E)
            global_qkv = tuple(g.linear(src, w[f"{lp}attention.self.{n}_global.weight"],
                                        w[f"{lp}attention.self.{n}_global.bias"], f"{n}_global")
                               for src, n in ((x_glob, "query"), (x, "key"), (x, "value")))
            a = block_sparse_attention(g, q, k, v, i, for_layer(ctx, specs[i]), global_qkv)  # (B, S, E)
        x = _post_ln_layer_rest(g, w, lp, a, x, eps, act)
    g.scope = "head/"
    if task == "qa":
        logits = g.to_fp32(g.linear(x, w["qa_outputs.weight"], w["qa_outputs.bias"], "qa_outputs"))  # (B, S, 2)
        start, end = g.op("Split", [logits, g.const([1, 1])], axis=2, n_out=2)
        g.output(g.op("Squeeze", [start, g.const([2])]), "start_logits", TensorProto.FLOAT, ["batch", "sequence"])
        g.output(g.op("Squeeze", [end, g.const([2])]), "end_logits", TensorProto.FLOAT, ["batch", "sequence"])
    elif task == "classify":
        first = g.op("Gather", [x, g.const(0)], axis=1)  # (B, E)
        h = g.op("Tanh", [g.linear(first, w["classifier.dense.weight"], w["classifier.dense.bias"], "dense")])
        logits = g.linear(h, w["classifier.out_proj.weight"], w["classifier.out_proj.bias"], "out_proj")
        g.output(g.to_fp32(logits), "logits", TensorProto.FLOAT, ["batch", "labels"])
    else:
        raise ValueError(f"task {task!r}: a Longformer exports as qa or classify")
    return g.model(f"Longformer {task} encoder, " + ("full attention (benchmark baseline)" if full
                                                     else f"window {_windows(config)}"))


# --- BigBird-Pegasus -----------------------------------------------------------------------

def _pegasus_dims(config: dict) -> dict:
    d = config["d_model"]
    return {"d_model": d, "enc_heads": config["encoder_attention_heads"],
            "dec_heads": config["decoder_attention_heads"], "dec_layers": config["decoder_layers"],
            "scale": d ** 0.5 if config.get("scale_embedding", True) else 1.0,
            "act": config.get("activation_function", "gelu_new")}


def build_pegasus_encoder(w: Weights, config: dict, dtype: str, sparse: bool, int8_attention: str = "off",
                          sparse_gather: str = "gather"):
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
    ctx = _bigbird_context(g, config, mask, H, E // H, sparse, int8_attention, sparse_gather)
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
    lp = "model.decoder.layers.{}.encoder_attn."
    _cross_kv_outputs(g, w, x, [(lp.format(i) + "k_proj", lp.format(i) + "v_proj") for i in range(dims["dec_layers"])],
                      dims["dec_heads"], E // dims["dec_heads"])
    return g.model("BigBird-Pegasus encoder with cross-attention keys/values")


# --- the decoder-step parts every encoder-decoder shares (Pegasus, BERT2BERT) ---------------

def _cross_kv_outputs(g: GraphBuilder, w: Weights, x: str, projections: list[tuple[str, str]], H: int, D: int) -> None:
    """Graph outputs cross_key_l, cross_value_l (B, H, S, D) of each decoder layer l from the
    encoder output x (B, S, E); projections: per layer the (key, value) weight prefixes."""
    ctx = AttentionContext(0, H, D, "", None, None, False)
    for i, prefixes in enumerate(projections):
        for kind, name, wp in zip(("key", "value"), DecoderGraph.layer("cross", i), prefixes):
            t = g.linear(x, w[wp + ".weight"], w.get(wp + ".bias"), f"cross_{kind}_proj{i}")
            g.output(split_heads(g, t, ctx), name, None, ["batch", H, "sequence", D])


def _decoder_step_inputs(g: GraphBuilder, L: int, H: int, D: int) -> tuple[str, str, str, str]:
    """The decoder step's inputs (see `build_pegasus_decoder`): returns input_ids, position_ids
    (B, T), self_mask (B, P+T), encoder_mask (B, Se); declares past_* and cross_* per layer."""
    io = DecoderGraph(L)  # the names the runtime binds by
    ids, pos_ids, self_mask = (g.input(name, TensorProto.INT64, ["batch", dim])
                               for name, dim in zip(io.STEP_INPUTS, ("new", "new", "total")))
    enc_mask = g.input(io.ENCODER_MASK, TensorProto.INT64, ["batch", "source"])
    for name in io.past:
        g.input(name, g.float_type, ["batch", H, "past", D])
    for name in io.cross:
        g.input(name, g.float_type, ["batch", H, "source", D])
    return ids, pos_ids, self_mask, enc_mask


def _decoder_step_biases(g: GraphBuilder, ids: str, self_mask: str, enc_mask: str) -> tuple[str, str]:
    """Additive attention biases of one step (longdoc.model.pegasus.decoder_step_masks in ONNX):
    self (B, 1, T, P+T) = padding/age mask and causality among the new tokens; cross (B, 1, 1, Se)."""
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
    return self_bias, enc_bias


def _cached_self_attention(g: GraphBuilder, i: int, q: str, k: str, v: str, self_bias: str,
                           ctx: AttentionContext) -> str:
    """Layer i's self-attention over past_key_i/past_value_i + the new k, v (each (B, H, T, D),
    q too); outputs present_key_i/present_value_i (B, H, P+T, D). Returns (B, T, E)."""
    H, D = ctx.num_heads, ctx.head_dim
    (past_k, past_v), (present_k, present_v) = DecoderGraph.layer("past", i), DecoderGraph.layer("present", i)
    k = g.op("Concat", [past_k, k], axis=2)  # (B, H, P+T, D)
    v = g.op("Concat", [past_v, v], axis=2)
    g.output(k, present_k, None, ["batch", H, "total", D])
    g.output(v, present_v, None, ["batch", H, "total", D])
    return merge_heads(g, dense_attention(g, q, k, v, self_bias, D ** -0.5), ctx)


def build_pegasus_decoder(w: Weights, config: dict, dtype: str):
    """One decoder step for T new tokens per sequence.

    inputs:  input_ids, position_ids (B, T); self_mask (B, P+T) 1 = attend (past and new);
             encoder_mask (B, Se); past_key_l, past_value_l (B, H, P, D);
             cross_key_l, cross_value_l (B, H, Se, D)
    outputs: logits (B, T, V); present_key_l, present_value_l (B, H, P+T, D)
    Causality among the T new tokens is added in the graph (new token t sees past + new <= t).
    """
    return _bart_decoder_step(w, config, dtype, "model.", pre_norm=True, name="bigbird_pegasus_decoder",
                              doc="BigBird-Pegasus decoder step with KV cache")


def _bart_decoder_step(w: Weights, config: dict, dtype: str, prefix: str, pre_norm: bool, name: str, doc: str):
    """The BART-family decoder step under `prefix` (`build_pegasus_decoder`'s inputs and outputs):
    pre_norm (Pegasus): LayerNorm before each block, `layernorm_embedding` as the final LayerNorm;
    post-LN (LED, BART): `layernorm_embedding` right after the embeddings, LayerNorm after each
    residual add, no final LayerNorm. Queries are scaled before their MatMul (`dense_attention`)."""
    dims = _pegasus_dims(config)
    E, H, L = dims["d_model"], dims["dec_heads"], dims["dec_layers"]
    D = E // H
    g = GraphBuilder(name, dtype)
    ids, pos_ids, self_mask, enc_mask = _decoder_step_inputs(g, L, H, D)

    p = prefix + "decoder."
    embed = w.first(p + "embed_tokens.weight", prefix + "shared.weight")
    x = _embedding(g, embed, ids, "embed_tokens")
    if dims["scale"] != 1.0:
        x = g.op("Mul", [x, g.fconst(dims["scale"])])
    x = g.op("Add", [x, _embedding(g, w[p + "embed_positions.weight"], pos_ids, "positions")])  # (B, T, E)

    def norm(x, ln, scope_name):
        return g.layer_norm(x, w[f"{ln}.weight"], w[f"{ln}.bias"], 1e-5, scope_name)

    if not pre_norm:
        x = norm(x, p + "layernorm_embedding", "emb_ln")
    pre = norm if pre_norm else (lambda x, ln, n: x)
    post = (lambda x, ln, n: x) if pre_norm else norm
    self_bias, enc_bias = _decoder_step_biases(g, ids, self_mask, enc_mask)
    ctx = AttentionContext(0, H, D, "", None, None, False)
    scale = D ** -0.5
    for i in range(L):
        g.scope = f"dec{i}/"
        lp = f"{p}layers.{i}."
        h = pre(x, lp + "self_attn_layer_norm", "ln1")
        q, k, v = (split_heads(g, g.linear(h, w[f"{lp}self_attn.{n}_proj.weight"], w.get(f"{lp}self_attn.{n}_proj.bias"),
                                           n), ctx) for n in ("q", "k", "v"))
        a = _cached_self_attention(g, i, q, k, v, self_bias, ctx)
        x = g.op("Add", [x, g.linear(a, w[lp + "self_attn.out_proj.weight"], w.get(lp + "self_attn.out_proj.bias"),
                                     "self_out")])
        x = post(x, lp + "self_attn_layer_norm", "ln1")
        h = pre(x, lp + "encoder_attn_layer_norm", "ln2")
        q = split_heads(g, g.linear(h, w[lp + "encoder_attn.q_proj.weight"], w.get(lp + "encoder_attn.q_proj.bias"),
                                    "cross_q"), ctx)
        a = merge_heads(g, dense_attention(g, q, *DecoderGraph.layer("cross", i), enc_bias, scale), ctx)
        x = g.op("Add", [x, g.linear(a, w[lp + "encoder_attn.out_proj.weight"],
                                     w.get(lp + "encoder_attn.out_proj.bias"), "cross_out")])
        x = post(x, lp + "encoder_attn_layer_norm", "ln2")
        h = pre(x, lp + "final_layer_norm", "ln3")
        h = g.activation(g.linear(h, w[lp + "fc1.weight"], w[lp + "fc1.bias"], "fc1"), dims["act"])
        x = g.op("Add", [x, g.linear(h, w[lp + "fc2.weight"], w[lp + "fc2.bias"], "fc2")])
        x = post(x, lp + "final_layer_norm", "ln3")
    g.scope = "lm/"
    if pre_norm:
        x = norm(x, p + "layernorm_embedding", "final_ln")
    lm = w.first("lm_head.weight", prefix + "shared.weight")
    bias = w["final_logits_bias"].reshape(-1) if "final_logits_bias" in w else None
    g.output(g.to_fp32(g.linear(x, lm, bias, "lm_head")), DecoderGraph.LOGITS, TensorProto.FLOAT,
             ["batch", "new", "vocab"])
    return g.model(doc)


# --- LED (Longformer Encoder-Decoder, longdoc.model.led) -------------------------------------

def _led_dims(config: dict) -> dict:
    """`_pegasus_dims` for LED: unscaled embeddings (LED has no scale_embedding), exact GELU by default."""
    return {**config, "scale_embedding": False, "activation_function": config.get("activation_function", "gelu")}


def build_led_encoder(w: Weights, config: dict, dtype: str):
    """input_ids, attention_mask, global_attention_mask (B, S) int64 (S a multiple of w) + the window
    table -> last_hidden_state (B, S, E) and per decoder layer l cross_key_l / cross_value_l
    (B, H, S, D). Longformer's attention (band + the request's global tokens) in BART's post-LN
    layer; positions 0..S-1 (LED's table has no offset), unscaled embeddings, `layernorm_embedding`
    after them, no final LayerNorm."""
    enc = led_window_config(config)
    dims = _pegasus_dims(_led_dims(config))
    E, H = dims["d_model"], dims["enc_heads"]
    bs = longformer_block_size(enc)
    g = GraphBuilder("led_encoder", dtype)
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    global_mask = g.input("global_attention_mask", TensorProto.INT64, ["batch", "sequence"])
    declare_layout_inputs(g, layout_global_rows=False)
    p = "led.encoder."
    x = _embedding(g, w.first(p + "embed_tokens.weight", "led.shared.weight"), ids, "embed_tokens")
    x = g.op("Add", [x, _embedding(g, w[p + "embed_positions.weight"], _positions(g, ids), "positions")])
    x = g.layer_norm(x, w[p + "layernorm_embedding.weight"], w[p + "layernorm_embedding.bias"], 1e-5, "emb_ln")
    ctx = longformer_context(g, mask, global_mask, bs, H, E // H)
    specs = longformer_layer_specs(enc)
    for i in range(config["encoder_layers"]):
        g.scope = f"enc{i}/"
        lp = f"{p}layers.{i}."
        ap = lp + "self_attn.longformer_self_attn."
        q, k, v = (g.linear(x, w[f"{ap}{n}.weight"], w[f"{ap}{n}.bias"], n) for n in ("query", "key", "value"))
        x_glob = gather_tokens(g, x, ctx.global_tokens.index)  # (B, G, E)
        global_qkv = tuple(g.linear(src, w[f"{ap}{n}_global.weight"], w[f"{ap}{n}_global.bias"], f"{n}_global")
                           for src, n in ((x_glob, "query"), (x, "key"), (x, "value")))
        a = block_sparse_attention(g, q, k, v, i, for_layer(ctx, specs[i]), global_qkv)  # (B, S, E)
        a = g.linear(a, w[lp + "self_attn.output.weight"], w[lp + "self_attn.output.bias"], "attn_out")
        x = g.layer_norm(g.op("Add", [x, a]), w[lp + "self_attn_layer_norm.weight"], w[lp + "self_attn_layer_norm.bias"],
                         1e-5, "ln1")
        h = g.activation(g.linear(x, w[lp + "fc1.weight"], w[lp + "fc1.bias"], "fc1"), dims["act"])
        x = g.op("Add", [x, g.linear(h, w[lp + "fc2.weight"], w[lp + "fc2.bias"], "fc2")])
        x = g.layer_norm(x, w[lp + "final_layer_norm.weight"], w[lp + "final_layer_norm.bias"], 1e-5, "ln2")
    g.scope = "cross/"
    g.output(x, "last_hidden_state", None, ["batch", "sequence", E])
    lp = "led.decoder.layers.{}.encoder_attn."
    _cross_kv_outputs(g, w, x, [(lp.format(i) + "k_proj", lp.format(i) + "v_proj") for i in range(dims["dec_layers"])],
                      dims["dec_heads"], E // dims["dec_heads"])
    return g.model(f"LED encoder, window {_windows(enc)}, with cross-attention keys/values")


def build_led_decoder(w: Weights, config: dict, dtype: str):
    """LED's decoder step (BART's post-LN decoder under `led.`): inputs and outputs exactly
    `build_pegasus_decoder`'s; unscaled embeddings, `final_logits_bias`."""
    return _bart_decoder_step(w, _led_dims(config), dtype, "led.", pre_norm=False, name="led_decoder",
                              doc="LED decoder step with KV cache")


# --- BigBird-RoBERTa encoder-decoder (BERT2BERT, longdoc.model.encoder_decoder) ------------

def build_b2b_encoder(w: Weights, config: dict, dtype: str, sparse: bool, int8_attention: str = "off",
                      sparse_gather: str = "gather"):
    """The `encoder-decoder` config's BigBird encoder: input_ids, attention_mask (B, S) [+ layout
    inputs] -> last_hidden_state (B, S, E) and per decoder layer l cross_key_l / cross_value_l
    (B, H, S, D), as `build_pegasus_encoder` (token types are 0, transformers' default)."""
    enc, dec = config["encoder"], config["decoder"]
    g = GraphBuilder("bert2bert_encoder", dtype)
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    if sparse:
        declare_layout_inputs(g)
    x = _bert_embeddings(g, w, enc, "encoder.", ids, None, _positions(g, ids))
    x = _bigbird_stack(g, w, enc, "encoder.", x, mask, sparse, int8_attention, sparse_gather)
    g.scope = "cross/"
    g.output(x, "last_hidden_state", None, ["batch", "sequence", enc["hidden_size"]])
    lp = "decoder.bert.encoder.layer.{}.crossattention.self."
    H = dec["num_attention_heads"]
    _cross_kv_outputs(g, w, x, [(lp.format(i) + "key", lp.format(i) + "value") for i in range(dec["num_hidden_layers"])],
                      H, dec["hidden_size"] // H)
    return g.model(f"BigBird-RoBERTa encoder (BERT2BERT), block-sparse={sparse}, with cross-attention keys/values")


def _post_ln_output(g: GraphBuilder, w: Weights, op: str, a: str, x: str, eps: float, name: str) -> str:
    """BERT's output block under prefix op: LayerNorm(dense(a) + x). (B, T, E)"""
    a = g.linear(a, w[op + "dense.weight"], w[op + "dense.bias"], name)
    return g.layer_norm(g.op("Add", [a, x]), w[op + "LayerNorm.weight"], w[op + "LayerNorm.bias"], eps, name + "_ln")


def build_b2b_decoder(w: Weights, config: dict, dtype: str):
    """The `encoder-decoder` config's BERT decoder, one step with a KV cache: inputs and outputs
    exactly `build_pegasus_decoder`'s (the runtime drives both the same way). Post-LN layers:
    causal self-attention, cross-attention, FFN; the MLM head gives the logits."""
    dec = config["decoder"]
    E, H, L = dec["hidden_size"], dec["num_attention_heads"], dec["num_hidden_layers"]
    D, eps, act = E // H, dec.get("layer_norm_eps", 1e-12), dec.get("hidden_act", "gelu")
    g = GraphBuilder("bert2bert_decoder", dtype)
    ids, pos_ids, self_mask, enc_mask = _decoder_step_inputs(g, L, H, D)
    p = "decoder.bert."
    x = _bert_embeddings(g, w, dec, p, ids, None, pos_ids)  # (B, T, E)
    self_bias, enc_bias = _decoder_step_biases(g, ids, self_mask, enc_mask)
    ctx = AttentionContext(0, H, D, "", None, None, False)
    for i in range(L):
        g.scope = f"dec{i}/"
        lp = f"{p}encoder.layer.{i}."
        q, k, v = (split_heads(g, g.linear(x, w[f"{lp}attention.self.{n}.weight"], w[f"{lp}attention.self.{n}.bias"],
                                           n), ctx) for n in ("query", "key", "value"))
        x = _post_ln_output(g, w, f"{lp}attention.output.", _cached_self_attention(g, i, q, k, v, self_bias, ctx), x,
                            eps, "self_out")
        q = split_heads(g, g.linear(x, w[f"{lp}crossattention.self.query.weight"],
                                    w[f"{lp}crossattention.self.query.bias"], "cross_q"), ctx)
        a = merge_heads(g, dense_attention(g, q, *DecoderGraph.layer("cross", i), enc_bias, D ** -0.5), ctx)
        x = _post_ln_output(g, w, f"{lp}crossattention.output.", a, x, eps, "cross_out")
        f = g.activation(g.linear(x, w[f"{lp}intermediate.dense.weight"], w[f"{lp}intermediate.dense.bias"], "fc1"), act)
        x = _post_ln_output(g, w, f"{lp}output.", f, x, eps, "fc2")
    g.scope = "lm/"
    hp = "decoder.cls.predictions."
    h = g.activation(g.linear(x, w[hp + "transform.dense.weight"], w[hp + "transform.dense.bias"], "dense"), act)
    h = g.layer_norm(h, w[hp + "transform.LayerNorm.weight"], w[hp + "transform.LayerNorm.bias"], eps, "ln")
    if dec.get("tie_word_embeddings", True):  # transformers ties the weight to the embedding, the bias to .bias
        weight = w.first(hp + "decoder.weight", p + "embeddings.word_embeddings.weight")
        bias = w.first(hp + "bias", hp + "decoder.bias")
    else:  # untied, transformers' logits use the decoder Linear's own weight and bias
        weight, bias = w[hp + "decoder.weight"], w[hp + "decoder.bias"]
    g.output(g.to_fp32(g.linear(h, weight, bias, "lm_head")), DecoderGraph.LOGITS, TensorProto.FLOAT,
             ["batch", "new", "vocab"])
    return g.model("BigBird-RoBERTa (BERT2BERT) decoder step with KV cache")


# --- ModernBERT (longdoc.model.modernbert) ----------------------------------------------------

def rotary_inv_freq(theta: float, dim: int) -> np.ndarray:
    """transformers' default rotary frequencies theta^(-2i/dim), i < dim/2, in its float32
    arithmetic: torch's pow (NumPy's float32 power differs from it in the last bit for some i, which
    moves the angle at position 8000 by ~5e-4 rad). (dim/2,) float32."""
    import torch  # the export has torch (longdoc[torch]); the graph then computes every angle itself

    return (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).numpy()


def _rotary_tables(g: GraphBuilder, ids: str, inv_freq: np.ndarray) -> tuple[str, str]:
    """cos, sin (S, 1, D) of positions 0..S-1 computed in the graph (one graph for every length):
    angle = position * inv_freq in fp32, each angle twice (rotate-half layout), then the graph dtype."""
    pos = g.op("Cast", [_positions(g, ids)], to=TensorProto.FLOAT)  # (S,)
    freqs = g.op("Mul", [g.op("Unsqueeze", [pos, g.const([1])]), g.const(inv_freq[None, :], np.float32)])  # (S, D/2)
    angles = g.op("Unsqueeze", [g.op("Concat", [freqs, freqs], axis=1), g.const([1])])  # (S, 1, D)
    cos, sin = g.op("Cos", [angles]), g.op("Sin", [angles])
    return (cos, sin) if g.dtype == "fp32" else (g.to_float(cos), g.to_float(sin))


def _apply_rotary(g: GraphBuilder, x: str, cos: str, sin: str, H: int, D: int) -> str:
    """x * cos + rotate_half(x) * sin per head; x (B, S, H*D) -> (B, S, H*D)."""
    heads = g.op("Reshape", [x, g.const([0, 0, H, D])])  # (B, S, H, D)
    x1, x2 = g.op("Split", [heads, g.const([D // 2, D // 2])], axis=3, n_out=2)
    rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=3)
    y = g.op("Add", [g.op("Mul", [heads, cos]), g.op("Mul", [rotated, sin])])
    return g.op("Reshape", [y, g.const([0, 0, H * D])])


def build_modernbert_encoder(w: Weights, config: dict, task: str, dtype: str, int8_attention: str = "off",
                             pooling: str = "mean"):
    """input_ids, attention_mask (B, S) int64 (S a multiple of local_attention / 2) + the band table
    (layout_key_blocks, layout_valid; when a layer slides) -> start_logits/end_logits (B, S) |
    logits (B, num_labels) | logits (B, S, V) | embedding (B, E) (`pool_tokens` of the final norm's
    output, transformers' ModernBertModel's last_hidden_state).

    transformers' ModernBertFor* in eval mode: token embeddings -> norm; per layer (pre-LN, layer 0
    without attn_norm) rotary q/k (the layer type's base), attention, Wo, residual; GeGLU MLP,
    residual; final norm; head (dense -> activation -> norm) and the task's projection. A
    "sliding_attention" layer is Longformer's band without global tokens (`for_layer` over its
    `longformer` spec: 3 blocks of local_attention / 2 tokens under a band of as many), linear in
    the length; a "full_attention" layer attends densely to every real key (BigBird's dense
    lowering, in head groups). Norms without bias get zero biases (LayerNormalization's)."""
    specs = modernbert_layer_specs(config)
    g = GraphBuilder(f"modernbert_{task}_encoder", dtype)
    E, H = config["hidden_size"], config["num_attention_heads"]
    D, bs = E // H, specs[0].block_size
    eps = config.get("norm_eps", 1e-5)
    act, head_act = config.get("hidden_activation", "gelu"), config.get("classifier_activation", "gelu")
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    sliding = any(spec.band for spec in specs)
    if sliding:
        declare_layout_inputs(g, layout_global_rows=False)

    def norm(x: str, name: str, scope_name: str) -> str:
        weight = w[name + ".weight"]
        bias = w.get(name + ".bias")
        return g.layer_norm(x, weight, np.zeros_like(weight) if bias is None else bias, eps, scope_name)

    def linear(x: str, name: str, scope_name: str, rows: slice = slice(None)) -> str:
        bias = w.get(name + ".bias")
        return g.linear(x, w[name + ".weight"][rows], None if bias is None else bias[rows], scope_name)

    p = encoder_prefix(w, "model.", "embeddings.tok_embeddings.weight")
    x = norm(_embedding(g, w[p + "embeddings.tok_embeddings.weight"], ids, "tok_embeddings"), p + "embeddings.norm",
             "emb_norm")
    ctx = replace(attention_context(g, mask, bs, H, D, sparse=True), layout_global_rows=False)
    # int8_attention (INT8_ATTENTION): the full layers' two products; the band layers stay fp32, as Longformer's
    dense_ctx = replace(ctx, sparse=False, int8=int8_attention)
    theta = {kind: _rope_theta(config, kind) for kind in ("full_attention", "sliding_attention")}
    rope = {}
    for i, spec in enumerate(specs):
        g.scope = f"layer{i}/"
        lp = f"{p}layers.{i}."
        kind = "sliding_attention" if spec.band else "full_attention"
        if kind not in rope:
            rope[kind] = _rotary_tables(g, ids, rotary_inv_freq(theta[kind], D))
        h = norm(x, lp + "attn_norm", "attn_norm") if f"{lp}attn_norm.weight" in w else x
        q, k, v = (linear(h, lp + "attn.Wqkv", n, slice(j * E, (j + 1) * E))
                   for j, n in enumerate(("query", "key", "value")))
        q, k = (_apply_rotary(g, t, *rope[kind], H, D) for t in (q, k))
        a = block_sparse_attention(g, q, k, v, i, for_layer(ctx, spec) if spec.band else dense_ctx)  # (B, S, E)
        x = g.op("Add", [x, linear(a, lp + "attn.Wo", "attn_out")])
        h = norm(x, lp + "mlp_norm", "mlp_norm")
        inner = w[lp + "mlp.Wi.weight"].shape[0] // 2
        gelu_in = g.activation(linear(h, lp + "mlp.Wi", "mlp_in", slice(0, inner)), act)
        gate = linear(h, lp + "mlp.Wi", "mlp_gate", slice(inner, 2 * inner))
        x = g.op("Add", [x, linear(g.op("Mul", [gelu_in, gate]), lp + "mlp.Wo", "mlp_out")])
    g.scope = "head/"
    x = norm(x, p + "final_norm", "final_norm")

    def head(t: str) -> str:
        return norm(g.activation(linear(t, "head.dense", "dense"), head_act), "head.norm", "norm")

    if task == "qa":
        logits = g.to_fp32(linear(head(x), "classifier", "classifier"))  # (B, S, 2)
        start, end = g.op("Split", [logits, g.const([1, 1])], axis=2, n_out=2)
        g.output(g.op("Squeeze", [start, g.const([2])]), "start_logits", TensorProto.FLOAT, ["batch", "sequence"])
        g.output(g.op("Squeeze", [end, g.const([2])]), "end_logits", TensorProto.FLOAT, ["batch", "sequence"])
    elif task == "classify":
        pooled = pool_tokens(g, x, mask, config.get("classifier_pooling", "cls"))  # (B, E)
        logits = linear(head(pooled), "classifier", "classifier")
        g.output(g.to_fp32(logits), "logits", TensorProto.FLOAT, ["batch", "labels"])
    elif task == "mlm":
        decoder = w.first("decoder.weight", p + "embeddings.tok_embeddings.weight")
        g.output(g.to_fp32(g.linear(head(x), decoder, w.get("decoder.bias"), "decoder")), "logits", TensorProto.FLOAT,
                 ["batch", "sequence", "vocab"])
    elif task == "embed":
        g.output(g.to_fp32(pool_tokens(g, x, mask, pooling)), "embedding", TensorProto.FLOAT, ["batch", E])
    else:
        raise ValueError(f"task {task!r}: a ModernBERT exports as qa, classify, mlm or embed")
    kinds = ["band" if spec.band else "dense" for spec in specs]
    return g.model(f"ModernBERT {task} encoder, layers {kinds}, band {bs} tokens each side")


def _rope_theta(config: dict, kind: str) -> float:
    """The rotary base of a layer type, in either config spelling (`longdoc.model.modernbert.ModernBertConfig`):
    `rope_parameters[kind]["rope_theta"]`, else `global_rope_theta` / `local_rope_theta`, else
    transformers' defaults (160000 full, 10000 sliding). Rope types other than "default" are refused."""
    params = (config.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default" or config.get("rope_scaling") is not None:
        raise ValueError(f"ModernBERT {kind}: only the default rotary embedding exports (rope_parameters "
                         f"{params!r}, rope_scaling {config.get('rope_scaling')!r})")
    legacy = config.get("global_rope_theta" if kind == "full_attention" else "local_rope_theta")
    theta = params.get("rope_theta", legacy)
    return float({"full_attention": 160_000.0, "sliding_attention": 10_000.0}[kind] if theta is None else theta)
