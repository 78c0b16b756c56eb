"""Layouts: structure properties per pattern, determinism, no torch, no global RNG."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longdoc.model.layout import PATTERNS, AttentionSpec, build_layout, hf_random_blocks


def _spec(pattern, plan, block_size=16, **kw):
    if pattern == "bigbird_etc":
        plan, kw = "seeded", {"num_global_tokens": 2 * block_size - 3, **kw}
    return AttentionSpec(pattern, block_size, plan=plan, **kw)


def _rows(layout, h, i):
    return layout.key_blocks[h, i][layout.valid[h, i]].tolist()


@settings(max_examples=60, deadline=None)
@given(
    n_blocks=st.integers(5, 40),
    num_heads=st.integers(1, 3),
    layer=st.integers(0, 11),
    r=st.integers(0, 3),
    k=st.integers(1, 3),
    window=st.sampled_from([1, 3, 5]),
    seed=st.integers(0, 2**16),
)
def test_seeded_bigbird_rows_hold_window_globals_and_distinct_randoms(n_blocks, num_heads, layer, r, k, window, seed):
    spec = AttentionSpec("bigbird", 16, num_random_blocks=r, num_global_blocks=k, window_blocks=window, plan="seeded", seed=seed)
    layout = build_layout(spec, n_blocks, num_heads, layer)
    globals_ = set(range(min(k, n_blocks))) | {n_blocks - 1}
    assert set(np.flatnonzero(layout.global_rows)) == globals_
    for h in range(num_heads):
        for i in range(n_blocks):
            if i in globals_:
                continue
            row = _rows(layout, h, i)
            window_set = {j for j in range(i - window // 2, i + window // 2 + 1) if 0 <= j < n_blocks}
            assert window_set | globals_ <= set(row)
            assert len(row) == len(set(row)), "seeded rows have no duplicates"
            randoms = set(row) - window_set - globals_
            assert len(randoms) == min(r, n_blocks - len(window_set | globals_))


@settings(max_examples=40, deadline=None)
@given(n_blocks=st.integers(8, 70), num_heads=st.integers(1, 3), layer=st.integers(0, 5), r=st.integers(1, 3), block_size=st.sampled_from([16, 32, 64]))
def test_hf_rows_have_transformers_structure(n_blocks, num_heads, layer, r, block_size):
    n_blocks = max(n_blocks, 6 + 2 * r)  # the lengths transformers runs block-sparse
    for plan in ("hf-train", "hf-eval"):
        layout = build_layout(AttentionSpec("bigbird", block_size, num_random_blocks=r, plan=plan), n_blocks, num_heads, layer)
        nb = n_blocks
        assert np.flatnonzero(layout.global_rows).tolist() == [0, nb - 1]
        assert layout.width == 5 + r
        for h in range(num_heads):
            assert _rows(layout, h, 1)[:4] == [0, 1, 2, nb - 1]
            assert _rows(layout, h, nb - 2)[:4] == [0, nb - 3, nb - 2, nb - 1]
            for i in range(2, nb - 2):
                assert _rows(layout, h, i)[:5] == [0, i - 1, i, i + 1, nb - 1]
            for i in range(1, nb - 1):
                randoms = _rows(layout, h, i)[5 if 2 <= i <= nb - 3 else 4 :]
                assert len(randoms) == r
                if plan == "hf-eval":
                    assert randoms == [0] * r  # transformers' eval mode: block 0 counted r+1 times
                    assert layout.counts()[h, i, 0] == r + 1


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_pattern_builds_and_rows_hold_globals(pattern):
    for n_blocks in (5, 8, 13):
        layout = build_layout(_spec(pattern, "seeded", num_random_blocks=2), n_blocks, 2, 1)
        assert layout.key_blocks.shape == layout.valid.shape == (2, n_blocks, layout.width)
        assert layout.key_blocks.dtype == np.int64 and layout.valid.dtype == bool and layout.global_rows.dtype == bool
        counts = layout.counts()
        g = layout.global_rows
        assert (counts[:, g, :] == 1).all()
        assert (counts[:, :, g] >= 1).all(), "every row attends to every global block"
        assert (counts[:, ~g, :].sum(-1) >= 1).all()
        assert (np.diagonal(counts, axis1=1, axis2=2) >= 1).all(), "every block attends to itself"


def test_pattern_specifics():
    nb = 12
    lf = build_layout(AttentionSpec("longformer", 16, window_blocks=3, global_blocks=(0, -1)), nb, 1, 0)
    assert np.flatnonzero(lf.global_rows).tolist() == [0, nb - 1]
    assert _rows(lf, 0, 5) == [0, 4, 5, 6, nb - 1]

    strided = build_layout(AttentionSpec("strided", 16, window_blocks=3, stride=4), nb, 4, 0)
    assert _rows(strided, 0, 5) == [1, 4, 5, 6, 9]
    seq = [build_layout(AttentionSpec("strided", 16, stride=4, head_config="sequential"), nb, 2, layer) for layer in (0, 1)]
    assert _rows(seq[0], 0, 5) == [4, 5, 6] and _rows(seq[1], 0, 5) == [1, 5, 9]
    multi = build_layout(AttentionSpec("strided", 16, stride=4, head_config="multihead"), nb, 2, 0)
    assert _rows(multi, 0, 5) == [4, 5, 6] and _rows(multi, 1, 5) == [1, 5, 9]

    fixed = build_layout(AttentionSpec("fixed", 16, stride=4, summary_blocks=1), nb, 1, 0)
    assert _rows(fixed, 0, 5) == [3, 4, 5, 6, 7, 11]

    star = build_layout(AttentionSpec("star", 16), nb, 1, 0)
    assert np.flatnonzero(star.global_rows).tolist() == [nb - 1]
    assert _rows(star, 0, 0) == [0, 1, nb - 2, nb - 1]  # cyclic neighbours + relay
    assert _rows(star, 0, 5) == [4, 5, 6, nb - 1]

    etc = build_layout(AttentionSpec("bigbird_etc", 16, plan="seeded", num_global_tokens=20, num_random_blocks=1), nb, 1, 0)
    assert np.flatnonzero(etc.global_rows).tolist() == [0, 1]  # ceil(20 / 16) prepended global blocks
    assert {0, 1, 4, 5, 6} <= set(_rows(etc, 0, 5)) and len(_rows(etc, 0, 5)) == 6

    dense = build_layout(AttentionSpec("dense", 16), nb, 1, 0)
    assert (dense.counts() == 1).all()


def test_hf_plans_reject_what_transformers_cannot_do():
    with pytest.raises(ValueError, match="seeded"):
        build_layout(AttentionSpec("bigbird", 16, num_global_blocks=2), 20, 1, 0)
    with pytest.raises(ValueError, match="seeded"):
        build_layout(AttentionSpec("bigbird_etc", 16, num_global_tokens=8), 20, 1, 0)
    with pytest.raises(ValueError, match="random blocks"):
        build_layout(AttentionSpec("bigbird", 32, num_random_blocks=3), 10, 1, 0)  # transformers fails too
    with pytest.raises(ValueError, match="pattern"):
        AttentionSpec("bogus", 16)


def test_hf_train_legacy_lengths_depend_on_max_position_embeddings():
    # at 1024 tokens transformers draws its rows over max_position_embeddings positions per head
    # (the candidate pools differ, and later heads continue a longer stream)
    a = hf_random_blocks(AttentionSpec("bigbird", 64, max_position_embeddings=4096), 16, 2, 3, training=True)
    b = hf_random_blocks(AttentionSpec("bigbird", 64, max_position_embeddings=1024), 16, 2, 3, training=True)
    assert not np.array_equal(a[0], b[0]) and not np.array_equal(a[1], b[1])
    assert a.max() <= 1024 // 64 - 1  # legacy plan: random blocks within the first 1024 tokens


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("plan", ["hf-train", "hf-eval", "seeded"])
def test_deterministic_and_global_rng_untouched(pattern, plan):
    if pattern == "bigbird_etc" and plan != "seeded":
        return
    state = np.random.get_state()
    spec = _spec(pattern, plan)
    first = build_layout(spec, 64, 3, 2)
    # a fresh, equal spec object (not the cached one) must give identical tables
    second = build_layout(AttentionSpec.from_dict(json.loads(json.dumps(spec.to_dict()))), 64, 3, 2)
    after = np.random.get_state()
    assert after[0] == state[0] and (after[1] == state[1]).all() and after[2:] == state[2:]
    for name in ("key_blocks", "valid", "global_rows"):
        assert np.array_equal(getattr(first, name), getattr(second, name))
    assert not first.key_blocks.flags.writeable


def test_seeded_plan_depends_on_seed_layer_head_length():
    spec = AttentionSpec("bigbird", 16, plan="seeded", seed=1)
    base = build_layout(spec, 40, 2, 0).key_blocks
    assert not np.array_equal(base[0], base[1])  # heads differ
    assert not np.array_equal(base, build_layout(spec, 40, 2, 1).key_blocks)  # layers differ
    assert not np.array_equal(base, build_layout(AttentionSpec("bigbird", 16, plan="seeded", seed=2), 40, 2, 0).key_blocks)


def test_layout_module_imports_no_torch():
    code = (
        "import sys, longdoc.model.layout, longdoc.model.lengths; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("head_config", ["union", "sequential", "multihead"])
def test_layers_share_shapes_so_tables_stack(pattern, head_config):
    # model/ stacks per-layer tables into one tensor per kind for export
    spec = _spec(pattern, "seeded", head_config=head_config, num_random_blocks=2)
    layouts = [build_layout(spec, 11, 2, layer) for layer in range(4)]
    assert len({lay.key_blocks.shape for lay in layouts}) == 1
    assert len({tuple(lay.global_index) for lay in layouts}) == 1


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(
        [("bigbird", "hf-train"), ("bigbird", "hf-eval"), ("bigbird", "seeded"), ("bigbird_etc", "seeded"), ("longformer", "seeded"), ("strided", "seeded")]
    ),
    n_blocks=st.integers(5, 48),
    num_heads=st.integers(1, 3),
    layer=st.integers(0, 7),
    r=st.integers(1, 3),
    window=st.sampled_from([1, 3, 5]),
    globals_=st.lists(st.integers(-6, 5), min_size=1, max_size=3),
)
def test_every_non_global_row_holds_its_window_and_the_globals(case, n_blocks, num_heads, layer, r, window, globals_):
    pattern, plan = case
    if pattern == "bigbird" and plan != "seeded":
        window, n_blocks = 3, max(n_blocks, 6 + 2 * r)  # transformers' only window; its sparse lengths
    spec = AttentionSpec(pattern, 8, num_random_blocks=r, window_blocks=window, plan=plan, global_blocks=tuple(globals_), num_global_tokens=9)
    layout = build_layout(spec, n_blocks, num_heads, layer)
    g = np.flatnonzero(layout.global_rows)
    if pattern == "longformer":
        # a global block index beyond a short sequence does not exist (model/layout.py _global_mask)
        assert set(g.tolist()) == {b % n_blocks for b in globals_ if -n_blocks <= b < n_blocks}
    else:
        assert g.size >= 1 or pattern == "strided"
    for h in range(num_heads):
        for i in np.flatnonzero(~layout.global_rows):
            row = set(_rows(layout, h, i))
            window_set = set(range(max(0, i - window // 2), min(n_blocks, i + window // 2 + 1)))
            assert window_set <= row and set(g.tolist()) <= row


def test_longformer_specs_per_layer():
    from longdoc.model.layout import longformer_attention_specs

    specs = longformer_attention_specs({"num_hidden_layers": 3, "attention_window": [16, 512, 16]})
    assert [(s.block_size, s.band, s.window_blocks, s.global_blocks) for s in specs] == [(8, 8, 3, ()), (256, 256, 3, ()), (8, 8, 3, ())]
    assert specs[0] == specs[2] and len(longformer_attention_specs({"num_hidden_layers": 2, "attention_window": 32})) == 2
    for bad in ([16], [16, 15], [16, 0]):
        with pytest.raises(ValueError, match="attention_window"):
            longformer_attention_specs({"num_hidden_layers": 2, "attention_window": bad})
    layout = build_layout(specs[0], 5, 2, 0)
    assert layout.band == 8 and not layout.global_rows.any()
    assert _rows(layout, 1, 0) == [0, 1] and _rows(layout, 1, 2) == [1, 2, 3]


def test_band_is_checked():
    with pytest.raises(ValueError, match="longformer"):
        AttentionSpec("bigbird", 8, band=4)
    with pytest.raises(ValueError, match="beyond the window"):
        AttentionSpec("longformer", 8, window_blocks=3, band=9)
    assert AttentionSpec.from_dict(AttentionSpec("longformer", 8, band=8).to_dict()).band == 8


def _token_mask(layout, seq_len: int) -> np.ndarray:
    """(S, S) bool: which keys each query token of head 0 sees through a `longformer` layout (its row's
    key blocks, under the band)."""
    bs = seq_len // layout.n_blocks
    mask = np.zeros((seq_len, seq_len), bool)
    for i in range(layout.n_blocks):
        for j in _rows(layout, 0, i):
            for q in range(i * bs, (i + 1) * bs):
                for k in range(j * bs, (j + 1) * bs):
                    mask[q, k] = abs(q - k) <= layout.band
    return mask


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from([4, 8, 12, 16, 24, 32]), min_size=1, max_size=4), st.integers(1, 6))
def test_longformer_layer_specs_over_one_block_size_see_each_layers_window(windows, multiple):
    """Per-layer windows over the common block size (the gcd of the layers' w) hold exactly the keys
    each layer's own 3 blocks of w do: every key at most w tokens away."""
    from longdoc.model.layout import longformer_attention_specs, longformer_block_size, longformer_layer_specs

    config = {"num_hidden_layers": len(windows), "attention_window": windows}
    b = longformer_block_size(config)
    assert all((w // 2) % b == 0 for w in windows) and b == np.gcd.reduce([w // 2 for w in windows])
    seq_len = int(np.lcm.reduce([w // 2 for w in windows])) * multiple  # a multiple of every block size
    for layer, (own, shared) in enumerate(zip(longformer_attention_specs(config), longformer_layer_specs(config))):
        assert shared.block_size == b and shared.band == own.band
        want = np.abs(np.arange(seq_len)[:, None] - np.arange(seq_len)[None]) <= own.band
        for spec in (own, shared):
            assert np.array_equal(_token_mask(build_layout(spec, seq_len // spec.block_size, 1, layer), seq_len), want)
    if len(set(windows)) == 1:  # one window: the export's spec is the model's own
        assert longformer_layer_specs(config) == longformer_attention_specs(config)
