"""Host side of the block-sparse graph: the layout graph inputs for one padded length.

NumPy only (no onnx, no torch): `longdoc.export.runtime` imports this on serving machines, which have
onnxruntime but not the `onnx` package. The graph side is `export/sparse_attention.py`.
"""

from __future__ import annotations

import numpy as np

LAYOUT_INPUTS = ("layout_key_blocks", "layout_valid", "global_blocks", "block_source")


def layout_feed(layouts, n_blocks: int, global_rows: bool = True) -> dict[str, np.ndarray]:
    """Stack per-layer `longdoc.model.layout.Layout`s into the graph's layout inputs.

    global_rows: the graph takes the layout's global query blocks (`global_blocks`, `block_source`),
    one set for every layer. A graph without them (Longformer's, ModernBERT's) gets the tables only,
    and its layers' global rows may differ: ModernBERT's `dense` layers (every row global) are
    computed densely by the graph and read no table row."""
    if not global_rows:
        return _tables(layouts)
    first = layouts[0].global_rows
    for layout in layouts[1:]:
        if not np.array_equal(layout.global_rows, first):
            raise ValueError("global rows differ between layers; the graph takes one global set")
    return {**_tables(layouts), **_feed_globals(np.flatnonzero(first), n_blocks)}


def _tables(layouts) -> dict[str, np.ndarray]:
    # per-layer tables may differ in width (a Longformer window per layer): the narrower ones are
    # padded with invalid slots (block 0), which the graph masks or slices away
    K = max(lay.width for lay in layouts)
    key_blocks = np.stack([np.pad(np.asarray(lay.key_blocks, dtype=np.int64), ((0, 0), (0, 0), (0, K - lay.width)))
                           for lay in layouts])  # (L, H, nb, K)
    valid = np.stack([np.pad(np.asarray(lay.valid, dtype=bool), ((0, 0), (0, 0), (0, K - lay.width)))
                      for lay in layouts])  # (L, H, nb, K)
    return {"layout_key_blocks": key_blocks, "layout_valid": valid}


def dense_layout_feed(num_layers: int, num_heads: int, n_blocks: int) -> dict[str, np.ndarray]:
    """Full attention through the sparse graph: every row lists every key block once."""
    key_blocks = np.broadcast_to(np.arange(n_blocks, dtype=np.int64), (num_layers, num_heads, n_blocks, n_blocks))
    return _feed(np.ascontiguousarray(key_blocks), np.ones(key_blocks.shape, bool), np.zeros(0, np.int64), n_blocks)


def _feed(key_blocks, valid, global_blocks, n_blocks) -> dict[str, np.ndarray]:
    return {"layout_key_blocks": key_blocks, "layout_valid": valid, **_feed_globals(global_blocks, n_blocks)}


def _feed_globals(global_blocks, n_blocks) -> dict[str, np.ndarray]:
    block_source = np.arange(n_blocks, dtype=np.int64)
    block_source[global_blocks] = n_blocks + np.arange(len(global_blocks))
    if len(global_blocks) == 0:  # keep G >= 1 (no empty tensors): compute block 0 densely, unused
        global_blocks = np.zeros(1, np.int64)
    return {"global_blocks": global_blocks.astype(np.int64), "block_source": block_source}
