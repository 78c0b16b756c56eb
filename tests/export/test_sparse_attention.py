"""The ONNX lowering of block-sparse attention against a NumPy oracle built from the same
table (dense softmax under a mask that counts duplicated key blocks with multiplicity)."""

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from longdoc.export.graph import GraphBuilder
from longdoc.export.layout_feed import _feed as layout_inputs
from longdoc.export.layout_feed import dense_layout_feed, without_window
from longdoc.export.manifest import SPARSE_GATHER
from longdoc.export.sparse_attention import attention_context, block_sparse_attention, declare_layout_inputs

H, D, BS = 2, 4, 4


def attention_graph(dtype="fp32", heads_per_group=None, sparse=True, gather="gather"):
    g = GraphBuilder("attn", dtype)
    for name in ("q", "k", "v"):
        g.input(name, g.float_type, ["B", "S", H * D])
    g.input("attention_mask", TensorProto.INT64, ["B", "S"])
    if sparse:
        declare_layout_inputs(g)
    ctx = attention_context(g, "attention_mask", BS, H, D, sparse=sparse, heads_per_group=heads_per_group,
                            gather=gather)
    g.output(block_sparse_attention(g, "q", "k", "v", 0, ctx), "out", None, ["B", "S", H * D])
    return ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"])


SESSION = attention_graph(heads_per_group=0)  # all heads at once
GROUPED = attention_graph(heads_per_group=1)  # one head after the other (export/sparse_attention.py)


def oracle(q, k, v, mask, key_blocks, valid, global_rows):
    """Dense reference: weights[i, j] = multiplicity of key j's block in row i's table."""
    B, S, _ = q.shape
    nb = S // BS
    q, k, v = (t.reshape(B, S, H, D).transpose(0, 2, 1, 3) for t in (q, k, v))
    out = np.zeros_like(q)
    for h in range(H):
        count = np.zeros((nb, nb))
        for i in range(nb):
            if global_rows[i]:
                count[i] = 1
            else:
                for slot in range(key_blocks.shape[-1]):
                    if valid[h, i, slot]:
                        count[i, key_blocks[h, i, slot]] += 1
        mult = np.kron(count, np.ones((BS, BS)))  # (S, S)
        logits = q[:, h] @ k[:, h].transpose(0, 2, 1) / np.sqrt(D)  # (B, S, S)
        allowed = mult[None] * mask[:, None, :]
        logits = np.where(allowed > 0, logits, -np.inf)
        with np.errstate(invalid="ignore"):  # fully masked (padded) rows become NaN: don't-care
            w = np.exp(logits - logits.max(-1, keepdims=True)) * np.where(allowed > 0, allowed, 0)
            out[:, h] = (w / w.sum(-1, keepdims=True)) @ v[:, h]
    return out.transpose(0, 2, 1, 3).reshape(B, S, H * D)


def run(q, k, v, mask, feed):
    """Both graphs; head groups must not change the result."""
    inputs = {"q": q, "k": k, "v": v, "attention_mask": mask, **feed}
    out = SESSION.run(None, inputs)[0]
    np.testing.assert_allclose(GROUPED.run(None, inputs)[0], out, atol=1e-6, rtol=1e-6)
    return out


@settings(max_examples=25, deadline=None)
@given(nb=st.integers(2, 9), n_slots=st.integers(1, 5), batch=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_sparse_equals_oracle(nb, n_slots, batch, seed):
    rng = np.random.default_rng(seed)
    S = nb * BS
    q, k, v = (rng.standard_normal((batch, S, H * D)).astype(np.float32) for _ in range(3))
    key_blocks = rng.integers(0, nb, (1, H, nb, n_slots + 1))
    key_blocks[..., 0] = np.arange(nb)[:, None].T  # every row sees its own block, like a window
    valid = rng.random(key_blocks.shape) < 0.7
    valid[..., 0] = True
    global_rows = rng.random(nb) < 0.3
    lengths = rng.integers(1, S + 1, batch)
    lengths[0] = S
    mask = (np.arange(S)[None] < lengths[:, None]).astype(np.int64)
    got = run(q, k, v, mask, layout_inputs(key_blocks, valid, np.flatnonzero(global_rows), nb))
    want = oracle(q, k, v, mask, key_blocks[0], valid[0], global_rows)
    real = mask.astype(bool)  # padded query rows are don't-care; every real row sees itself
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_dense_table_is_full_attention():
    rng = np.random.default_rng(0)
    nb, S = 5, 5 * BS
    q, k, v = (rng.standard_normal((2, S, H * D)).astype(np.float32) for _ in range(3))
    mask = np.ones((2, S), np.int64)
    mask[1, 13:] = 0
    got = run(q, k, v, mask, {n: a[:1] if n.startswith("layout") else a
                              for n, a in dense_layout_feed(1, H, nb).items()})
    want = oracle(q, k, v, mask, np.zeros((H, nb, 0), int), np.zeros((H, nb, 0), bool), np.ones(nb, bool))
    np.testing.assert_allclose(got[mask.astype(bool)], want[mask.astype(bool)], atol=1e-5)


@pytest.mark.parametrize("heads_per_group", [0, 1])
def test_full_attention_graph_in_head_groups(heads_per_group):
    """The full-attention lowering (original_full checkpoints) gives the same result whether its
    heads run at once or one group after another."""
    sess = attention_graph(heads_per_group=heads_per_group, sparse=False)
    rng = np.random.default_rng(3)
    nb, S = 5, 5 * BS
    q, k, v = (rng.standard_normal((2, S, H * D)).astype(np.float32) for _ in range(3))
    mask = np.ones((2, S), np.int64)
    mask[1, 9:] = 0
    got = sess.run(None, {"q": q, "k": k, "v": v, "attention_mask": mask})[0]
    want = oracle(q, k, v, mask, np.zeros((H, nb, 0), int), np.zeros((H, nb, 0), bool), np.ones(nb, bool))
    np.testing.assert_allclose(got[mask.astype(bool)], want[mask.astype(bool)], atol=1e-5)


def test_one_graph_serves_every_length():
    rng = np.random.default_rng(1)
    for nb in (3, 6, 11):
        S = nb * BS
        q, k, v = (rng.standard_normal((1, S, H * D)).astype(np.float32) for _ in range(3))
        kb = rng.integers(0, nb, (1, H, nb, 3))
        got = run(q, k, v, np.ones((1, S), np.int64), layout_inputs(kb, np.ones(kb.shape, bool), np.array([0]), nb))
        want = oracle(q, k, v, np.ones((1, S)), kb[0], np.ones(kb.shape[1:], bool), np.arange(nb) == 0)
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp16"])
def test_fp16_graph_runs(dtype):
    sess = attention_graph(dtype)
    rng = np.random.default_rng(2)
    nb, S = 4, 16
    q, k, v = (rng.standard_normal((1, S, H * D)).astype(np.float16) for _ in range(3))
    kb = rng.integers(0, nb, (1, H, nb, 3))
    feed = layout_inputs(kb, np.ones(kb.shape, bool), np.array([0]), nb)
    got = sess.run(None, {"q": q, "k": k, "v": v, "attention_mask": np.ones((1, S), np.int64), **feed})[0]
    want = oracle(*(t.astype(np.float32) for t in (q, k, v)), np.ones((1, S)), kb[0], np.ones(kb.shape[1:], bool),
                  np.arange(nb) == 0)
    np.testing.assert_allclose(got.astype(np.float32), want, atol=1e-2)


# --- how the windows gather their blocks (`longdoc export --sparse-gather`) -------------------

GATHERS = {gather: attention_graph(gather=gather, heads_per_group=1) for gather in SPARSE_GATHER}


def window_table(rng, nb: int, extra: int) -> tuple[np.ndarray, np.ndarray]:
    """(1, H, nb, 3 + extra) tables whose rows hold their 3-block window (the blocks that exist, in a
    random slot order) and `extra` random slots, some invalid: what BigBird's tables look like."""
    key_blocks = rng.integers(0, nb, (1, H, nb, 3 + extra))
    valid = rng.random(key_blocks.shape) < 0.7
    for h in range(H):
        for i in range(nb):
            slots = rng.permutation(3 + extra)[:3]
            for slot, j in zip(slots, (i - 1, i, i + 1)):
                key_blocks[0, h, i, slot], valid[0, h, i, slot] = max(0, min(j, nb - 1)), 0 <= j < nb
    return key_blocks, valid


@settings(max_examples=25, deadline=None)
@given(nb=st.integers(1, 9), extra=st.integers(0, 4), batch=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_every_sparse_gather_equals_the_oracle(nb, extra, batch, seed):
    """Gather (per head group or all heads), the one-hot product and the window's slices: the same
    attention, each fed its tables (a `window` graph: `without_window`'s); blocks listed twice
    count twice; global rows as the layout says."""
    rng = np.random.default_rng(seed)
    S = nb * BS
    q, k, v = (rng.standard_normal((batch, S, H * D)).astype(np.float32) for _ in range(3))
    key_blocks, valid = window_table(rng, nb, extra)
    global_rows = rng.random(nb) < 0.3
    valid[:, :, global_rows] = False  # a global row lists nothing (model/layout.py `_pack`)
    lengths = rng.integers(1, S + 1, batch)
    lengths[0] = S
    mask = (np.arange(S)[None] < lengths[:, None]).astype(np.int64)
    feed = layout_inputs(key_blocks, valid, np.flatnonzero(global_rows), nb)
    want = oracle(q, k, v, mask, key_blocks[0], valid[0], global_rows)
    real = mask.astype(bool)
    for gather, session in GATHERS.items():
        tables = without_window(feed, 3) if gather == "window" else feed
        got = session.run(None, {"q": q, "k": k, "v": v, "attention_mask": mask, **tables})[0]
        np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5, err_msg=gather)


def test_without_window_keeps_the_other_slots_in_order_and_refuses_a_row_without_its_window():
    key_blocks = np.array([[[[0, 1, 9, 9],  # row 0: window {0, 1} (block -1 does not exist)
                             [2, 0, 1, 2],  # row 1: window {0, 1, 2}; block 2 listed twice counts twice
                             [0, 0, 0, 0],  # row 2: global, lists nothing
                             [9, 2, 3, 0]]]])  # row 3: window {2, 3} (block 4 does not exist); 9 invalid
    valid = np.array([[[[True, True, False, False], [True, True, True, True], [False] * 4,
                        [False, True, True, True]]]])
    out = without_window({"layout_key_blocks": key_blocks, "layout_valid": valid, "global_blocks": np.array([2])}, 3)
    assert out["layout_valid"].tolist() == [[[[False], [True], [False], [True]]]]
    assert out["layout_key_blocks"][0, 0, [1, 3], 0].tolist() == [2, 0]
    assert out["global_blocks"].tolist() == [2]
    valid[0, 0, 1, 2] = False  # row 1 no longer lists block 1 (slot 2)
    with pytest.raises(ValueError, match="query block 1 does not attend to block 1"):
        without_window({"layout_key_blocks": key_blocks, "layout_valid": valid}, 3)


# --- Longformer: band + per-request global tokens ---------------------------------------------

def longformer_graph(block_size: int, heads_per_group: int):
    """q, k, v: local projections; qg_all, kg, vg: the global projections of every token (the graph
    gathers qg_all at the global positions it finds, as the encoder does with its input)."""
    from longdoc.export.sparse_attention import gather_tokens, longformer_context

    g = GraphBuilder("longformer_attn")
    for name in ("q", "k", "v", "qg_all", "kg", "vg"):
        g.input(name, g.float_type, ["B", "S", H * D])
    g.input("attention_mask", TensorProto.INT64, ["B", "S"])
    g.input("global_attention_mask", TensorProto.INT64, ["B", "S"])
    declare_layout_inputs(g, layout_global_rows=False)
    ctx = longformer_context(g, "attention_mask", "global_attention_mask", block_size, H, D)
    ctx = replace(ctx, heads_per_group=heads_per_group)
    qg = gather_tokens(g, "qg_all", ctx.global_tokens.index)
    g.output(block_sparse_attention(g, "q", "k", "v", 0, ctx, (qg, "kg", "vg")), "out", None, ["B", "S", H * D])
    return ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"])


LONGFORMER_SESSIONS = {(bs, hpg): longformer_graph(bs, hpg) for bs in (2, 3, 4) for hpg in (0, 1)}


@settings(max_examples=40, deadline=None)
@given(bs=st.sampled_from([2, 3, 4]), nb=st.integers(1, 7), batch=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       global_share=st.sampled_from([0.0, 0.1, 0.4, 1.0]))
def test_longformer_band_and_global_tokens_equal_the_dense_oracle(bs, nb, batch, seed, global_share):
    """The lowered window (3 blocks of w tokens under a band of w) with the request's global tokens
    (any count per row, none included) equals the model's dense oracle
    (`longdoc.model.attention.dense_reference_attention`) on every real position."""
    import torch

    from longdoc.model.attention import dense_reference_attention, global_tokens, layout_tensors
    from longdoc.model.layout import AttentionSpec, build_layout

    rng = np.random.default_rng(seed)
    S = nb * bs
    q, k, v, qg_all, kg, vg = (rng.standard_normal((batch, S, H * D)).astype(np.float32) for _ in range(6))
    lengths = rng.integers(1, S + 1, batch)
    lengths[0] = S
    mask = (np.arange(S)[None] < lengths[:, None]).astype(np.int64)
    gm = (rng.random((batch, S)) < global_share).astype(np.int64)  # may mark padding: never global
    layout = build_layout(AttentionSpec(pattern="longformer", block_size=bs, window_blocks=3, global_blocks=(),
                                        band=bs), nb, H, 0)
    feed = {"layout_key_blocks": layout.key_blocks[None].astype(np.int64), "layout_valid": layout.valid[None]}
    inputs = {"q": q, "k": k, "v": v, "qg_all": qg_all, "kg": kg, "vg": vg, "attention_mask": mask,
              "global_attention_mask": gm, **feed}
    got = LONGFORMER_SESSIONS[bs, 0].run(None, inputs)[0]
    np.testing.assert_allclose(LONGFORMER_SESSIONS[bs, 1].run(None, inputs)[0], got, atol=1e-6, rtol=1e-6)

    def heads(x):  # (B, S, H*D) -> (B, H, S, D)
        return torch.from_numpy(x).view(batch, -1, H, D).transpose(1, 2)

    tokens = global_tokens(torch.from_numpy(gm), torch.from_numpy(mask))
    global_qkv = None
    if tokens is not None:
        q_rows = torch.gather(heads(qg_all), 2, tokens.index.view(batch, 1, -1, 1).expand(batch, H, -1, D))
        global_qkv = (q_rows, heads(kg), heads(vg))
    want = dense_reference_attention(heads(q), heads(k), heads(v), layout_tensors(layout), torch.from_numpy(mask),
                                     global_tokens=tokens, global_qkv=global_qkv)
    want = want.transpose(1, 2).reshape(batch, S, H * D).numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5)
