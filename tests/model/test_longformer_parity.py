"""Parity of longdoc.model.longformer with transformers' Longformer on tiny random-init checkpoints.

Every head, loaded through `longdoc.model.checkpoint.load_pretrained` from a directory transformers
wrote; attention windows that differ per layer; lengths that are and are not window multiples;
global tokens at several positions and counts (per row), only the first token, none; padded
batches. fp32 max abs difference <= 1e-5 on every non-padded position.
"""

from __future__ import annotations

import pytest
import torch

from longdoc.model.checkpoint import LoadError, load_pretrained, save_pretrained
from longdoc.model.longformer import LongformerModel, padded_length
from tests.model.conftest import hf_checkpoints
from tests.model.test_bigbird_parity import compare

TOL = 1e-5
VOCAB = 120
PAD, SEP = 1, 2  # transformers' Longformer defaults (RoBERTa's ids)


def tiny_config(**overrides):
    """hidden 32, 2 layers, 2 heads; initializer_range 0.1 makes attention peaked enough that a
    wrong window or a missing global token moves the outputs far above the tolerance."""
    from transformers import LongformerConfig

    cfg = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
        max_position_embeddings=520, attention_window=[16, 32], initializer_range=0.1,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD, sep_token_id=SEP,
    )
    cfg.update(overrides)
    return LongformerConfig(**cfg)


@pytest.fixture
def hf_longformer(tmp_path):
    """factory(architecture, seed=0, **config overrides) -> (checkpoint directory, transformers model),
    with non-zero biases and padding row, so that position / bias mix-ups show"""

    def padding_row(model):
        model.base_model.embeddings.position_embeddings.weight[PAD].normal_(0, 0.1)

    return hf_checkpoints(tmp_path, tiny_config, 0.05, padding_row)


def random_batch(batch: int, length: int, seed: int = 0, pad_tail=(0,)):
    """input_ids without special tokens; attention_mask with the last pad_tail[b] positions of row b
    set to 0 (a padded batch)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, n in enumerate(pad_tail):
        if n:
            mask[b, length - n :] = 0
    return ids, mask


def global_mask(batch: int, length: int, positions) -> torch.Tensor | None:
    """positions: None (no global tokens), or one list of positions per row."""
    if positions is None:
        return None
    g = torch.zeros(batch, length, dtype=torch.long)
    for b, row in enumerate(positions):
        g[b, row] = 1
    return g


# (architecture, config overrides, length, global positions per row (None = the head's default
# or no globals), rows' padded tails)
CASES = [
    ("LongformerModel", {}, 64, None, (0, 0)),  # a window multiple, no global tokens
    ("LongformerModel", {}, 75, [[0], [0]], (0, 20)),  # only the first token; padded
    ("LongformerModel", {}, 150, [[0, 5, 40, 41, 149], [77]], (0, 33)),  # counts differ per row
    ("LongformerModel", {}, 130, [[3, 64, 100], []], (0, 70)),  # a row without global tokens
    ("LongformerModel", {"attention_window": [32, 16], "hidden_act": "gelu_new"}, 97, [[10, 11, 12], [0, 96]], (0, 1)),
    ("LongformerModel", {"attention_window": 32, "hidden_size": 64, "num_attention_heads": 4}, 200, [[0, 1, 2, 3], [0]], (0, 50)),
    ("LongformerModel", {"attention_window": [16, 48]}, 100, [[0, 99], [50]], (0, 9)),  # padded to 48 by transformers
    ("LongformerModel", {}, 20, [[0, 19], [1]], (0, 5)),  # shorter than a window
    ("LongformerForQuestionAnswering", {}, 150, None, (0, 40)),  # globals = the question (default)
    ("LongformerForQuestionAnswering", {"attention_window": [32, 16]}, 96, [[0, 1, 2, 3, 4, 5], [0, 1, 2]], (0, 0)),
    ("LongformerForSequenceClassification", {"num_labels": 3}, 150, None, (0, 40)),  # first token (default)
    ("LongformerForSequenceClassification", {"num_labels": 3, "hidden_act": "relu"}, 81, [[0, 40], [0, 10, 80]], (0, 30)),
    ("LongformerForMaskedLM", {}, 150, [[0, 7], [0]], (0, 40)),
    ("LongformerForMaskedLM", {"tie_word_embeddings": False, "attention_window": [16, 16]}, 64, None, (0, 0)),
]


def _id(case):
    arch, overrides, length, positions, pads = case
    globals_ = "default" if positions is None else "-".join(str(len(r)) for r in positions)
    return f"{arch}-{overrides.get('attention_window', '16,32')}-S{length}-g{globals_}-pad{max(pads)}"


def _qa_ids(ids, question_lengths):
    """`<s> question </s></s> context </s>`: exactly three separators per row, as transformers'
    default QA global mask requires."""
    for b, q in enumerate(question_lengths):
        ids[b, q], ids[b, q + 1], ids[b, -1] = SEP, SEP, SEP
    return ids


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_transformers(hf_longformer, case):
    arch, overrides, length, positions, pads = case
    directory, ref = hf_longformer(arch, **overrides)
    ours = load_pretrained(directory)
    assert list(ours.state_dict()) == list(ref.state_dict())  # key for key, in order
    ids, mask = random_batch(2, length, seed=length, pad_tail=pads)
    if arch == "LongformerForQuestionAnswering":
        ids = _qa_ids(ids, [9, 17])
    gmask = global_mask(2, length, positions)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, global_attention_mask=gmask)
        got = ours(ids, attention_mask=mask, global_attention_mask=gmask)
    diffs = compare(want, got, mask)
    assert diffs and max(diffs.values()) <= TOL, diffs


def test_pad_token_inside_the_input_shifts_positions_as_in_transformers(hf_longformer, monkeypatch):
    """RoBERTa positions skip pad tokens, also real ones (attention_mask 1) inside the input."""
    from longdoc.model import longformer

    directory, ref = hf_longformer("LongformerModel")
    ours = load_pretrained(directory)
    ids, mask = random_batch(2, 70, seed=3, pad_tail=(0, 10))
    ids[0, 20:23] = PAD
    gmask = global_mask(2, 70, [[0, 21], [5]])
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, global_attention_mask=gmask)
        got = ours(ids, attention_mask=mask, global_attention_mask=gmask)
        # positions 2, 3, ... that do not skip the pad tokens: far above the tolerance
        monkeypatch.setattr(longformer, "position_ids_from", lambda x, pad: torch.arange(x.shape[1]).expand_as(x) + pad + 1)
        naive = ours(ids, attention_mask=mask, global_attention_mask=gmask)
    assert max(compare(want, got, mask).values()) <= TOL
    assert (naive.last_hidden_state[0, 25:40] - want.last_hidden_state[0, 25:40]).abs().max() > 1e-2
    assert torch.equal(naive.last_hidden_state[1], got.last_hidden_state[1])  # row 1 has no pad token inside


def test_global_tokens_and_windows_change_the_answer(hf_longformer):
    """The parity tests can fail: the same input without the global tokens, or with the layers'
    windows swapped, is far from transformers' answer."""
    directory, ref = hf_longformer("LongformerModel")
    swapped, _ = hf_longformer("LongformerModel", attention_window=[32, 16])
    ours = load_pretrained(directory)
    other = load_pretrained(swapped)
    other.load_state_dict(ours.state_dict())
    ids, mask = random_batch(2, 150, seed=1)
    gmask = global_mask(2, 150, [[0, 5], [60]])
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, global_attention_mask=gmask).last_hidden_state
        no_globals = ours(ids, attention_mask=mask).last_hidden_state
        wrong_windows = other(ids, attention_mask=mask, global_attention_mask=gmask).last_hidden_state
    assert (want - no_globals).abs().max() > 1e-2
    assert (want - wrong_windows).abs().max() > 1e-2


def test_global_projections_are_used(hf_longformer):
    """query_global / key_global / value_global drive the global tokens' rows: perturbing them
    moves those rows and, through them, the rest."""
    directory, _ = hf_longformer("LongformerModel")
    ours = load_pretrained(directory)
    ids, mask = random_batch(1, 64, seed=2)
    gmask = global_mask(1, 64, [[0, 30]])
    with torch.no_grad():
        before = ours(ids, attention_mask=mask, global_attention_mask=gmask).last_hidden_state
        for name in ("query_global", "key_global", "value_global"):
            getattr(ours.encoder.layer[1].attention.self, name).weight.mul_(1.5)
        after = ours(ids, attention_mask=mask, global_attention_mask=gmask).last_hidden_state
    assert (after[0, [0, 30]] - before[0, [0, 30]]).abs().max() > 1e-2
    assert torch.equal(after[0, 5:25], before[0, 5:25])  # layer 1's window rows far from the globals read only their keys


@pytest.mark.parametrize(
    "arch, labels",
    [
        ("LongformerForQuestionAnswering", {"start_positions": torch.tensor([30, 500]), "end_positions": torch.tensor([[35], [40]])}),
        ("LongformerForSequenceClassification", {"labels": torch.tensor([2, 0])}),
        ("LongformerForSequenceClassification", {"labels": torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])}),
        ("LongformerForMaskedLM", {"labels": torch.full((2, 90), -100).index_fill_(1, torch.tensor([3, 50, 80]), 70)}),
    ],
    ids=["qa", "classify-single", "classify-multi", "mlm"],
)
def test_losses_match_transformers(hf_longformer, arch, labels):
    overrides = {"num_labels": 3} if arch.endswith("Classification") else {}
    directory, ref = hf_longformer(arch, **overrides)
    ours = load_pretrained(directory)
    ids, mask = random_batch(2, 90, pad_tail=(0, 9))
    ids = _qa_ids(ids, [5, 8])
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, **labels).loss
        got = ours(ids, attention_mask=mask, **labels).loss
    assert want is not None and got is not None
    assert abs(want.item() - got.item()) <= 1e-5


def test_bare_encoder_of_a_task_checkpoint(hf_longformer):
    """architecture='LongformerModel' on a QA directory: the `longformer.` encoder, no pooler."""
    directory, ref = hf_longformer("LongformerForQuestionAnswering")
    ours = load_pretrained(directory, architecture="LongformerModel")
    assert isinstance(ours, LongformerModel) and ours.pooler is None
    ids, mask = random_batch(2, 80, pad_tail=(0, 11))
    gmask = global_mask(2, 80, [[0, 1, 2], [0]])
    with torch.no_grad():
        want = ref.longformer(input_ids=ids, attention_mask=mask, global_attention_mask=gmask).last_hidden_state
        got = ours(ids, attention_mask=mask, global_attention_mask=gmask).last_hidden_state
    assert (want - got)[mask.bool()].abs().max() <= TOL


def test_saved_directory_loads_in_transformers(hf_longformer, tmp_path):
    import transformers

    directory, ref = hf_longformer("LongformerForMaskedLM")
    ours = load_pretrained(directory)
    saved = save_pretrained(ours, tmp_path / "ours")
    again = transformers.LongformerForMaskedLM.from_pretrained(saved).eval()
    ids, mask = random_batch(1, 40)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert isinstance(load_pretrained(saved), type(ours))


def test_wrong_checkpoint_is_refused(hf_longformer, tmp_path):
    """A QA file read as a classifier lacks the classifier and holds qa_outputs: a LoadError by name."""
    directory, _ = hf_longformer("LongformerForQuestionAnswering")
    with pytest.raises(LoadError, match="classifier"):
        load_pretrained(directory, architecture="LongformerForSequenceClassification")


def test_input_checks(hf_longformer):
    directory, _ = hf_longformer("LongformerForQuestionAnswering")
    ours = load_pretrained(directory)
    ids, _ = random_batch(1, 40)
    with pytest.raises(ValueError, match="global_attention_mask"):
        ours(ids)  # no separator: no default question
    with pytest.raises(ValueError, match="position table"):
        ours.longformer(random_batch(1, 519)[0])  # positions start at pad_token_id + 1
    assert padded_length(75, ours.attention_specs) == 80  # windows 16, 32: w = 8, 16


def test_forward_does_not_change_the_model(hf_longformer):
    """A request with global tokens then one without: the same as each alone."""
    directory, _ = hf_longformer("LongformerForSequenceClassification")
    ours = load_pretrained(directory)
    ids, mask = random_batch(2, 100, seed=4)
    with torch.no_grad():
        before = ours(ids, attention_mask=mask).logits
        ours(ids, attention_mask=mask, global_attention_mask=global_mask(2, 100, [[0, 1, 50], [99]]))
        ours(random_batch(1, 10)[0])
        after = ours(ids, attention_mask=mask).logits
    assert torch.equal(before, after)


def test_gradients_match_transformers(hf_longformer):
    """Training sees transformers' gradients (every dropout 0), global projections included."""
    directory, ref = hf_longformer("LongformerForSequenceClassification", num_labels=3)
    ours = load_pretrained(directory).train()
    ref.train()
    ids, mask = random_batch(2, 90, seed=5, pad_tail=(0, 20))
    gmask = global_mask(2, 90, [[0, 30], [0]])
    labels = torch.tensor([2, 1])
    ref(input_ids=ids, attention_mask=mask, global_attention_mask=gmask, labels=labels).loss.backward()
    ours(ids, attention_mask=mask, global_attention_mask=gmask, labels=labels).loss.backward()
    theirs = dict(ref.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(p.grad, theirs[name].grad, atol=1e-5, rtol=1e-4, msg=name)
        checked += 1
    assert checked == len(theirs) and ours.longformer.encoder.layer[0].attention.self.query_global.weight.grad.abs().max() > 0
