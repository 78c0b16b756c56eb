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


def without_window(feed: dict[str, np.ndarray], window_blocks: int) -> dict[str, np.ndarray]:
    """The tables of a graph exported with `--sparse-gather window`, which reads each sparse row's
    window (query block i attends to blocks i - w .. i + w, w = window_blocks // 2, those that exist)
    from slices of a shifted copy of the keys: every row that is not global keeps only its other
    slots, in their order (one occurrence of each window block removed, so a block listed twice
    still counts twice), padded with invalid slots to the widest such row (at least 1).

    A row whose table lacks a block of its own window cannot be written so: ValueError (BigBird's
    tables and the dense one always hold it; export/exporter.py refuses other patterns)."""
    key_blocks, valid = feed["layout_key_blocks"], feed["layout_valid"]  # (L, H, nb, K)
    nb = key_blocks.shape[2]
    row = np.arange(nb)[:, None]  # (nb, 1)
    sparse_row = valid.any(axis=-1)  # (L, H, nb): global rows list nothing
    keep = valid.copy()
    half = window_blocks // 2
    for d in range(-half, half + 1):
        match = keep & (key_blocks == row + d)  # (L, H, nb, K)
        first = match & (np.cumsum(match, axis=-1) == 1)
        exists = (0 <= row[:, 0] + d) & (row[:, 0] + d < nb)  # (nb,)
        missing = sparse_row & exists & ~first.any(axis=-1)
        if missing.any():
            l, h, i = (int(x[0]) for x in np.nonzero(missing))
            raise ValueError(f"layer {l} head {h} query block {i} does not attend to block {i + d} of its "
                             f"{window_blocks}-block window: this layout cannot run in a `--sparse-gather window` graph")
        keep &= ~first
    width = max(1, int(keep.sum(axis=-1).max(initial=0)))
    order = np.argsort(~keep, axis=-1, kind="stable")[..., :width]  # kept slots first, in their order
    return {**feed, "layout_key_blocks": np.where(np.take_along_axis(keep, order, -1),
                                                  np.take_along_axis(key_blocks, order, -1), 0),
            "layout_valid": np.take_along_axis(keep, order, -1)}
