"""Tiny random-init transformers BigBird checkpoints for the parity and checkpoint tests."""

from __future__ import annotations

import copy

import pytest
import torch

torch.set_num_threads(1)

VOCAB = 120
SEP = 66  # transformers' default sep_token_id, inside VOCAB


def tiny_config(**overrides):
    """A transformers BigBirdConfig small enough for CPU tests (hidden 32, 2 layers, 2 heads).

    initializer_range 0.1 (not 0.02) makes attention peaked enough that using the wrong random
    blocks changes the hidden states by ~1e-1, far above the 1e-5 parity tolerance.
    """
    from transformers import BigBirdConfig

    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=1024,
        block_size=16,
        num_random_blocks=2,
        initializer_range=0.1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        sep_token_id=SEP,
    )
    cfg.update(overrides)
    return BigBirdConfig(**cfg)


class HFCheckpoint:
    """A transformers model saved to a directory; `reference(train)` gives a fresh copy, since
    transformers' BigBird switches itself to full attention on short inputs and stays switched."""

    def __init__(self, directory, model):
        self.directory = directory
        self._pristine = model

    def reference(self, train: bool):
        return copy.deepcopy(self._pristine).train(train)


@pytest.fixture
def hf_checkpoint(tmp_path):
    """factory(architecture, seed=0, **config overrides) -> HFCheckpoint"""
    import transformers

    def make(architecture: str, seed: int = 0, **overrides) -> HFCheckpoint:
        torch.manual_seed(seed)
        model = getattr(transformers, architecture)(tiny_config(**overrides)).eval()
        directory = tmp_path / f"{architecture}-{seed}"
        model.save_pretrained(directory)
        return HFCheckpoint(directory, model)

    return make


def random_batch(batch: int, length: int, seed: int = 0, pad_tail: int = 0):
    """input_ids (B, S) without pad/sep tokens; attention_mask with the last `pad_tail` positions
    of every row but the first set to 0 (a padded batch)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(SEP + 1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad_tail:
        mask[1:, length - pad_tail :] = 0
    return ids, mask


def hf_checkpoints(directory, config_of, std: float, tweak=None):
    """factory(architecture, seed=0, **config overrides) -> (checkpoint directory, transformers model):
    transformers.<architecture>(config_of(**overrides)) seeded, its 1-d parameters nudged by `std`
    (longdoc.testing.tiny_models.nudge_vectors), `tweak(model)` applied under no_grad, saved under `directory`."""
    import transformers

    from longdoc.testing.tiny_models import nudge_vectors

    def make(architecture: str, seed: int = 0, **overrides):
        torch.manual_seed(seed)
        model = getattr(transformers, architecture)(config_of(**overrides)).eval()
        nudge_vectors(model, std)
        if tweak is not None:
            with torch.no_grad():
                tweak(model)
        path = directory / f"{architecture}-{seed}"
        model.save_pretrained(path)
        return path, model

    return make
