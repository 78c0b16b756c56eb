"""Parity of longdoc.model.modernbert with transformers' ModernBERT (eager attention) on tiny
random-init checkpoints.

Every head (masked LM, sequence classification with "cls" and "mean" pooling, token
classification, QA), loaded through `longdoc.model.checkpoint.load_pretrained` from a directory
transformers wrote; layers alternating sliding-window (band) and full attention, in both config
spellings (`global_attn_every_n_layers` and `layer_types`); a global and a local rotary base that
differ; lengths that are multiples of nothing (37, 53) and longer than the band; padded batches.
fp32 max abs difference <= 1e-5 on every non-padded position, hidden states and logits.
"""

from __future__ import annotations

import pytest
import torch

from longdoc.model.checkpoint import load_pretrained
from longdoc.model.modernbert import ModernBertConfig, ModernBertModel
from tests.model.conftest import hf_checkpoints

TOL = 1e-5
VOCAB = 120
PAD = 0


def tiny_config(**overrides):
    """hidden 32, 4 layers (full, sliding, sliding, full), 2 heads, a band of 8 tokens;
    initializer_range 0.1 makes attention peaked enough that a wrong band or rotary base moves the
    outputs far above the tolerance. Eager attention: the reference path."""
    from transformers import ModernBertConfig as HFModernBertConfig

    cfg = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2,
        local_attention=8, global_attn_every_n_layers=3, global_rope_theta=500.0, local_rope_theta=30.0,
        max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, cls_token_id=1, eos_token_id=2,
        sep_token_id=2, initializer_range=0.1, attn_implementation="eager",
    )
    cfg.update(overrides)
    return HFModernBertConfig(**cfg)


@pytest.fixture
def hf_modernbert(tmp_path):
    """factory(architecture, seed=0, **config overrides) -> (checkpoint directory, transformers model),
    norms and biases away from their init (ones / zeros), so that a norm or bias mix-up shows"""
    return hf_checkpoints(tmp_path, tiny_config, 0.1)


def random_batch(batch: int, length: int, seed: int = 0, pad_tail=(0,)):
    """input_ids without pad; attention_mask with the last pad_tail[b] positions of row b set to 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, n in enumerate(pad_tail):
        if n:
            mask[b, length - n :] = 0
            ids[b, length - n :] = PAD
    return ids, mask


FIELDS = ("logits", "start_logits", "end_logits")


def differences(ref, ours, ids, mask) -> dict[str, float]:
    """max abs difference of the encoder's last hidden state and every output field, over real tokens."""
    keep = mask.bool()
    with torch.no_grad():
        ref_hidden = ref.model(input_ids=ids, attention_mask=mask).last_hidden_state
        our_hidden = ours.model(ids, mask).last_hidden_state
        ref_out, our_out = ref(input_ids=ids, attention_mask=mask), ours(ids, mask)
    assert ref_hidden.shape == our_hidden.shape
    diffs = {"hidden": (ref_hidden[keep] - our_hidden[keep]).abs().max().item()}
    for name in FIELDS:
        a, b = getattr(ref_out, name, None), getattr(our_out, name, None)
        if a is None:
            continue
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if a.dim() >= 2 and a.shape[:2] == mask.shape:
            a, b = a[keep], b[keep]
        diffs[name] = (a - b).abs().max().item()
    return diffs


HEADS = [
    ("ModernBertForMaskedLM", {}),
    ("ModernBertForSequenceClassification", {"classifier_pooling": "cls", "num_labels": 3}),
    ("ModernBertForSequenceClassification", {"classifier_pooling": "mean", "num_labels": 3}),
    ("ModernBertForTokenClassification", {"num_labels": 5}),
    ("ModernBertForQuestionAnswering", {"num_labels": 2}),
]


@pytest.mark.parametrize("architecture,head", HEADS, ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.values())))
@pytest.mark.parametrize("length,local_attention,pad_tail", [(37, 8, (0, 11, 30)), (53, 16, (5, 0, 40))])
def test_heads_match_transformers(hf_modernbert, architecture, head, length, local_attention, pad_tail):
    directory, ref = hf_modernbert(architecture, local_attention=local_attention, **head)
    ours = load_pretrained(directory)
    assert type(ours).__name__ == architecture
    ids, mask = random_batch(3, length, seed=length, pad_tail=pad_tail)
    diffs = differences(ref, ours, ids, mask)
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("architecture", ["ModernBertForMaskedLM", "ModernBertForSequenceClassification"])
def test_layer_types_spelling_biases_and_untied_decoder(hf_modernbert, architecture):
    """`layer_types` given (a pattern no global_attn_every_n_layers makes), every bias on, an
    untied MLM decoder, a GeGLU with another activation, mean pooling."""
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    directory, ref = hf_modernbert(
        architecture, num_hidden_layers=3, layer_types=types, norm_bias=True, attention_bias=True, mlp_bias=True,
        classifier_bias=True, decoder_bias=True, tie_word_embeddings=False, hidden_activation="gelu_pytorch_tanh",
        classifier_pooling="mean", rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}})
    ours = load_pretrained(directory)
    assert ours.config.layer_type_list == types and ours.config.rope_theta == {
        "full_attention": 1000.0, "sliding_attention": 20.0}
    ids, mask = random_batch(2, 45, seed=3, pad_tail=(0, 17))
    diffs = differences(ref, ours, ids, mask)
    assert max(diffs.values()) <= TOL, diffs


def test_the_comparison_can_fail(hf_modernbert):
    """A perturbed weight, swapped rotary bases, a wider band: each is far outside the tolerance."""
    directory, ref = hf_modernbert("ModernBertForMaskedLM")
    ids, mask = random_batch(2, 37, seed=1, pad_tail=(0, 9))
    ours = load_pretrained(directory)
    assert max(differences(ref, ours, ids, mask).values()) <= TOL

    with torch.no_grad():
        ours.model.layers[2].attn.Wqkv.weight[0, 0] += 0.1
    assert differences(ref, ours, ids, mask)["hidden"] > 10 * TOL

    def variant(**changes):
        cfg = ModernBertConfig.from_dict({**ours.config.to_dict(), **changes})
        model = type(ours)(cfg)
        model.load_state_dict(load_pretrained(directory).state_dict())
        return model.eval()

    swapped = variant(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 30.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
    assert differences(ref, swapped, ids, mask)["hidden"] > 10 * TOL
    assert differences(ref, variant(local_attention=10), ids, mask)["hidden"] > 10 * TOL


def test_config_reads_both_spellings_as_transformers_does():
    from transformers import ModernBertConfig as HFModernBertConfig

    legacy = {"model_type": "modernbert", "num_hidden_layers": 5, "hidden_size": 32, "num_attention_heads": 2,
              "global_attn_every_n_layers": 2, "global_rope_theta": 700.0, "local_rope_theta": 70.0}
    ours, theirs = ModernBertConfig.from_dict(legacy), HFModernBertConfig(**legacy)
    assert ours.layer_type_list == theirs.layer_types
    assert ours.rope_theta == {t: p["rope_theta"] for t, p in theirs.rope_parameters.items()}
    # written back as read: no key of the other spelling appears
    assert {k: ours.to_dict()[k] for k in legacy} == legacy and "layer_types" not in ours.to_dict()
    again = ModernBertConfig.from_dict(theirs.to_dict())  # transformers' own spelling
    assert again.layer_type_list == ours.layer_type_list and again.rope_theta == ours.rope_theta
    defaults = ModernBertConfig.from_dict({"model_type": "modernbert", "num_hidden_layers": 4})
    assert defaults.rope_theta == {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
    assert defaults.layer_type_list == HFModernBertConfig(num_hidden_layers=4).layer_types


@pytest.mark.parametrize("bad,match", [
    ({"classifier_pooling": "max"}, "classifier_pooling"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "rope_type 'yarn'"),
    ({"hidden_activation": "swiglu"}, "hidden_activation"),
])
def test_config_refuses_what_it_does_not_compute(bad, match):
    with pytest.raises(ValueError, match=match):
        ModernBertConfig.from_dict({"model_type": "modernbert", "num_hidden_layers": 3, **bad})


def test_bare_encoder_from_a_task_checkpoint(hf_modernbert):
    directory, ref = hf_modernbert("ModernBertForSequenceClassification")
    encoder = load_pretrained(directory, architecture="ModernBertModel")
    assert isinstance(encoder, ModernBertModel)
    ids, mask = random_batch(2, 37, seed=2, pad_tail=(0, 12))
    with torch.no_grad():
        a = ref.model(input_ids=ids, attention_mask=mask).last_hidden_state
        b = encoder(ids, mask).last_hidden_state
    assert (a - b)[mask.bool()].abs().max().item() <= TOL
