"""The export's part of each architecture's record (`longdoc.model.registry.Architecture`): the
build step that lowers a checkpoint to ONNX graphs, and what that lowering cannot do. `export_model`
and `verify` read the record and branch on no architecture.

Adding an architecture: its model record in `longdoc.model.registry`, its graph builders in
`longdoc.export.lowering`, and one `register_lowering(...)` here (docs/DESIGN.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from longdoc.export.lowering import (Weights, build_b2b_decoder, build_b2b_encoder, build_bigbird_encoder,
                                     build_led_decoder, build_led_encoder, build_longformer_encoder,
                                     build_modernbert_encoder, build_pegasus_decoder, build_pegasus_encoder)
from longdoc.model.layout import modernbert_layer_specs
from longdoc.model.registry import REGISTRY, Architecture, bert_blocks


@dataclass(frozen=True)
class BuildRequest:
    """What `longdoc export` asks of a build step."""

    task: str
    dtype: str  # the graphs' float type: "fp32" | "fp16" (int8 quantizes an fp32 graph afterwards)
    int8_attention: str = "off"  # longdoc.export.manifest.INT8_ATTENTION
    attention: str = "sparse"  # longdoc.export.lowering.LONGFORMER_ATTENTION
    sparse_gather: str = "gather"  # longdoc.export.manifest.SPARSE_GATHER
    progress: Callable[[str], None] = print
    pooling: str = "mean"  # task "embed": longdoc.export.lowering.EMBEDDING_POOLING


@dataclass(frozen=True)
class Graphs:
    graphs: dict  # name ("encoder", "decoder") -> onnx.ModelProto
    decoder: dict | None = None  # the manifest's decoder dimensions (num_layers, num_heads, head_dim, max_positions)


@dataclass(frozen=True)
class Lowering:
    """An architecture's model record plus its export."""

    model: Architecture
    build: Callable[[Weights, dict, BuildRequest], Graphs]
    # checkpoint tensors no graph reads, not worth a note (poolers, position_ids buffers)
    unused: tuple[str, ...] = ()
    # None: the int8 attention products are built; else why not (`--int8-attention` is refused)
    no_int8_attention: str | None = None
    full_attention: bool = False  # `--attention full`, a dense benchmark baseline
    # None: `--sparse-gather` (SPARSE_GATHER) chooses BigBird's block gathers; else why it does not apply
    no_sparse_gather: str | None = None


LOWERINGS: dict[str, Lowering] = {}


def register_lowering(model_type: str, build: Callable[[Weights, dict, BuildRequest], Graphs], **fields) -> Lowering:
    if model_type not in REGISTRY:
        raise ValueError(f"model_type {model_type!r} has no record in longdoc.model.registry")
    LOWERINGS[model_type] = lowering = Lowering(REGISTRY[model_type], build, **fields)
    return lowering


def _block_sparse(enc: dict) -> bool:
    return enc.get("attention_type", "block_sparse") == "block_sparse"


def _seq2seq_decoder(num_layers: int, num_heads: int, hidden_size: int, max_positions: int) -> dict:
    return {"num_layers": num_layers, "num_heads": num_heads, "head_dim": hidden_size // num_heads,
            "max_positions": max_positions}


def _bart_decoder(config: dict, max_positions_key: str) -> dict:
    return _seq2seq_decoder(config["decoder_layers"], config["decoder_attention_heads"], config["d_model"],
                            config[max_positions_key])


def build_bigbird(w: Weights, config: dict, r: BuildRequest) -> Graphs:
    r.progress(f"building encoder graph ({config['num_hidden_layers']} layers, {r.dtype})")
    return Graphs({"encoder": build_bigbird_encoder(w, config, r.task, r.dtype, _block_sparse(config),
                                                    sep_token_id=config.get("sep_token_id"),
                                                    int8_attention=r.int8_attention, pooling=r.pooling,
                                                    sparse_gather=r.sparse_gather)})


def build_bert(w: Weights, config: dict, r: BuildRequest) -> Graphs:
    """BERT: BigBird's graph with full attention (longdoc.model.bert), no layout inputs."""
    return build_bigbird(w, bert_blocks(config), r)


def build_longformer(w: Weights, config: dict, r: BuildRequest) -> Graphs:
    r.progress(f"building Longformer encoder graph ({config['num_hidden_layers']} layers, {r.dtype}, "
               f"{'full attention' if r.attention == 'full' else 'window and global tokens'})")
    return Graphs({"encoder": build_longformer_encoder(w, config, r.task, r.dtype, r.attention)})


def build_pegasus(w: Weights, config: dict, r: BuildRequest) -> Graphs:
    r.progress(f"building encoder graph ({config['encoder_layers']} layers, {r.dtype})")
    graphs = {"encoder": build_pegasus_encoder(w, config, r.dtype, _block_sparse(config), r.int8_attention,
                                                  r.sparse_gather)}
    r.progress(f"building decoder graph ({config['decoder_layers']} layers, {r.dtype})")
    graphs["decoder"] = build_pegasus_decoder(w, config, r.dtype)
    return Graphs(graphs, _bart_decoder(config, "max_position_embeddings"))


def build_led(w: Weights, config: dict, r: BuildRequest) -> Graphs:
    r.progress(f"building encoder graph ({config['encoder_layers']} layers, {r.dtype})")
    graphs = {"encoder": build_led_encoder(w, config, r.dtype)}
    r.progress(f"building decoder graph ({config['decoder_layers']} layers, {r.dtype})")
    graphs["decoder"] = build_led_decoder(w, config, r.dtype)
    return Graphs(graphs, _bart_decoder(config, "max_decoder_position_embeddings"))


def build_modernbert(w: Weights, config: dict, r: BuildRequest) -> Graphs:
    kinds = ["band" if spec.band else "dense" for spec in modernbert_layer_specs(config)]
    r.progress(f"building ModernBERT encoder graph ({len(kinds)} layers: {kinds.count('band')} band, "
               f"{kinds.count('dense')} dense; {r.dtype}" + (f"; int8 attention {r.int8_attention} in the dense "
                                                            "layers" if r.int8_attention != "off" else "") + ")")
    return Graphs({"encoder": build_modernbert_encoder(w, config, r.task, r.dtype, r.int8_attention, r.pooling)})


def build_b2b(w: Weights, config: dict, r: BuildRequest) -> Graphs:
    enc, dec = config["encoder"], config["decoder"]
    r.progress(f"building encoder graph ({enc['num_hidden_layers']} layers, {r.dtype})")
    graphs = {"encoder": build_b2b_encoder(w, config, r.dtype, _block_sparse(enc), r.int8_attention, r.sparse_gather)}
    r.progress(f"building decoder graph ({dec['num_hidden_layers']} layers, {r.dtype})")
    graphs["decoder"] = build_b2b_decoder(w, config, r.dtype)
    return Graphs(graphs, _seq2seq_decoder(dec["num_hidden_layers"], dec["num_attention_heads"], dec["hidden_size"],
                                           dec["max_position_embeddings"]))


# Longformer's band and its global tokens (and LED's) run in fp32
_WINDOW_FP32 = "Longformer's band and global tokens run in fp32"

register_lowering("big_bird", build_bigbird, unused=("bert.pooler.weight", "bert.pooler.bias",
                                                     "bert.embeddings.position_ids"))
# `--sparse-gather` chooses how BigBird's windows gather their blocks; a band reads its own
_BAND_GATHER = "its band's blocks are gathered with a token-level mask (--sparse-gather is for BigBird's windows)"
register_lowering("longformer", build_longformer, unused=("longformer.embeddings.position_ids",),
                  no_int8_attention=_WINDOW_FP32, full_attention=True, no_sparse_gather=_BAND_GATHER)
register_lowering("bigbird_pegasus", build_pegasus)
register_lowering("led", build_led, no_int8_attention=_WINDOW_FP32, no_sparse_gather=_BAND_GATHER)
register_lowering("encoder-decoder", build_b2b, unused=("encoder.pooler.weight", "encoder.pooler.bias"))
register_lowering("bert", build_bert, unused=("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"),
                  no_sparse_gather="attends fully (no block tables to gather by)")
register_lowering("modernbert", build_modernbert,  # --int8-attention: its dense layers (the band stays fp32)
                  no_sparse_gather=_BAND_GATHER)
