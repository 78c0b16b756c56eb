"""`verify` can fail (issue 11, defect 2): the wrong checkpoint is an error, an int8 or fp16
export is judged by task-level agreement with the fp32 reference, and a checkpoint of another
architecture or shape gets a clear message instead of an error from inside a graph."""

import subprocess
import sys

import numpy as np
import pytest

from longdoc.export.exporter import export_model
from longdoc.export.verify import Agreement, VerifyError, verify_model
from longdoc.testing.tiny_models import make_tiny_checkpoint


def quiet(_msg):
    pass


# QA's best span over hundreds of candidates ties easily in a random model; at BERT's own
# initializer range (0.02) and hidden 128 (the reproduction) int8 keeps it in >= 15/16 rows
# for every seed tried (0, 1, 2), while the tiny default shape (hidden 32, range 0.25) keeps 11/16.
# The summarizer's first greedy token likewise: init_std 0.1 instead of the tiny default 0.25.
SHAPES = {"qa": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, initializer_range=0.02),
          "summarize": dict(init_std=0.1)}


@pytest.fixture(scope="module")
def int8_exports(tmp_path_factory):
    """task -> (int8 model dir, its checkpoint, another checkpoint of the same shape)."""
    out = {}
    for task in ("qa", "classify", "summarize"):
        root = tmp_path_factory.mktemp(f"int8-{task}")
        shape = SHAPES.get(task, {})
        ckpt = make_tiny_checkpoint(root / "ckpt", task, seed=0, **shape)
        other = make_tiny_checkpoint(root / "other", task, seed=1, **shape)
        export_model(ckpt, root / "model", task, dtype="int8", progress=quiet)
        out[task] = (root / "model", ckpt, other)
    return out


LENGTHS = {task: [16, 145, 300, 512] for task in ("qa", "classify", "summarize")}


@pytest.mark.parametrize("task", ["qa", "classify", "summarize"])
def test_int8_passes_against_its_own_checkpoint(int8_exports, task):
    model_dir, ckpt, _ = int8_exports[task]
    report = verify_model(model_dir, ckpt, progress=quiet, threads=1, lengths=LENGTHS[task])
    assert report.ok, report.summary()
    assert any(c.graph == "agreement" for c in report.checks)


@pytest.mark.parametrize("task", ["qa", "classify", "summarize"])
def test_int8_fails_against_another_checkpoint(int8_exports, task):
    """Today: "best CHANGED", max diff 1.1, "PASS (28/28)"."""
    model_dir, _, other = int8_exports[task]
    report = verify_model(model_dir, other, progress=quiet, threads=1, lengths=LENGTHS[task],
                          allow_other_checkpoint=True)
    assert not report.ok, report.summary()
    assert any(c.graph == "agreement" and not c.ok for c in report.checks), report.summary()


def test_agreement_thresholds_are_overridable(int8_exports):
    model_dir, _, other = int8_exports["classify"]
    lax = Agreement(label=0.0)
    report = verify_model(model_dir, other, progress=quiet, threads=1, lengths=[16, 300], agreement=lax,
                          allow_other_checkpoint=True)
    assert report.ok, report.summary()


def test_another_checkpoint_is_an_error(int8_exports):
    model_dir, _, other = int8_exports["qa"]
    with pytest.raises(VerifyError, match="not the checkpoint this model was exported from.*--allow-other-checkpoint"):
        verify_model(model_dir, other, progress=quiet, threads=1, lengths=[16])


def test_cli_exits_2_with_one_clear_line_for_another_checkpoint(int8_exports):
    model_dir, _, other = int8_exports["qa"]
    out = subprocess.run([sys.executable, "-m", "longdoc", "verify", str(model_dir), "--checkpoint", str(other),
                          "--lengths", "16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "sha256" in out.stderr and "Traceback" not in out.stderr


def test_cli_exits_1_when_int8_disagrees(int8_exports):
    model_dir, _, other = int8_exports["classify"]
    out = subprocess.run([sys.executable, "-m", "longdoc", "verify", str(model_dir), "--checkpoint", str(other),
                          "--lengths", "16,300", "--allow-other-checkpoint"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL" in out.stdout and "label identical" in out.stdout


def test_checkpoint_of_another_architecture_is_a_clear_error(int8_exports, tmp_path):
    model_dir, _, _ = int8_exports["qa"]
    classify = make_tiny_checkpoint(tmp_path / "cls", "classify")
    with pytest.raises(VerifyError, match="BigBirdForSequenceClassification is a .classify. model, not .qa."):
        verify_model(model_dir, classify, progress=quiet, threads=1, lengths=[16], allow_other_checkpoint=True)
    pegasus = make_tiny_checkpoint(tmp_path / "sum", "summarize")
    with pytest.raises(VerifyError, match="cannot be compared"):
        verify_model(model_dir, pegasus, progress=quiet, threads=1, lengths=[16], allow_other_checkpoint=True)


def test_checkpoint_of_another_shape_is_a_clear_error(int8_exports, tmp_path):
    model_dir, _, _ = int8_exports["qa"]
    wide = make_tiny_checkpoint(tmp_path / "wide", "qa", hidden_size=64, intermediate_size=128)
    with pytest.raises(VerifyError, match="hidden_size 64 \\(export: 128\\)"):
        verify_model(model_dir, wide, progress=quiet, threads=1, lengths=[16], allow_other_checkpoint=True)


def test_cli_thresholds_reach_verify(int8_exports):
    """--min-label-agreement 0 lets the other checkpoint's labels pass (the flags are wired)."""
    model_dir, _, other = int8_exports["classify"]
    out = subprocess.run([sys.executable, "-m", "longdoc", "verify", str(model_dir), "--checkpoint", str(other),
                          "--lengths", "16,300", "--allow-other-checkpoint", "--min-label-agreement", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "need >= 0%" in out.stdout


def test_fp16_criteria_allow_ties_at_fp16_precision_only():
    """fp16 (on a GPU computed as fp16) may pick another argmax when the reference scores it within
    twice the tolerance of its best; a clearly worse pick still fails. The tolerance is relative:
    logits of magnitude 16 are rounded in steps of 0.008 in fp16."""
    from longdoc.export.verify import _same_or_tie, _scaled

    want = np.array([[5.000, 4.995, 1.0], [3.0, 2.0, 1.0]], np.float32)
    got = np.array([[4.990, 4.999, 1.0], [2.5, 2.6, 1.0]], np.float32)  # row 0: near-tie; row 1: wrong
    tol = _scaled(1e-2, want, "fp16")
    assert tol == pytest.approx(5e-2)  # 1e-2 x max|reference| 5
    assert _same_or_tie(got, want, 2 * tol).tolist() == [True, False]
    assert _same_or_tie(got, want, 0.0).tolist() == [False, False]  # fp32: exact agreement only
    assert _scaled(1e-4, want, "fp32") == 1e-4 and _scaled(1e-2, want / 10, "fp16") == 1e-2


class _TeacherForced:
    """A stand-in export whose decoder returns fixed logits (B, T, V) for the reference's prefix."""

    def __init__(self, logits):
        self.logits, self.fed = np.asarray(logits, np.float32), None

    def encode_for_decoding(self, ids, mask):
        return None

    def empty_past(self, batch):
        return []

    def decoder_step(self, state, input_ids, position_ids, self_mask, past):
        self.fed = np.asarray(input_ids)
        return self.logits[:, : self.fed.shape[1]], []


def test_int8_summarize_is_judged_by_where_the_export_ranks_the_reference_tokens():
    """A faithful int8 summarizer breaks a near tie the other way and its greedy search then parts
    from the reference's for good: verify used to count that row as a disagreement (the default
    summarizer, trained on a GPU, failed with 2 of 4 random rows while its ROUGE on 901 real pages
    equals the fp32 export's). Fed the reference's own prefix, its tokens rank near the top; the
    tokens of other weights do not."""
    from longdoc.export.verify import reference_tokens_in_top

    START, EOS, V = 1, 2, 10
    want = [[START, 5, 6, 7, 8], [START, 4, EOS, 0, 0]]  # the second reference ends after one token
    logits = np.zeros((2, 4, V))
    logits[0, 0, [5, 9]] = [3.0, 3.01]  # a near tie the export breaks the other way (rank 2)
    logits[0, 1, 6], logits[0, 2, 7], logits[0, 3, 8] = 1.0, 1.0, 1.0
    logits[1, 0, 4], logits[1, 1, EOS] = 1.0, 1.0
    logits[1, 2:, 3] = 9.0  # after the reference's eos: not judged
    fake = _TeacherForced(logits)
    ids, mask = np.ones((2, 8), np.int64), np.ones((2, 8), np.int64)
    assert reference_tokens_in_top(fake, ids, mask, want, 4, 3, EOS) == [True, True]
    assert fake.fed.tolist() == [[START, 5, 6, 7], [START, 4, EOS, EOS]]  # the reference's prefix, eos-filled
    assert reference_tokens_in_top(fake, ids, mask, want, 4, 1, EOS) == [False, True]  # rank 2 is not top 1
    far = logits.copy()
    far[0, 2, :] = np.arange(V)  # the reference's 7 ranks third of ten: fine; its 8 at the next step...
    far[0, 3, :] = np.arange(V)[::-1]  # ...ranks ninth: another model's choice, not a tie
    assert reference_tokens_in_top(_TeacherForced(far), ids, mask, want, 4, 3, EOS) == [False, True]


def test_greedy_prefix_agreement_skips_a_decoder_start_that_is_eos():
    """Issue 25, defect 4: LED starts decoding with its eos (2); cut at that first eos, every row
    compared as identical, `4/4 = 100.0%` beside `row 0 differs: [2, 151, 783, 1154] vs [2, 783, ...]`."""
    from longdoc.export.verify import same_greedy_prefix

    assert not same_greedy_prefix([2, 151, 783, 1154, 783], [2, 783, 1154, 783, 151], 4, eos=2)
    assert same_greedy_prefix([2, 151, 783, 2, 1], [2, 151, 783, 2, 2], 4, eos=2)  # ended is ended
    assert not same_greedy_prefix([2, 151, 2], [2, 151, 783, 2], 4, eos=2)
    assert same_greedy_prefix([0, 5, 6, 7, 8, 9], [0, 5, 6, 7, 8, 4], 4, eos=1)  # Pegasus: start pad 0
