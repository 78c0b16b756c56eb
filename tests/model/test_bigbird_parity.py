"""Parity of longdoc.model.bigbird with transformers' BigBird on tiny random-init checkpoints.

transformers in eval mode is compared with plan "hf-eval", transformers in train mode (every
dropout 0) with plan "hf-train". fp32 max abs difference <= 1e-5 on every non-padded position.
"""

from __future__ import annotations

import pytest
import torch

from longdoc.model.checkpoint import load_pretrained
from longdoc.model.lengths import full_attention_max_length
from tests.model.conftest import SEP, random_batch, tiny_config

TOL = 1e-5

# (architecture, block_size, num_random_blocks, attention_type, lengths, config overrides)
# Lengths are chosen around each case's full-attention threshold (5 + 2r) * block_size:
# at it (full), one above it (block-sparse, padded), block multiples and not, and 1024 (the
# legacy random plan of transformers' train mode).
CASES = [
    ("BigBirdModel", 16, 1, "block_sparse", [112, 113, 128, 200], {}),
    ("BigBirdModel", 32, 2, "block_sparse", [288, 289, 320], {"hidden_act": "gelu", "num_attention_heads": 4}),
    ("BigBirdModel", 64, 3, "block_sparse", [704, 705, 1024], {}),
    # the legacy plan draws over max_position_embeddings positions: 2048 != 1024 matters
    ("BigBirdModel", 16, 3, "block_sparse", [1024], {"max_position_embeddings": 2048}),
    ("BigBirdModel", 16, 2, "original_full", [100, 300], {"rescale_embeddings": True, "use_bias": False}),
    ("BigBirdForQuestionAnswering", 16, 3, "block_sparse", [176, 250], {}),
    ("BigBirdForSequenceClassification", 32, 2, "block_sparse", [200, 333], {"num_labels": 3, "hidden_act": "relu"}),
    ("BigBirdForMaskedLM", 16, 2, "block_sparse", [144, 145, 300], {"hidden_act": "gelu_fast"}),
]
FIELDS = ("last_hidden_state", "pooler_output", "logits", "start_logits", "end_logits")


def _ids(case):
    arch, bs, r, attn, _, _ = case
    return f"{arch}-bs{bs}-r{r}-{attn}"


def compare(ref_out, our_out, mask):
    """max abs difference per output field, over non-padded positions. QA logits of question
    tokens carry -1e6 (fp32 spacing there is 0.06): they are checked to be masked in both."""
    diffs = {}
    keep = mask.bool()
    for name in FIELDS:
        a, b = getattr(ref_out, name, None), getattr(our_out, name, None)
        if a is None and b is None:
            continue
        assert a is not None and b is not None, name
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if a.dim() >= 2 and a.shape[:2] == mask.shape:
            a, b = a[keep], b[keep]
        if name in ("start_logits", "end_logits"):
            masked = a < -1e5
            assert torch.equal(masked, b < -1e5), name
            a, b = a[~masked], b[~masked]
        diffs[name] = (a - b).abs().max().item()
    return diffs


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("train", [False, True], ids=["eval-vs-hf-eval", "train-vs-hf-train"])
def test_parity(hf_checkpoint, case, train):
    arch, bs, r, attn, lengths, overrides = case
    ckpt = hf_checkpoint(arch, block_size=bs, num_random_blocks=r, attention_type=attn, **overrides)
    ours = load_pretrained(ckpt.directory, plan="hf-train" if train else "hf-eval")
    assert not ours.training
    threshold = full_attention_max_length(bs, r)
    for length in lengths:
        ids, mask = random_batch(2, length, seed=length, pad_tail=21)
        if arch == "BigBirdForQuestionAnswering":  # [CLS] question [SEP] context
            ids[0, 9], ids[1, 14] = SEP, SEP
        ref = ckpt.reference(train)  # fresh: transformers mutates itself on short inputs
        with torch.no_grad():
            ref_out = ref(input_ids=ids, attention_mask=mask)
            our_out = ours(ids, attention_mask=mask)
        diffs = compare(ref_out, our_out, mask)
        assert diffs and max(diffs.values()) <= TOL, (length, "full" if length <= threshold else "sparse", diffs)


def test_wrong_plan_is_detected(hf_checkpoint):
    """The parity tests can fail: transformers in train mode draws other random blocks than in
    eval mode, and the difference is far above the tolerance."""
    ckpt = hf_checkpoint("BigBirdModel", block_size=16, num_random_blocks=2)
    ids, mask = random_batch(1, 300)
    ours = load_pretrained(ckpt.directory, plan="hf-eval")
    with torch.no_grad():
        ref_out = ckpt.reference(train=True)(input_ids=ids, attention_mask=mask)
        diff = (ref_out.last_hidden_state - ours(ids, mask).last_hidden_state).abs().max().item()
    assert diff > 1e-2


def test_qa_question_lengths_and_token_types(hf_checkpoint):
    """Explicit question_lengths (no [SEP] in the input) and explicit token_type_ids."""
    ckpt = hf_checkpoint("BigBirdForQuestionAnswering", block_size=16, num_random_blocks=1)
    ours = load_pretrained(ckpt.directory, plan="hf-eval")
    ids, mask = random_batch(2, 200, pad_tail=30)
    qlen = torch.tensor([[12], [30]])
    tt = torch.zeros_like(ids)
    tt[:, 40:] = 1
    with torch.no_grad():
        for kwargs in ({"question_lengths": qlen}, {"question_lengths": qlen, "token_type_ids": tt}):
            ref_out = ckpt.reference(train=False)(input_ids=ids, attention_mask=mask, **kwargs)
            our_out = ours(ids, attention_mask=mask, **kwargs)
            diffs = compare(ref_out, our_out, mask)
            assert max(diffs.values()) <= TOL, (kwargs.keys(), diffs)
            # the question (all but [CLS]) is out of the competition
            assert (our_out.start_logits[0, 1:12] < -1e5).all() and our_out.start_logits[0, 0] > -1e5


def test_forward_does_not_change_the_model(hf_checkpoint):
    """A short input (full attention) then a long one (block-sparse): same as each alone."""
    ckpt = hf_checkpoint("BigBirdModel", block_size=16, num_random_blocks=1)
    ours = load_pretrained(ckpt.directory, plan="hf-eval")
    long_ids, _ = random_batch(1, 200, seed=1)
    with torch.no_grad():
        before = ours(long_ids).last_hidden_state
        ours(random_batch(1, 50)[0])
        after = ours(long_ids).last_hidden_state
    assert torch.equal(before, after)
    assert ours.attention_spec.plan == "hf-eval" and ours.config.attention_type == "block_sparse"


@pytest.mark.parametrize("arch", ["BigBirdModel", "BigBirdForQuestionAnswering", "BigBirdForSequenceClassification", "BigBirdForMaskedLM"])
def test_forward_blocks_equals_forward(hf_checkpoint, arch):
    """The export entry point (padded input, stacked layout tensors) gives forward's outputs."""
    ckpt = hf_checkpoint(arch, block_size=16, num_random_blocks=2)
    ours = load_pretrained(ckpt.directory, plan="hf-train")
    ids, mask = random_batch(2, 160, pad_tail=25)  # 160 = 10 blocks, > threshold 144
    ids[:, 5] = SEP
    layouts = ours.stacked_layouts(10)
    assert layouts["key_blocks"].shape[:3] == (2, 2, 10)
    tt = None if arch == "BigBirdForQuestionAnswering" else torch.zeros_like(ids)
    with torch.no_grad():
        out = ours(ids, attention_mask=mask)
        blocks = ours.forward_blocks(ids, mask, tt, **layouts)
    assert len(blocks) == len(ours.export_output_names)
    for name, tensor in zip(ours.export_output_names, blocks):
        assert torch.equal(tensor, getattr(out, name)), name


def test_forward_blocks_exports_to_onnx_with_dynamic_length(hf_checkpoint, tmp_path):
    """One trace of the QA export entry point serves other lengths (layout as graph inputs)."""
    import warnings

    import onnxruntime as ort

    ckpt = hf_checkpoint("BigBirdForQuestionAnswering", block_size=16, num_random_blocks=2)
    ours = load_pretrained(ckpt.directory, plan="hf-train")

    class Exportable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qa = ours

        def forward(self, input_ids, attention_mask, key_blocks, valid, global_index, row_source):
            return self.qa.forward_blocks(input_ids, attention_mask, None, key_blocks, valid, global_index, row_source)

    names = ["input_ids", "attention_mask", "key_blocks", "valid", "global_index", "row_source"]

    def inputs(length):
        ids, mask = random_batch(2, length, seed=length, pad_tail=7)
        ids[:, 6] = SEP
        lay = ours.stacked_layouts(length // 16)
        return (ids, mask, lay["key_blocks"], lay["valid"], lay["global_index"], lay["row_source"])

    dynamic = {"input_ids": {0: "B", 1: "S"}, "attention_mask": {0: "B", 1: "S"}, "key_blocks": {2: "nb"},
               "valid": {2: "nb"}, "row_source": {1: "nb"}, "start_logits": {0: "B", 1: "S"}, "end_logits": {0: "B", 1: "S"}}
    path = tmp_path / "qa.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's own notice
        # (export restores the wrapper's train/eval mode recursively: keep the wrapper in eval)
        torch.onnx.export(Exportable().eval(), inputs(160), str(path), input_names=names,
                          output_names=list(ours.export_output_names), dynamic_axes=dynamic, opset_version=17, dynamo=False)
    assert not ours.training
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    graph_inputs = {i.name for i in session.get_inputs()}
    for length in (160, 400):
        args = inputs(length)
        got = session.run(None, {n: a.numpy() for n, a in zip(names, args) if n in graph_inputs})
        with torch.no_grad():
            want = ours(args[0], attention_mask=args[1])
        for name, g in zip(ours.export_output_names, got):
            w = getattr(want, name)
            keep = (w > -1e5) & args[1].bool()
            assert (torch.from_numpy(g)[keep] - w[keep]).abs().max().item() <= 1e-5, (length, name)


@pytest.mark.parametrize(
    "arch, labels",
    [
        ("BigBirdForQuestionAnswering", {"start_positions": torch.tensor([30, 500]), "end_positions": torch.tensor([[35], [40]])}),
        ("BigBirdForSequenceClassification", {"labels": torch.tensor([2, 0])}),
        ("BigBirdForSequenceClassification", {"labels": torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])}),
        ("BigBirdForMaskedLM", {"labels": torch.full((2, 180), -100).index_fill_(1, torch.tensor([3, 50, 170]), 70)}),
    ],
    ids=["qa", "classify-single", "classify-multi", "mlm"],
)
def test_losses_match_transformers(hf_checkpoint, arch, labels):
    overrides = {"num_labels": 3} if arch.endswith("Classification") else {}
    ckpt = hf_checkpoint(arch, block_size=16, num_random_blocks=1, **overrides)
    ours = load_pretrained(ckpt.directory, plan="hf-eval")
    ids, mask = random_batch(2, 180, pad_tail=9)
    ids[:, 8] = SEP
    with torch.no_grad():
        want = ckpt.reference(train=False)(input_ids=ids, attention_mask=mask, **labels).loss
        got = ours(ids, attention_mask=mask, **labels).loss
    assert want is not None and got is not None
    assert abs(want.item() - got.item()) <= 1e-5


def test_untied_mlm_head_uses_the_decoders_own_bias(tmp_path):
    """`tie_word_embeddings=False`: transformers keeps `cls.predictions.bias` and the decoder's
    bias apart and its logits use `cls.predictions.decoder.bias`; a checkpoint whose two biases
    differ gives transformers' logits (they were off by 3.8 when the two were one parameter)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.BigBirdForMaskedLM(tiny_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        hf.cls.predictions.decoder.bias.normal_()
        hf.cls.predictions.bias.normal_()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, plan="hf-eval")
    ids, mask = random_batch(2, 150, seed=1, pad_tail=7)
    with torch.no_grad():
        diffs = compare(hf(input_ids=ids, attention_mask=mask), ours(ids, attention_mask=mask), mask)
    assert max(diffs.values()) <= TOL, diffs
