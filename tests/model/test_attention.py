"""Block-sparse attention: equals the dense oracle for every pattern, and transformers' BigBird."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longdoc.model.attention import (
    MASK_PENALTY,
    LayoutTensors,
    block_sparse_attention,
    dense_reference_attention,
    global_tokens,
    layout_tensors,
)
from longdoc.model.layout import PATTERNS, AttentionSpec, build_layout

torch.set_num_threads(1)


def _qkv(B, H, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(3)]


@settings(max_examples=40, deadline=None)
@given(
    pattern=st.sampled_from(PATTERNS),
    plan=st.sampled_from(["hf-train", "hf-eval", "seeded"]),
    n_blocks=st.integers(5, 14),
    block_size=st.sampled_from([1, 2, 4]),
    num_heads=st.integers(1, 3),
    batch=st.integers(1, 3),
    r=st.integers(0, 3),
    layer=st.integers(0, 3),
    pad=st.lists(st.integers(0, 30), min_size=3, max_size=3),
    seed=st.integers(0, 1000),
)
def test_sparse_equals_dense_reference(pattern, plan, n_blocks, block_size, num_heads, batch, r, layer, pad, seed):
    if pattern == "bigbird_etc":
        plan = "seeded"
    if pattern == "bigbird" and plan == "hf-train":
        n_blocks = max(n_blocks, 6 + 2 * r)  # lengths transformers runs block-sparse
    spec = AttentionSpec(pattern, block_size, num_random_blocks=r, plan=plan, seed=seed, num_global_tokens=block_size + 1, stride=3)
    lt = layout_tensors(build_layout(spec, n_blocks, num_heads, layer))
    S, D = n_blocks * block_size, 4
    q, k, v = _qkv(batch, num_heads, S, D, seed)
    key_mask = torch.ones(batch, S)
    for b in range(batch):
        key_mask[b, S - min(pad[b], S - 1) :] = 0  # right padding, at least one real token
    out = block_sparse_attention(q, k, v, lt, key_mask)
    ref = dense_reference_attention(q, k, v, lt, key_mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (out.transpose(1, 2)[key_mask == 0] == 0).all()  # padded query positions are zero


def _longformer_case(n_blocks, w, num_heads, batch, global_rows_of, pad, seed, global_blocks=()):
    """Longformer-style inputs: window blocks of w tokens under a band of w, per-row global tokens."""
    spec = AttentionSpec("longformer", w, window_blocks=3, global_blocks=global_blocks, band=w)
    lt = layout_tensors(build_layout(spec, n_blocks, num_heads, 0))
    S, D = n_blocks * w, 4
    q, k, v = _qkv(batch, num_heads, S, D, seed)
    key_mask = torch.ones(batch, S)
    gmask = torch.zeros(batch, S, dtype=torch.long)
    for b in range(batch):
        key_mask[b, S - min(pad[b], S - 1) :] = 0
        gmask[b, [p % S for p in global_rows_of[b]]] = 1
    return lt, q, k, v, key_mask, global_tokens(gmask, key_mask)


@settings(max_examples=40, deadline=None)
@given(
    n_blocks=st.integers(1, 9),
    w=st.sampled_from([1, 2, 3, 4]),
    num_heads=st.integers(1, 3),
    batch=st.integers(1, 3),
    globals_=st.lists(st.lists(st.integers(0, 40), max_size=4), min_size=3, max_size=3),
    pad=st.lists(st.integers(0, 12), min_size=3, max_size=3),
    global_blocks=st.sampled_from([(), (0,), (-1,)]),
    own_projections=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_band_and_global_tokens_sparse_equals_dense_reference(n_blocks, w, num_heads, batch, globals_, pad, global_blocks, own_projections, seed):
    lt, q, k, v, key_mask, gt = _longformer_case(n_blocks, w, num_heads, batch, globals_, pad, seed, global_blocks)
    qkv = None
    if gt is not None and own_projections:  # Longformer's query_global / key_global / value_global
        qg, kg, vg = _qkv(*q.shape, seed + 1)
        qkv = (torch.gather(qg, 2, gt.index.view(batch, 1, -1, 1).expand(-1, num_heads, -1, q.shape[-1])), kg, vg)
    out = block_sparse_attention(q, k, v, lt, key_mask, global_tokens=gt, global_qkv=qkv)
    ref = dense_reference_attention(q, k, v, lt, key_mask, global_tokens=gt, global_qkv=qkv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (out.transpose(1, 2)[key_mask == 0] == 0).all()


def test_band_and_global_tokens_change_the_answer():
    """The band, the global key slots and the global rows each matter (the oracle can fail)."""
    lt, q, k, v, key_mask, gt = _longformer_case(8, 4, 2, 2, [[0, 13], [30]], [0, 5], 1)
    out = block_sparse_attention(q, k, v, lt, key_mask, global_tokens=gt)
    whole_blocks = block_sparse_attention(q, k, v, lt._replace(band=0), key_mask, global_tokens=gt)
    assert (out - whole_blocks).abs().max() > 1e-2
    no_globals = block_sparse_attention(q, k, v, lt, key_mask)
    far = out[0, :, 24:28]  # block 6 of row 0: no global token in its window
    assert (far - no_globals[0, :, 24:28]).abs().max() > 1e-2
    torch.testing.assert_close(out, dense_reference_attention(q, k, v, lt, key_mask, global_tokens=gt), atol=1e-5, rtol=1e-5)
    # a global token's row attends to every real key: the full softmax row
    s = torch.einsum("hd,hsd->hs", q[0, :, 13], k[0]) / 2.0  # (H, S), D = 4, no padding in row 0
    torch.testing.assert_close(out[0, :, 13], torch.einsum("hs,hsd->hd", s.softmax(-1), v[0]), atol=1e-5, rtol=1e-5)


def test_global_tokens_gradients_match_dense_reference():
    lt, *_, key_mask, gt = _longformer_case(6, 2, 2, 2, [[0, 5], [11]], [0, 3], 0)
    grads = []
    for attention in (block_sparse_attention, dense_reference_attention):
        q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 12, 4, 9))
        (attention(q, k, v, lt, key_mask, global_tokens=gt) ** 2).sum().backward()
        grads.append([q.grad, k.grad, v.grad])
    for sparse_grad, dense_grad in zip(*grads):
        torch.testing.assert_close(sparse_grad, dense_grad, atol=1e-5, rtol=1e-5)


def test_no_global_tokens_is_none():
    key_mask = torch.ones(2, 8)
    key_mask[1, 4:] = 0
    assert global_tokens(torch.zeros(2, 8), key_mask) is None
    gmask = torch.zeros(2, 8)
    gmask[1, 6] = 1  # a padded position is never global
    assert global_tokens(gmask, key_mask) is None
    gmask[0, [1, 5]] = 1
    gt = global_tokens(gmask, key_mask)
    assert gt.index[0].tolist() == [1, 5] and gt.valid.tolist() == [[True, True], [False, False]]
    assert gt.slot[0, 5].item() == 1 and not gt.is_global[1].any()


def test_duplicates_count_with_multiplicity():
    # hf-eval: block 0 counted r+1 times in every non-global row; the oracle must agree
    spec = AttentionSpec("bigbird", 2, num_random_blocks=3, plan="hf-eval")
    lt = layout_tensors(build_layout(spec, 8, 2, 0))
    q, k, v = _qkv(2, 2, 16, 4, 0)
    key_mask = torch.ones(2, 16)
    key_mask[1, 11:] = 0
    out = block_sparse_attention(q, k, v, lt, key_mask)
    torch.testing.assert_close(out, dense_reference_attention(q, k, v, lt, key_mask), atol=1e-5, rtol=1e-5)
    # ignoring multiplicity (a 0/1 mask) gives a different answer: the test can fail
    single = lt._replace(valid=lt.valid & (torch.arange(lt.valid.shape[-1]) < 5))
    assert (block_sparse_attention(q, k, v, single, key_mask) - out).abs().max() > 1e-3
    assert MASK_PENALTY == -10000.0


def _hf_block_sparse(S, block_size, r, train, layer, max_position_embeddings=4096, H=2, D=8, B=2):
    from transformers import BigBirdConfig
    from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention, BigBirdModel

    config = BigBirdConfig(
        hidden_size=H * D, num_attention_heads=H, block_size=block_size, num_random_blocks=r,
        max_position_embeddings=max_position_embeddings, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(layer)
    attn = BigBirdBlockSparseAttention(config, seed=layer).train(train)
    x = torch.randn(B, S, H * D)
    mask = torch.ones(B, S)
    mask[-1, S - block_size - 7 :] = 0  # a padded batch element (last block fully padded)
    blocked, band, from_mask, to_mask = BigBirdModel.create_masks_for_block_sparse_attn(mask, block_size)
    state = np.random.get_state()
    with torch.no_grad():
        ref, _ = attn(x, band, from_mask, to_mask, blocked, blocked)
        q, k, v = (lin(x).view(B, S, H, D).transpose(1, 2) for lin in (attn.query, attn.key, attn.value))  # (B, H, S, D)
    np.random.set_state(state)  # transformers reseeds the global RNG in train mode; undo
    return ref, q, k, v, mask


@pytest.mark.parametrize(
    "S,block_size,r",
    [(1024, 16, 3), (1024, 32, 2), (1024, 64, 1), (1024, 64, 3), (256, 16, 1), (512, 32, 3), (704, 64, 2), (448, 32, 3), (1216, 64, 3)],
)
@pytest.mark.parametrize("plan", ["hf-train", "hf-eval"])
def test_matches_transformers_block_sparse(S, block_size, r, plan):
    layer = 3
    H = 2
    ref, q, k, v, mask = _hf_block_sparse(S, block_size, r, plan == "hf-train", layer, H=H)
    spec = AttentionSpec("bigbird", block_size, num_random_blocks=r, plan=plan, max_position_embeddings=4096)
    lt = layout_tensors(build_layout(spec, S // block_size, H, layer))
    out = block_sparse_attention(q, k, v, lt, mask).transpose(1, 2).reshape(ref.shape)  # (B, S, H*D)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    dense = dense_reference_attention(q, k, v, lt, mask).transpose(1, 2).reshape(ref.shape)
    torch.testing.assert_close(dense, ref, atol=1e-5, rtol=0)
    if plan == "hf-train":  # the other plan's blocks give a different answer: the test can fail
        other = layout_tensors(build_layout(AttentionSpec("bigbird", block_size, num_random_blocks=r, plan="hf-train"), S // block_size, H, layer + 1))
        wrong = block_sparse_attention(q, k, v, other, mask).transpose(1, 2).reshape(ref.shape)
        assert (wrong - ref).abs().max() > 1e-3


@pytest.mark.parametrize("S,r", [(3072, 2), (4096, 3)])
def test_matches_transformers_at_long_legacy_lengths(S, r):
    # the other two legacy lengths at BigBird-base's block size; one head keeps it small
    ref, q, k, v, mask = _hf_block_sparse(S, 64, r, True, 5, H=1, B=1)
    lt = layout_tensors(build_layout(AttentionSpec("bigbird", 64, num_random_blocks=r, plan="hf-train"), S // 64, 1, 5))
    out = block_sparse_attention(q, k, v, lt, mask).transpose(1, 2).reshape(ref.shape)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_matches_transformers_legacy_plan_with_short_max_positions():
    ref, q, k, v, mask = _hf_block_sparse(1024, 32, 3, True, 1, max_position_embeddings=1024)
    spec = AttentionSpec("bigbird", 32, num_random_blocks=3, plan="hf-train", max_position_embeddings=1024)
    lt = layout_tensors(build_layout(spec, 32, 2, 1))
    out = block_sparse_attention(q, k, v, lt, mask).transpose(1, 2).reshape(ref.shape)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_pegasus_copy_matches_too():
    from transformers import BigBirdPegasusConfig
    from transformers.models.big_bird.modeling_big_bird import BigBirdModel
    from transformers.models.bigbird_pegasus.modeling_bigbird_pegasus import BigBirdPegasusBlockSparseAttention

    H, D, B, S, bs, r, layer = 2, 8, 2, 640, 32, 3, 2
    config = BigBirdPegasusConfig(d_model=H * D, encoder_attention_heads=H, block_size=bs, num_random_blocks=r, max_position_embeddings=4096)
    attn = BigBirdPegasusBlockSparseAttention(config, seed=layer).train(True)
    x = torch.randn(B, S, H * D)
    mask = torch.ones(B, S)
    mask[0, -50:] = 0
    blocked, band, from_mask, to_mask = BigBirdModel.create_masks_for_block_sparse_attn(mask, bs)
    state = np.random.get_state()
    with torch.no_grad():
        ref, _ = attn(x, band, from_mask, to_mask, blocked, blocked)
        q, k, v = (lin(x).view(B, S, H, D).transpose(1, 2) for lin in (attn.query, attn.key, attn.value))
    np.random.set_state(state)
    lt = layout_tensors(build_layout(AttentionSpec("bigbird", bs, num_random_blocks=r, plan="hf-train"), S // bs, H, layer))
    out = block_sparse_attention(q, k, v, lt, mask).transpose(1, 2).reshape(ref.shape)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


class _Exportable(torch.nn.Module):
    """block_sparse_attention with the layout as plain tensor inputs."""

    def forward(self, q, k, v, key_blocks, valid, global_index, row_source, key_mask):
        lt = LayoutTensors(key_blocks, valid, row_source >= key_blocks.shape[1], global_index, row_source)
        return block_sparse_attention(q, k, v, lt, key_mask)


def test_exports_to_onnx_with_layout_as_inputs(tmp_path):
    # no data-dependent control flow: one trace serves every n_blocks (and a TracerWarning,
    # an error here, would mean a value got baked in)
    import onnxruntime as ort

    names = ["q", "k", "v", "key_blocks", "valid", "global_index", "row_source", "key_mask"]

    def inputs(nb, bs=4, H=2, D=8, B=2):
        lt = layout_tensors(build_layout(AttentionSpec("bigbird", bs, 2, plan="hf-train"), nb, H, 1))
        q, k, v = _qkv(B, H, nb * bs, D, nb)
        key_mask = torch.ones(B, nb * bs)
        key_mask[1, -5:] = 0
        return (q, k, v, lt.key_blocks, lt.valid, lt.global_index, lt.row_source, key_mask)

    path = tmp_path / "attention.onnx"
    dynamic = {"q": {2: "S"}, "k": {2: "S"}, "v": {2: "S"}, "key_blocks": {1: "nb"}, "valid": {1: "nb"}, "row_source": {0: "nb"}, "key_mask": {1: "S"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's own notice
        torch.onnx.export(_Exportable(), inputs(12), str(path), input_names=names, output_names=["out"], dynamic_axes=dynamic, opset_version=17, dynamo=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for nb in (12, 21):
        args = inputs(nb)
        (got,) = session.run(None, {n: a.numpy() for n, a in zip(names, args)})
        np.testing.assert_allclose(got, _Exportable()(*args).numpy(), atol=1e-5)


@pytest.mark.parametrize("pattern", ["bigbird", "fixed", "star"])
def test_gradients_match_dense_reference(pattern):
    spec = AttentionSpec(pattern, 2, num_random_blocks=2, plan="seeded", stride=3)
    lt = layout_tensors(build_layout(spec, 9, 2, 0))
    key_mask = torch.ones(2, 18)
    key_mask[0, -3:] = 0
    grads = []
    for attention in (block_sparse_attention, dense_reference_attention):
        q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 18, 4, 7))
        (attention(q, k, v, lt, key_mask) ** 2).sum().backward()
        grads.append([q.grad, k.grad, v.grad])
    for sparse_grad, dense_grad in zip(*grads):
        torch.testing.assert_close(sparse_grad, dense_grad, atol=1e-5, rtol=1e-5)


def test_half_precision_stays_finite():
    # padding slots must not become -inf in fp16/bf16 (a global row has only padding slots in
    # the sparse part; -inf there would give NaN, and NaN gradients through the gather)
    lt = layout_tensors(build_layout(AttentionSpec("bigbird", 4, 2, plan="hf-eval"), 10, 2, 0))
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(1, 2, 40, 8, 3))
        key_mask = torch.ones(1, 40)
        key_mask[0, -6:] = 0
        out = block_sparse_attention(q, k, v, lt, key_mask)
        out.float().sum().backward()
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        ref = dense_reference_attention(*(t.detach().float() for t in (q, k, v)), lt, key_mask)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_half_precision_with_global_tokens_stays_finite():
    lt, q, k, v, key_mask, gt = _longformer_case(6, 4, 2, 2, [[0, 9], []], [0, 7], 2)
    for dtype in (torch.float16, torch.bfloat16):
        out = block_sparse_attention(q.to(dtype), k.to(dtype), v.to(dtype), lt, key_mask, global_tokens=gt)
        assert out.dtype == dtype and torch.isfinite(out).all()
        ref = dense_reference_attention(q, k, v, lt, key_mask, global_tokens=gt)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_fp16_autocast_gradients_stay_finite():
    # under autocast q is fp32 but the scores are fp16: the bias must be built in fp16
    lt = layout_tensors(build_layout(AttentionSpec("bigbird", 4, 2, plan="hf-eval"), 10, 2, 0))
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 40, 8, 5))
    with torch.autocast("cpu", dtype=torch.float16):
        out = block_sparse_attention(q, k, v, lt, torch.ones(1, 40))
    out.float().sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
