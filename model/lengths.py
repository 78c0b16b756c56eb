"""Sequence-length decisions, made once before ``forward`` (NumPy-free, torch-free).

transformers' BigBird (``BigBirdModel.forward``) and BigBirdPegasus' encoder
(``BigBirdPegasusEncoder.forward``) decide two things from the input length:

1. Full attention for short inputs. With ``attention_type == "block_sparse"`` and
   ``seq_len <= (5 + 2 * num_random_blocks) * block_size`` (2 global + 3 window + r random blocks
   + r blocks of buffer) they switch to full attention. ``seq_len`` there is the length of the
   input tensor *before* padding to a block multiple (``input_ids.size(1)`` in BigBird,
   ``inputs_embeds.size()[:-1][1]`` in Pegasus): the same rule in both models. It is the batch's
   tensor length, so pad tokens added by batching count; the number of real tokens does not
   matter. transformers makes the switch by mutating the module (``set_attention_type``), so it
   sticks for every later call; here it is a pure function of the length, decided per call.
2. Padding to a multiple of ``block_size`` (only on the block-sparse path; full attention runs on
   the unpadded length). The padded tokens are masked (attention_mask 0) and stripped from the
   outputs afterwards.

With ``attention_type == "original_full"`` nothing is padded and attention is full.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

ATTENTION_TYPES = ("block_sparse", "original_full")


class LengthPlan(NamedTuple):
    padded_len: int  # length the encoder runs on (a block multiple when attention == "block_sparse")
    attention: Literal["block_sparse", "full"]

    def n_blocks(self, block_size: int) -> int:
        """Number of blocks of the block-sparse layout for this plan."""
        if self.attention != "block_sparse":
            raise ValueError("full attention has no block layout")
        return self.padded_len // block_size


def full_attention_max_length(block_size: int, num_random_blocks: int) -> int:
    """Longest input length that transformers runs with full attention: (5 + 2r) * block_size."""
    return (5 + 2 * num_random_blocks) * block_size


def plan_length(seq_len: int, block_size: int, num_random_blocks: int, attention_type: str) -> LengthPlan:
    """The attention and padded length transformers would use for an input tensor of ``seq_len``."""
    if attention_type not in ATTENTION_TYPES:
        raise ValueError(f"attention_type must be one of {ATTENTION_TYPES}, got {attention_type!r}")
    if seq_len < 1 or block_size < 1 or num_random_blocks < 0:
        raise ValueError(f"need seq_len >= 1, block_size >= 1, num_random_blocks >= 0; got {seq_len}, {block_size}, {num_random_blocks}")
    if attention_type == "original_full" or seq_len <= full_attention_max_length(block_size, num_random_blocks):
        return LengthPlan(padded_len=seq_len, attention="full")
    padded = -(-seq_len // block_size) * block_size  # round up to a block multiple
    return LengthPlan(padded_len=padded, attention="block_sparse")
