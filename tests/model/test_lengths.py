"""Sequence-length decisions (transformers' full-attention threshold and block padding)."""

import pytest

from longdoc.model.lengths import LengthPlan, full_attention_max_length, plan_length


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("r", [1, 2, 3])
def test_threshold_both_sides_and_padding(block_size, r):
    limit = (5 + 2 * r) * block_size
    assert full_attention_max_length(block_size, r) == limit
    assert plan_length(limit, block_size, r, "block_sparse") == LengthPlan(limit, "full")
    assert plan_length(limit - 1, block_size, r, "block_sparse") == LengthPlan(limit - 1, "full")
    above = plan_length(limit + 1, block_size, r, "block_sparse")
    assert above == LengthPlan(limit + block_size, "block_sparse")
    assert above.n_blocks(block_size) == 6 + 2 * r
    assert plan_length(1024, block_size, r, "block_sparse") == LengthPlan(1024, "block_sparse")
    assert plan_length(4000, block_size, r, "original_full") == LengthPlan(4000, "full")


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        plan_length(100, 64, 3, "sparse")
    with pytest.raises(ValueError):
        plan_length(0, 64, 3, "block_sparse")
    with pytest.raises(ValueError):
        plan_length(100, 64, 3, "original_full").n_blocks(64)
