"""Block attention layouts: the attention pattern as data (NumPy only, no torch).

A layout says, for a sequence padded to ``n_blocks`` blocks of ``block_size`` tokens, which key
blocks each query block attends to, per head:

    key_blocks  (H, nb, K) int64   key-block index per (head, query block, slot)
    valid       (H, nb, K) bool    False = padding slot (rows have different key counts)
    global_rows (nb,)      bool    query blocks that attend to every key block (computed
                                   densely; their rows in key_blocks/valid are ignored)

A key block listed twice in a row counts twice (as transformers does in eval mode, where all random
slots point at block 0). One attention function (``longdoc.model.attention.block_sparse_attention``)
consumes any layout; ``longdoc.model.attention.dense_reference_attention`` is the oracle built from the
same table.

Patterns (``AttentionSpec.pattern``), all bidirectional:

- ``bigbird``: ITC (BigBird paper Sec. 2, App. D). The first ``num_global_blocks`` blocks and the
  last block are global (rows and columns), a ``window_blocks``-wide sliding window, and
  ``num_random_blocks`` random key blocks per row. ``num_global_blocks=1`` is transformers' /
  the public checkpoints' set-up; ``num_global_blocks=k`` is the paper's QA set-up (question in
  front, e.g. 128 global tokens = 2 blocks of 64).
- ``bigbird_etc``: ETC (Sec. 2): ``num_global_tokens`` = g extra global tokens are prepended to
  the sequence. In the table model they occupy the first ceil(g / block_size) blocks of the
  padded sequence (the caller prepends them, and masks the unused slots of the last global block
  with ``key_mask``); those blocks are global rows and are attended by every row; the remaining
  blocks get the window and random blocks drawn among the non-global blocks. The last block is
  not global. Only the ``seeded`` plan exists (transformers does not implement ETC).
- ``longformer``: sliding window + the blocks in ``global_blocks`` (negative = from the end) as
  global rows and columns; no random blocks. With ``band`` = w > 0 the window is per token, as
  in Longformer (Beltagy et al. 2020, Sec. 3.1): inside its window blocks a query attends only to
  keys at most w tokens away (``block_size`` = w and ``window_blocks`` = 3 hold exactly that
  band). Longformer's global tokens are chosen per request, not per layout: they are given to the
  attention as ``longdoc.model.attention.GlobalTokens`` (extra key slots every row sees, and rows
  of their own that attend everywhere); ``longformer_attention_specs`` gives a transformers
  Longformer config's per-layer specs.
- ``strided`` / ``fixed``: Child et al.'s patterns in the bidirectional block form of Yun et al.
  (shared/papers/sparse-transformers-universal-approximability.md, Eqs. 4-5), with blocks in
  place of tokens and ``stride`` in blocks:
    strided  A1(i) = window of ``window_blocks``,   A2(i) = {j : (j - i) % stride == 0}
    fixed    A1(i) = the blocks of i's segment [s*stride, (s+1)*stride),
             A2(i) = the last ``summary_blocks`` blocks of every segment
  ``head_config`` picks how the two sub-patterns are used (the paper's Sec. 5 set-ups):
  "union" (every head A1 | A2), "sequential" (even layers A1, odd layers A2), "multihead"
  (first half of the heads A1, second half A2).
- ``star``: Star-Transformer (Eq. 6): the last block is the relay (a global row and column);
  every other block attends to itself, its cyclic neighbours among the non-relay blocks, and
  the relay.
- ``dense``: every row is a global row (the attention computes plain full attention; the
  table has one unused slot per row).

Random-block plans for ``bigbird`` (``AttentionSpec.plan``), all deterministic in their inputs and
never touching NumPy's global RNG:

- ``hf-train``: exactly the blocks transformers' ``BigBirdBlockSparseAttention`` draws in training
  mode (also what the original TF code draws always, i.e. what the public checkpoints were
  trained with). transformers calls ``np.random.seed(layer_index)`` inside ``forward`` and then
  draws with ``np.random.permutation``; ``np.random.RandomState(layer)`` reproduces that stream.
  For padded lengths 1024/3072/4096 it uses the paper's old plan (``_hf_rand_legacy``, drawn
  over ``max_position_embeddings`` positions per head with random blocks limited to the first
  1024 tokens, then truncated); for any other length the per-head plan with length thresholds
  (``_hf_rand_attn_plan`` / ``_hf_rand_with_plan``). BigBirdPegasus' encoder has a line-for-line
  copy of the same attention ("Copied from" BigBird), seeded the same way (encoder layer index),
  so the same plan serves both.
- ``hf-eval``: what transformers does in eval mode: no draw at all, every random slot is key
  block 0, so block 0 counts ``num_random_blocks + 1`` times in every non-global row.
- ``seeded``: our own plan for any length: per (seed, layer, head, n_blocks) a fresh
  ``np.random.Generator``; random blocks are distinct and exclude the row's window and the
  global blocks (fewer when not enough blocks are left).

The transformers row structure reproduced for ``bigbird`` with the hf plans (nb = n_blocks):
row 0 and nb-1 global; row 1 -> {0, 1, 2, nb-1} + random; rows 2..nb-3 -> {0, i-1, i, i+1, nb-1}
+ random; row nb-2 -> {0, nb-3, nb-2, nb-1} + random.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

PATTERNS = ("bigbird", "bigbird_etc", "longformer", "fixed", "strided", "star", "dense")
PLANS = ("hf-train", "hf-eval", "seeded")
HEAD_CONFIGS = ("union", "sequential", "multihead")
# transformers uses the paper's old random plan for these padded lengths (in tokens)
HF_LEGACY_LENGTHS = (1024, 3072, 4096)


@dataclass(frozen=True)
class AttentionSpec:
    """Everything needed to build a layout; JSON-serialisable with ``dataclasses.asdict``."""

    pattern: str
    block_size: int
    num_random_blocks: int = 3  # bigbird, bigbird_etc
    num_global_blocks: int = 1  # bigbird: leading global blocks (1 = ITC; k = QA set-up)
    window_blocks: int = 3  # sliding window width in blocks (odd)
    plan: str = "hf-train"  # "hf-train" | "hf-eval" | "seeded"
    seed: int = 0  # plan="seeded"; the hf plans are seeded by the layer index
    # hf-train at padded lengths 1024/3072/4096 draws over config.max_position_embeddings
    max_position_embeddings: int = 4096
    global_blocks: tuple[int, ...] = (0,)  # longformer: global blocks (negative = from the end)
    stride: int = 4  # strided: stride in blocks; fixed: segment length in blocks
    summary_blocks: int = 1  # fixed: the last c blocks of every segment
    head_config: str = "union"  # strided / fixed: "union" | "sequential" | "multihead"
    num_global_tokens: int = 0  # bigbird_etc: g extra global tokens prepended
    band: int = 0  # longformer: keys at most `band` tokens from the query (0 = whole key blocks)

    def __post_init__(self):
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown attention pattern {self.pattern!r}; expected one of {PATTERNS}")
        if self.plan not in PLANS:
            raise ValueError(f"unknown random-block plan {self.plan!r}; expected one of {PLANS}")
        if self.head_config not in HEAD_CONFIGS:
            raise ValueError(f"unknown head_config {self.head_config!r}; expected one of {HEAD_CONFIGS}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.window_blocks < 1 or self.window_blocks % 2 == 0:
            raise ValueError(f"window_blocks must be odd and >= 1, got {self.window_blocks}")
        if self.num_random_blocks < 0 or self.num_global_blocks < 0:
            raise ValueError("num_random_blocks and num_global_blocks must be >= 0")
        if self.stride < 1 or self.summary_blocks < 1:
            raise ValueError("stride and summary_blocks must be >= 1")
        if self.band < 0 or (self.band and self.pattern != "longformer"):
            raise ValueError(f"band must be >= 0 and is a longformer option; got {self.band} for {self.pattern!r}")
        if self.band > (self.window_blocks // 2) * self.block_size:
            raise ValueError(
                f"band {self.band} reaches beyond the window blocks ({self.window_blocks // 2} x {self.block_size} "
                "tokens each side)"
            )
        if self.pattern == "bigbird_etc" and self.num_global_tokens < 1:
            raise ValueError("bigbird_etc needs num_global_tokens >= 1")
        # JSON round trips give lists; keep the spec hashable (layouts are cached by spec)
        object.__setattr__(self, "global_blocks", tuple(int(b) for b in self.global_blocks))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> AttentionSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown AttentionSpec fields: {unknown}")
        return cls(**data)


def checkpoint_attention_spec(config, plan: str = "hf-train") -> AttentionSpec:
    """The layout a Hugging Face BigBird or BigBird-Pegasus ``config.json`` implies: ITC (first
    and last block global, 3-block window, ``num_random_blocks`` random blocks), drawn over the
    checkpoint's own ``max_position_embeddings`` as transformers does; ``original_full``
    checkpoints attend densely. ``config`` is the config.json mapping. The one place this is
    decided: the PyTorch models, the exporter and (through the manifest) the runtime use it."""
    block_size = int(config["block_size"])
    if config.get("attention_type", "block_sparse") == "original_full":
        return AttentionSpec(pattern="dense", block_size=block_size, plan=plan)
    return AttentionSpec(pattern="bigbird", block_size=block_size,
                         num_random_blocks=int(config.get("num_random_blocks", 3)), num_global_blocks=1,
                         window_blocks=3, plan=plan,
                         max_position_embeddings=int(config.get("max_position_embeddings", 4096)))


def longformer_attention_specs(config) -> tuple[AttentionSpec, ...]:
    """One spec per layer for a Hugging Face Longformer ``config.json`` mapping: the sliding window
    of ``attention_window`` tokens (w = attention_window / 2 each side, per layer when a list) as
    3 blocks of w tokens under a band of w tokens; no global blocks (Longformer's global tokens
    come with each request)."""
    layers = int(config["num_hidden_layers"])
    windows = config["attention_window"]
    windows = [windows] * layers if isinstance(windows, int) else list(windows)
    if len(windows) != layers:
        raise ValueError(f"attention_window has {len(windows)} entries for {layers} layers")
    for w in windows:
        if not isinstance(w, int) or w <= 0 or w % 2:
            raise ValueError(f"every attention_window must be a positive even int, got {windows}")
    return tuple(AttentionSpec(pattern="longformer", block_size=w // 2, window_blocks=3, global_blocks=(), band=w // 2)
                 for w in windows)


def longformer_block_size(config: dict) -> int:
    """The tokens per block of a Longformer export: the greatest common divisor of every layer's
    w = attention_window / 2 (w itself when one window holds for every layer), so that one padded
    length and one table shape serve every layer (`longformer_layer_specs`)."""
    return math.gcd(*(spec.band for spec in longformer_attention_specs(config)))


def longformer_layer_specs(config: dict) -> tuple[AttentionSpec, ...]:
    """One spec per layer over the common block size b = `longformer_block_size`: a layer of
    window w = m b attends 2 m + 1 blocks of b tokens under a band of w tokens, which holds exactly
    the keys at most w tokens away, as 3 blocks of w do. One window for every layer gives
    `longformer_attention_specs` itself (b = w, 3 blocks). The export's layout tables, graph band
    and manifest read these."""
    b = longformer_block_size(config)
    return tuple(dataclasses.replace(spec, block_size=b, window_blocks=2 * (spec.band // b) + 1)
                 for spec in longformer_attention_specs(config))


MODERNBERT_LAYER_TYPES = ("full_attention", "sliding_attention")


def modernbert_layer_types(config: dict) -> list[str]:
    """Each layer's attention type in a Hugging Face ModernBERT ``config.json`` mapping: its
    ``layer_types``, else transformers' rule (layer i is "full_attention" when i %
    ``global_attn_every_n_layers`` (default 3) == 0, else "sliding_attention"). The same rule as
    ``longdoc.model.modernbert.ModernBertConfig`` (a test holds the two equal)."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        every = config.get("global_attn_every_n_layers")
        every = 3 if every is None else int(every)
        if every < 1:
            raise ValueError(f"global_attn_every_n_layers must be >= 1, got {every}")
        types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    types = list(types)
    if len(types) != layers or set(types) - set(MODERNBERT_LAYER_TYPES):
        raise ValueError(f"layer_types must be {layers} of {MODERNBERT_LAYER_TYPES}, got {types!r}")
    return types


def modernbert_layer_specs(config: dict) -> tuple[AttentionSpec, ...]:
    """One spec per layer for a ModernBERT ``config.json`` mapping, over one block size b =
    local_attention // 2 (transformers' sliding window: query i sees key j when |i - j| <= b):
    a "sliding_attention" layer is a band of b tokens over 3 blocks of b (Longformer's window,
    `longformer_attention_specs`, without global tokens); a "full_attention" layer is ``dense``
    (computed densely by the graph, which reads no table row for it)."""
    b = int(config.get("local_attention", 128)) // 2
    if b < 1:
        raise ValueError(f"local_attention {config.get('local_attention')} leaves no sliding window "
                         "(need local_attention >= 2)")
    band = AttentionSpec(pattern="longformer", block_size=b, window_blocks=3, global_blocks=(), band=b)
    dense = AttentionSpec(pattern="dense", block_size=b)
    return tuple(band if t == "sliding_attention" else dense for t in modernbert_layer_types(config))


@dataclass(frozen=True, eq=False)
class Layout:
    key_blocks: np.ndarray  # (H, nb, K) int64
    valid: np.ndarray  # (H, nb, K) bool
    global_rows: np.ndarray  # (nb,) bool
    band: int = 0  # > 0: inside its key blocks a (non-global) query sees keys at most `band` tokens away

    @property
    def num_heads(self) -> int:
        return self.key_blocks.shape[0]

    @property
    def n_blocks(self) -> int:
        return self.key_blocks.shape[1]

    @property
    def width(self) -> int:
        return self.key_blocks.shape[2]

    @property
    def global_index(self) -> np.ndarray:
        """(G,) int64: the global query blocks in increasing order."""
        return np.flatnonzero(self.global_rows).astype(np.int64)

    def counts(self) -> np.ndarray:
        """(H, nb, nb) int64 multiplicity of each key block in each query row (global rows: 1)."""
        H, nb, K = self.key_blocks.shape
        counts = np.zeros((H, nb, nb), dtype=np.int64)
        h = np.broadcast_to(np.arange(H)[:, None, None], (H, nb, K))
        i = np.broadcast_to(np.arange(nb)[None, :, None], (H, nb, K))
        np.add.at(counts, (h[self.valid], i[self.valid], self.key_blocks[self.valid]), 1)
        counts[:, self.global_rows, :] = 1
        return counts


def build_layout(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int) -> Layout:
    """The layout of ``spec`` for a sequence padded to ``n_blocks`` blocks.

    Deterministic in (spec, n_blocks, num_heads, layer) and cached; the arrays are read-only.
    """
    if n_blocks < 1 or num_heads < 1 or layer < 0:
        raise ValueError(f"need n_blocks >= 1, num_heads >= 1, layer >= 0; got {n_blocks}, {num_heads}, {layer}")
    return _build_layout(spec, int(n_blocks), int(num_heads), int(layer))


@functools.lru_cache(maxsize=512)
def _build_layout(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int) -> Layout:
    built = _BUILDERS[spec.pattern](spec, n_blocks, num_heads, layer)
    if isinstance(built, Layout):  # a builder that produced the arrays itself
        for a in (built.key_blocks, built.valid, built.global_rows):
            a.setflags(write=False)
        return built
    rows, global_rows, *width = built
    layout = _pack(rows, global_rows, n_blocks, *width)
    return dataclasses.replace(layout, band=spec.band) if spec.band else layout


# ----------------------------------------------------------------------------------------------
# helpers


def _pack(rows: list[list[list[int]]], global_rows: np.ndarray, n_blocks: int, min_width: int = 1) -> Layout:
    """rows[h][i] = key blocks of (head h, query block i) -> padded (H, nb, K) table."""
    num_heads = len(rows)
    width = max((len(r) for head in rows for i, r in enumerate(head) if not global_rows[i]), default=1)
    width = max(width, min_width)
    key_blocks = np.zeros((num_heads, n_blocks, width), dtype=np.int64)
    valid = np.zeros((num_heads, n_blocks, width), dtype=bool)
    for h, head in enumerate(rows):
        for i, row in enumerate(head):
            if global_rows[i]:
                continue  # ignored by the attention: all slots stay invalid
            if not row:
                raise ValueError(f"layout row {i} of head {h} attends to nothing")
            key_blocks[h, i, : len(row)] = row
            valid[h, i, : len(row)] = True
    if ((key_blocks < 0) | (key_blocks >= n_blocks)).any():
        raise AssertionError("key block index out of range")  # a bug in a pattern builder
    for a in (key_blocks, valid, global_rows):
        a.setflags(write=False)
    return Layout(key_blocks=key_blocks, valid=valid, global_rows=global_rows)


def _window(i: int, window_blocks: int, n_blocks: int) -> list[int]:
    half = window_blocks // 2
    return list(range(max(0, i - half), min(n_blocks, i + half + 1)))


def _sorted_union(*groups) -> list[int]:
    return sorted(set().union(*(set(int(x) for x in g) for g in groups)))


def _global_mask(n_blocks: int, blocks) -> np.ndarray:
    mask = np.zeros(n_blocks, dtype=bool)
    for b in blocks:
        if not -n_blocks <= b < n_blocks:
            continue  # a global block beyond a short sequence simply does not exist
        mask[b] = True
    return mask


def _seeded_rng(seed: int, layer: int, head: int, n_blocks: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, layer, head, n_blocks]))


# ----------------------------------------------------------------------------------------------
# bigbird (ITC) and its random plans


def _bigbird(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int):
    if spec.plan == "seeded":
        globals_ = list(range(min(spec.num_global_blocks, n_blocks))) + [n_blocks - 1]
        return _window_global_random(spec, n_blocks, num_heads, layer, globals_)
    if spec.num_global_blocks != 1 or spec.window_blocks != 3:
        raise ValueError(
            f"plan {spec.plan!r} reproduces transformers, which has exactly one leading global block and a "
            "3-block window; use plan='seeded' for num_global_blocks != 1 or window_blocks != 3"
        )
    nb = n_blocks
    if nb < 5:
        raise ValueError(f"plan {spec.plan!r} needs n_blocks >= 5 (transformers' five query regions), got {nb}")
    rand = hf_random_blocks(spec, nb, num_heads, layer, training=spec.plan == "hf-train")  # (H, nb-2, r)
    rows = []
    for h in range(num_heads):
        head_rows = [[] for _ in range(nb)]  # rows 0 and nb-1 are global
        head_rows[1] = [0, 1, 2, nb - 1] + rand[h, 0].tolist()
        for i in range(2, nb - 2):
            head_rows[i] = [0, i - 1, i, i + 1, nb - 1] + rand[h, i - 1].tolist()
        head_rows[nb - 2] = [0, nb - 3, nb - 2, nb - 1] + rand[h, nb - 3].tolist()
        rows.append(head_rows)
    return rows, _global_mask(nb, (0, nb - 1))


def _window_global_random(spec, n_blocks, num_heads, layer, global_blocks) -> Layout:
    """Seeded plan: window + globals + distinct random blocks outside both (vectorised per head).

    Row i lists its window and the global blocks (increasing), then min(r, #others) distinct
    random blocks drawn uniformly from the rest (increasing).
    """
    nb, r = n_blocks, spec.num_random_blocks
    global_rows = _global_mask(nb, global_blocks)
    half = spec.window_blocks // 2
    offset = np.arange(nb)[None, :] - np.arange(nb)[:, None]  # (nb, nb): key - query
    fixed = (np.abs(offset) <= half) | global_rows[None, :]  # (nb, nb) window and global columns
    n_fixed = fixed.sum(1)  # (nb,)
    n_rand = np.minimum(r, nb - n_fixed)  # (nb,)
    width = int((n_fixed + n_rand)[~global_rows].max(initial=1))
    slot = np.arange(width)[None, :]  # (1, K)
    # fixed part: the column indices of `fixed` in increasing order, as the first n_fixed slots
    fixed_cols = np.argsort(~fixed, axis=1, kind="stable")  # (nb, nb): fixed columns first
    key_blocks = np.zeros((num_heads, nb, width), dtype=np.int64)
    for h in range(num_heads):
        rng = _seeded_rng(spec.seed, layer, h, nb)
        # a uniform random subset per row: the r smallest of i.i.d. keys over the allowed columns
        keys = np.where(fixed, np.inf, rng.random((nb, nb)))  # (nb, nb)
        if 0 < r < nb:
            picked = np.argpartition(keys, r - 1, axis=1)[:, :r]  # (nb, r) the r smallest, any order
        else:
            picked = np.argsort(keys, axis=1)[:, :r]  # (nb, r)
        # allowed picks (finite key; there are n_rand of them) in increasing order, then filler
        allowed = np.isfinite(np.take_along_axis(keys, picked, axis=1))  # (nb, r)
        picked = np.sort(np.where(allowed, picked, nb), axis=1)  # (nb, r)
        picked = np.where(picked < nb, picked, 0)
        row = np.concatenate([fixed_cols, picked], axis=1)  # (nb, nb + r)
        # slot j < n_fixed -> fixed_cols[j]; n_fixed <= j < n_fixed + n_rand -> picked[j - n_fixed]
        src = np.where(slot < n_fixed[:, None], slot, nb + slot - n_fixed[:, None])  # (nb, K)
        src = np.clip(src, 0, nb + r - 1)
        key_blocks[h] = np.take_along_axis(row, src, axis=1)
    valid = np.broadcast_to(slot < (n_fixed + n_rand)[:, None], (num_heads, nb, width)).copy()
    valid[:, global_rows, :] = False
    key_blocks[~valid] = 0
    return Layout(key_blocks=key_blocks, valid=valid, global_rows=global_rows)


def hf_random_blocks(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int, training: bool) -> np.ndarray:
    """(H, n_blocks - 2, r) int64: transformers' ``rand_attn`` for query blocks 1..nb-2.

    Reproduces ``BigBirdBlockSparseAttention.bigbird_block_sparse_attention`` (and BigBirdPegasus'
    copy): in training mode ``np.random.seed(layer)`` then one of two draw procedures; in eval mode
    no draw and all zeros.
    """
    r, bs = spec.num_random_blocks, spec.block_size
    seq_len = n_blocks * bs
    if not training:
        return np.zeros((num_heads, n_blocks - 2, r), dtype=np.int64)
    rng = np.random.RandomState(layer)  # == np.random.seed(layer) + np.random.permutation(...)
    if seq_len in HF_LEGACY_LENGTHS:
        max_blocks = spec.max_position_embeddings // bs
        if max_blocks < n_blocks:
            raise ValueError(
                f"hf-train at length {seq_len} draws over max_position_embeddings="
                f"{spec.max_position_embeddings} positions, which is shorter than the sequence"
            )
        heads = [_hf_rand_legacy(rng, max_blocks, bs, r, last_idx=1024)[: n_blocks - 2] for _ in range(num_heads)]
    else:
        plan_from_length, plan_num_rand_blocks = _hf_rand_attn_plan(seq_len, bs, r)
        heads = _hf_rand_with_plan(rng, n_blocks, bs, num_heads, plan_from_length, plan_num_rand_blocks)
    return np.stack(heads).astype(np.int64)


def _hf_rand_legacy(rng: np.random.RandomState, n_blocks: int, block_size: int, r: int, last_idx: int) -> np.ndarray:
    """transformers' ``_bigbird_block_rand_mask`` (the paper's old plan), drawing from ``rng``.

    (nb-2, r) random key blocks for query blocks 1..nb-2. Random blocks come from
    [1, last] with last = last_idx // block_size - 1; the window is excluded except for the
    rows near the end (transformers' own "Missing -3/-4" quirks are kept, they define the plan).
    """
    out = np.zeros((n_blocks - 2, r), dtype=np.int32)
    middle = np.arange(1, n_blocks - 1, dtype=np.int32)  # candidate blocks 1..nb-2
    last = n_blocks - 1
    if last_idx > 2 * block_size:
        last = last_idx // block_size - 1
    for i in range(1, n_blocks - 1):
        start, end = i - 2, i
        if i == 1:
            pool = middle[2:last]
        elif i == 2:
            pool = middle[3:last]
        elif i in (n_blocks - 3, n_blocks - 2):
            pool = middle[:last]
        elif start > last:
            pool = middle[:last]
        elif end + 1 == last:
            pool = middle[:start]
        else:
            pool = np.concatenate((middle[:start], middle[end + 1 : last]))
        chosen = rng.permutation(pool)[:r]
        if chosen.size not in (1, r):  # numpy would refuse to broadcast
            raise ValueError(f"hf-train: transformers' legacy plan has only {chosen.size} of {r} random blocks for row {i}")
        out[i - 1, :] = chosen  # a single block broadcasts, as in transformers
    return out


def _hf_rand_attn_plan(seq_len: int, block_size: int, r: int) -> tuple[list[int], list[int]]:
    """transformers' ``_get_rand_attn_plan``: (end lengths of plan segments, random blocks in each).

    With nb = seq_len // block_size: nb > 2r+5 -> random blocks only among the first 2r+5 blocks;
    r+5 < nb <= 2r+5 -> r//2 among the first r+5 blocks and the rest anywhere; else r anywhere.
    """
    nb = seq_len // block_size
    if 2 * r + 5 < nb:
        return [(2 * r + 5) * block_size, seq_len], [r, 0]
    if r + 5 < nb:
        return [(r + 5) * block_size, seq_len], [r // 2, r - r // 2]
    return [seq_len], [r]


def _hf_rand_with_plan(rng, n_blocks, block_size, num_heads, plan_from_length, plan_num_rand_blocks):
    """transformers' ``_bigbird_block_rand_mask_with_head`` in training mode (same draw order)."""
    plan_blocks = [length // block_size for length in plan_from_length]
    plan_r = plan_num_rand_blocks
    max_plan_idx = plan_from_length.index(n_blocks * block_size)
    total_r = int(np.sum(plan_r[: max_plan_idx + 1]))
    rand = [np.zeros((n_blocks, total_r), dtype=np.int32) for _ in range(num_heads)]
    top = 1  # global_block_top

    def fill(row, col_start, col_end, to_start, to_end, r):
        for h in range(num_heads):
            chosen = _hf_single_row(rng, row, to_start, to_end, r)
            if chosen.size not in (1, col_end - col_start):  # numpy would refuse to broadcast
                raise ValueError(
                    f"hf-train: transformers' plan finds only {chosen.size} of {r} random blocks for query block "
                    f"{row} of {n_blocks} (transformers fails on this length too; it runs block-sparse only "
                    "above (5 + 2r) blocks); use plan='seeded'"
                )
            rand[h][row, col_start:col_end] = chosen  # a single block broadcasts, as in transformers

    for plan_idx in range(max_plan_idx + 1):
        if plan_idx > 0:
            # earlier rows draw this segment's share from this segment's columns
            if plan_r[plan_idx] > 0:
                c0, c1 = int(np.sum(plan_r[:plan_idx])), int(np.sum(plan_r[: plan_idx + 1]))
                for row in range(top, plan_blocks[plan_idx - 1]):
                    fill(row, c0, c1, plan_blocks[plan_idx - 1], plan_blocks[plan_idx], plan_r[plan_idx])
            # this segment's rows draw each earlier segment's share from that segment's columns
            for pl_id in range(plan_idx):
                if plan_r[pl_id] == 0:
                    continue
                c0 = int(np.sum(plan_r[:pl_id])) if pl_id > 0 else 0
                to_start = plan_blocks[pl_id - 1] if pl_id > 0 else 0
                c1 = int(np.sum(plan_r[: pl_id + 1]))
                for row in range(plan_blocks[plan_idx - 1], plan_blocks[plan_idx]):
                    fill(row, c0, c1, to_start, plan_blocks[pl_id], plan_r[pl_id])
        if plan_r[plan_idx] == 0:
            continue
        c1 = int(np.sum(plan_r[: plan_idx + 1]))
        if plan_idx > 0:
            c0 = int(np.sum(plan_r[:plan_idx]))
            from_start = to_start = plan_blocks[plan_idx - 1]
        else:
            c0, from_start, to_start = 0, top, 0
        for row in range(from_start, plan_blocks[plan_idx]):
            fill(row, c0, c1, to_start, plan_blocks[plan_idx], plan_r[plan_idx])
    return [head[top : n_blocks - 1] for head in rand]  # drop global_block_top/bottom rows


def _hf_single_row(rng, block_id, to_start, to_end, r):
    """transformers' ``_get_single_block_row_attention`` (window 1+1, one global block each side)."""
    perm = rng.permutation(np.arange(to_start, to_end, dtype=np.int32))
    illegal = set(range(block_id - 1, block_id + 2)) | {0, to_end - 1}
    if block_id == 1:
        illegal.add(to_end - 2)
    if block_id == to_end - 2:
        illegal.add(1)
    chosen = [b for b in perm if b not in illegal][:r]
    return np.array(chosen, dtype=np.int32)


# ----------------------------------------------------------------------------------------------
# other patterns


def _bigbird_etc(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int):
    if spec.plan != "seeded":
        raise ValueError("bigbird_etc has only the 'seeded' plan (transformers does not implement ETC)")
    g_blocks = -(-spec.num_global_tokens // spec.block_size)  # ceil
    if g_blocks >= n_blocks:
        raise ValueError(f"bigbird_etc: {g_blocks} global blocks leave no sequence blocks in {n_blocks}")
    return _window_global_random(spec, n_blocks, num_heads, layer, range(g_blocks))


def _longformer(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int):
    global_rows = _global_mask(n_blocks, spec.global_blocks)
    globals_ = np.flatnonzero(global_rows).tolist()
    head = [[] if global_rows[i] else _sorted_union(globals_, _window(i, spec.window_blocks, n_blocks)) for i in range(n_blocks)]
    return [head] * num_heads, global_rows


def _two_step(a1, a2, spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int):
    """Child et al.'s two sub-patterns combined per ``spec.head_config``."""
    rows_a1 = [a1(i) for i in range(n_blocks)]
    rows_a2 = [a2(i) for i in range(n_blocks)]
    union = [_sorted_union(x, y) for x, y in zip(rows_a1, rows_a2)]
    if spec.head_config == "union":
        heads = [union] * num_heads
    elif spec.head_config == "sequential":
        heads = [rows_a1 if layer % 2 == 0 else rows_a2] * num_heads
    else:  # multihead
        heads = [rows_a1 if h < (num_heads + 1) // 2 else rows_a2 for h in range(num_heads)]
    # every layer gets the same table width, so per-layer tables stack (one ONNX input per kind)
    width = max(len(r) for r in rows_a1 + rows_a2)
    return heads, np.zeros(n_blocks, dtype=bool), width


def _strided(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int):
    return _two_step(
        lambda i: _window(i, spec.window_blocks, n_blocks),
        lambda i: list(range(i % spec.stride, n_blocks, spec.stride)),
        spec, n_blocks, num_heads, layer,
    )


def _fixed(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int):
    s, c = spec.stride, min(spec.summary_blocks, spec.stride)

    def segment(i):
        start = (i // s) * s
        return list(range(start, min(start + s, n_blocks)))

    def summaries(i):
        # last c blocks of every (possibly truncated last) segment
        return [b for start in range(0, n_blocks, s) for b in range(max(start, min(start + s, n_blocks) - c), min(start + s, n_blocks))]

    return _two_step(segment, summaries, spec, n_blocks, num_heads, layer)


def _star(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int):
    relay = n_blocks - 1
    global_rows = _global_mask(n_blocks, (relay,))
    m = n_blocks - 1  # non-relay blocks, neighbours are cyclic among them
    head = []
    for i in range(n_blocks):
        if i == relay:
            head.append([])
        else:
            head.append(_sorted_union([(i - 1) % m, i, (i + 1) % m, relay]))
    return [head] * num_heads, global_rows


def _dense(spec: AttentionSpec, n_blocks: int, num_heads: int, layer: int):
    # every row global: the attention then runs plain full attention (no K = nb gather)
    return [[[]] * n_blocks] * num_heads, np.ones(n_blocks, dtype=bool)


_BUILDERS = {
    "bigbird": _bigbird,
    "bigbird_etc": _bigbird_etc,
    "longformer": _longformer,
    "fixed": _fixed,
    "strided": _strided,
    "star": _star,
    "dense": _dense,
}
