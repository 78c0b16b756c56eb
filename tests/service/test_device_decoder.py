"""The decode state stays on the worker's device (issue 24): a sequence's cross-attention
keys/values are written there by the encoder and never copied again; joins and leaves are
assembled on the device (service/regroup.py) and the host sends only per-step tensors. Run on
ONNX Runtime's CPU provider, which runs the same I/O-binding code as CUDA, for the three
encoder-decoder families (BigBird-Pegasus, LED, the BERT2BERT encoder-decoder): logits match the
model's own one-sequence decoder step, and the scheduler's tokens are the reference search's."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from longdoc.model.search import resolve_settings
from longdoc.service.batcher import DecodeScheduler, RequestState, WorkerSlot
from longdoc.service.batching import bucket_length, budget_groups
from longdoc.service.metrics import Metrics
from longdoc.service.regroup import Regroup, take_graph
from longdoc.service.workers import OnnxWorker
from longdoc.testing.fake_worker import FakeWorker
from tests.service.test_decode_parity import document_ids, reference, scheduled, text_of
from longdoc.testing.tiny_models import make_tiny_checkpoint, make_tiny_encoder_decoder, make_tiny_export, make_tiny_led

FAMILIES = ("pegasus", "led", "bert2bert")


@pytest.fixture(scope="module", params=FAMILIES)
def summarizer(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"decode-{request.param}")
    make = {"pegasus": lambda d: make_tiny_checkpoint(d, "summarize"), "led": make_tiny_led,
            "bert2bert": make_tiny_encoder_decoder}[request.param]
    return make_tiny_export(root / "model", "summarize", checkpoint_dir=make(root / "checkpoint"))


# --- the regroup kernels --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_regroup_graphs_are_valid_onnx(dtype):
    for graph in (take_graph(dtype, 4, 3), take_graph(dtype, 2, 1, crop=False),
                  take_graph(dtype, 4, 2, pad=False), take_graph(dtype, 4, 1, crop=False, pad=False)):
        onnx.checker.check_model(onnx.load_from_string(graph), full_check=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_take_is_numpy_indexing(dtype):
    rng = np.random.default_rng(0)
    k = Regroup(dtype, 4, ["CPUExecutionProvider"], "cpu")
    a, b = (rng.standard_normal(s).astype(dtype) for s in ((3, 2, 5, 4), (2, 2, 7, 4)))
    dev = [ort.OrtValue.ortvalue_from_numpy(x) for x in (a, b)]
    # rows picked and repeated, cropped on the left, padded on the right
    y = k.take([dev[0]], [2, 0, 2], 2, 1, 5, pad_after=3)[0].numpy()
    want = np.pad(a[[2, 0, 2]][:, :, 1:5], ((0, 0), (0, 0), (0, 3), (0, 0)))
    np.testing.assert_array_equal(y, want)
    # two tensors at once, left padding
    ya, yb = k.take([dev[0], dev[0]], [1], 2, 0, 5, pad_before=2)
    np.testing.assert_array_equal(ya.numpy(), np.pad(a[[1]], ((0, 0), (0, 0), (2, 0), (0, 0))))
    assert k.take(dev, [0, 1, 2], 2, 0, 5) == dev  # all rows, as they are: no copy
    np.testing.assert_array_equal(k.take([dev[0]], [1, 2], 2, 0, 5)[0].numpy(), a[1:])  # Gather alone
    np.testing.assert_array_equal(k.take([dev[0]], [0, 1, 2], 2, 2, 5)[0].numpy(), a[:, :, 2:])  # Slice, no Pad
    assert k.moved == sum(x.nbytes for x in (y, ya.numpy(), yb.numpy(), a[1:], a[:, :, 2:]))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_take_into_writes_its_rows_in_place(dtype):
    """`take(..., into=(buffers, row))` writes rows row.. of preallocated buffers and nothing else."""
    rng = np.random.default_rng(1)
    k = Regroup(dtype, 4, ["CPUExecutionProvider"], "cpu")
    a = rng.standard_normal((3, 2, 5, 4)).astype(dtype)
    src = [ort.OrtValue.ortvalue_from_numpy(a), ort.OrtValue.ortvalue_from_numpy(-a)]
    bufs = k.allocate([4, 2, 7, 4], 2)
    k.take(src, [0, 1, 2], 2, 0, 5, pad_after=2, into=(bufs, 0))  # all rows, padded to 7
    before = [b.numpy().copy() for b in bufs]
    moved = k.moved
    k.take(src, [1], 2, 1, 5, pad_after=3, into=(bufs, 3))  # one row, cropped and padded, into row 3
    assert k.moved - moved == 2 * a[0].size // 5 * 7 * np.dtype(dtype).itemsize
    for sign, b, was in zip((1, -1), bufs, before):
        y = b.numpy()
        np.testing.assert_array_equal(y[:3], was[:3])  # the other rows as they were
        np.testing.assert_array_equal(y[:3], sign * np.pad(a, ((0, 0), (0, 0), (0, 2), (0, 0))))
        np.testing.assert_array_equal(y[3], sign * np.pad(a[1][:, 1:5], ((0, 0), (0, 3), (0, 0))))


# --- the worker ---------------------------------------------------------------------------------

def one_sequence_logits(model, ids: list[int], tokens: list[int]) -> list[np.ndarray]:
    """The oracle: the model's decoder step on this sequence alone (batch 1, no padding anywhere)."""
    enc = model.encode_for_decoding(np.array([ids]), np.ones((1, len(ids)), np.int64))
    past, out = model.empty_past(1), []
    for i, t in enumerate(tokens):
        logits, past = model.decoder_step(enc, np.array([[t]]), np.array([[i]]), np.ones((1, i + 1), np.int64), past)
        out.append(logits[0, -1])
    return out


def test_cross_state_is_copied_to_the_device_once(summarizer):
    """Three sequences of different lengths: two start together, the third joins at step 4, the
    first leaves at step 7 (its row rides along, masked, until a compaction), and the last steps
    pass the batch in another order. Each row's logits are its one-sequence logits; once a
    sequence has joined, no step copies more to the device than the per-step tensors (token ids,
    positions, masks), whoever joins or leaves."""
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1)
    model, dec = worker.model, worker.decoder
    docs = [document_ids(model, text_of(n, seed=n)) for n in (40, 120, 70)]
    start = worker.info.special_tokens["decoder_start"]
    states = worker.begin(docs[:2]) + worker.begin(docs[2:])
    encoded = dec.copied["encoder_inputs"]
    assert encoded > 0 and set(dec.copied) == {"encoder_inputs"}  # the encoder wrote the cross state in place
    cross_bytes = sum(int(np.prod(v.shape())) for v in states[0].group.cross) * model.float_type(0).itemsize
    fed = {i: [start] for i in range(3)}
    got = {i: [] for i in range(3)}
    plan = [(0, 1)] * 3 + [(0, 1, 2)] * 3 + [(1, 2)] * 2 + [(2, 1)] * 2
    moved_before = None
    for step, live in enumerate(plan):
        before = sum(dec.copied.values())
        logits = worker.step([states[i] for i in live], [fed[i][-1] for i in live])
        sent = sum(dec.copied.values()) - before
        B, P = len(dec._batch.states), dec._batch.P - 1  # rows (those that left ride along), past length
        per_step = 8 * B * (P + 3)  # ids, positions, self mask (int64)
        masks = 8 * B * dec._batch.Se
        assert sent in (per_step, per_step + masks), (step, sent)  # the encoder mask only when the batch changes
        assert sent < cross_bytes / 4
        if step == 3:  # the join was assembled on the device
            moved_before = dec.regroup.moved
            assert moved_before > 0
        for i, row in zip(live, logits):
            got[i].append(row)
            fed[i].append(int(row.argmax()))
    assert dec.copied["encoder_inputs"] == encoded and "cross" not in dec.copied
    assert dec.regroups == 2  # start, join: a leave (one row of three) and a new order are no regroup
    for i in range(3):
        want = one_sequence_logits(model, docs[i], fed[i][:-1])
        np.testing.assert_allclose(np.array(got[i]), np.array(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cannot rejoin"):
        worker.step([states[0], states[1]], [start, start])
    worker.release()
    assert dec._batch is None


def test_newcomers_are_encoded_within_the_workers_batch_budget(summarizer):
    """A group of newcomers is encoded in batches of at most the worker's `max_batch_tokens`
    (one 4096-token document at a time on a CPU), in order; they still join the running batch
    together and decode as they would alone."""
    docs_lengths = (40, 120, 70, 30)
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1)
    block = worker.info.block_size
    bucket = lambda n: bucket_length(n, block)  # noqa: E731
    worker.max_batch_tokens = 2 * bucket(70)  # groups: the first alone (the second would pad it to 120), 120 alone, 70 + 30
    model, dec = worker.model, worker.decoder
    docs = [document_ids(model, text_of(n, seed=n)) for n in docs_lengths]
    states = worker.begin(docs)
    groups = list({id(s.group): s.group for s in states}.values())
    expect = budget_groups([len(d) for d in docs], worker.max_batch_tokens, block)
    assert len(groups) == len(expect) > 1
    for g, rows in zip(groups, expect):
        assert [s.row for s in states if s.group is g] == list(range(len(rows)))
        assert max(bucket(len(docs[i])) for i in rows) * len(rows) <= worker.max_batch_tokens or len(rows) == 1
    start = worker.info.special_tokens["decoder_start"]
    fed, got = [[start] for _ in docs], [[] for _ in docs]
    for _ in range(4):
        logits = worker.step(states, [f[-1] for f in fed])
        for i, row in enumerate(logits):
            got[i].append(row)
            fed[i].append(int(row.argmax()))
    assert dec.regroups == 1  # every group joined at the first step, in one assembly
    for i, ids in enumerate(docs):
        want = one_sequence_logits(model, ids, fed[i][:-1])
        np.testing.assert_allclose(np.array(got[i]), np.array(want), rtol=1e-4, atol=1e-4)


def test_a_join_writes_only_the_newcomers_cross_state(summarizer):
    """The running batch's cross keys/values live in slot buffers: a newcomer is written into a
    free row (the row of a sequence that left first) and the rows already there are not copied
    again; each row still decodes as its sequence alone would."""
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1)
    model, dec = worker.model, worker.decoder
    docs = [document_ids(model, text_of(n, seed=n)) for n in (90, 60, 75, 40, 50)]
    start = worker.info.special_tokens["decoder_start"]
    states = worker.begin(docs[:3]) + worker.begin(docs[3:4]) + worker.begin(docs[4:])
    fed = {i: [start] for i in range(5)}
    got = {i: [] for i in range(5)}
    item = model.float_type(0).itemsize

    def step(live):
        logits = worker.step([states[i] for i in live], [fed[i][-1] for i in live])
        for i, row in zip(live, logits):
            got[i].append(row)
            fed[i].append(int(row.argmax()))

    for _ in range(2):
        step([0, 1, 2])  # three rows: buffers with room for four
    b = dec._batch
    assert len(b.states) == 3
    buffers = [v.data_ptr() for v in b.cross]
    row_bytes = dec.heads * b.Se * dec.head_dim * item * len(dec.kv)  # one sequence's cross state
    past_bytes = lambda rows, P: rows * dec.heads * P * dec.head_dim * item * len(dec.kv)  # noqa: E731

    moved = dec.regroup.moved
    step([0, 1, 2, 3])  # a join: the newcomer's row, and the (small) self-attention cache of 4 rows
    assert dec.regroup.moved - moved == row_bytes + past_bytes(4, 2)
    assert [v.data_ptr() for v in dec._batch.cross] == buffers and dec._batch.states[3] is states[3]
    step([0, 2, 3])  # 1 leaves: its row is masked, nothing moves
    moved = dec.regroup.moved
    step([0, 2, 3, 4])  # 4 takes over 1's row
    assert dec._batch.states[1] is states[4] and len(dec._batch.states) == 4
    assert dec.regroup.moved - moved == row_bytes  # the batch did not grow: the cache stays as it is
    assert [v.data_ptr() for v in dec._batch.cross] == buffers
    step([0, 2, 3, 4])
    assert dec._batch.capacity == 4
    for i, ids in enumerate(docs):
        want = one_sequence_logits(model, ids, fed[i][:-1])
        np.testing.assert_allclose(np.array(got[i]), np.array(want), rtol=1e-4, atol=1e-4)


def test_the_buffers_shrink_when_the_longest_sequence_has_gone(summarizer):
    """A long document leaves; a short one joins: the slot buffers are rebuilt at the short
    sequences' length (every step reads the buffers' whole encoder length; a sequence encoded with
    the long one keeps only its own positions), and each row still decodes as it would alone."""
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1)
    model, dec = worker.model, worker.decoder
    docs = [document_ids(model, text_of(n, seed=n)) for n in (300, 40, 50)]
    start = worker.info.special_tokens["decoder_start"]
    states = worker.begin(docs[:2]) + worker.begin(docs[2:])
    fed, got = {i: [start] for i in range(3)}, {i: [] for i in range(3)}
    for live in [(0, 1)] * 2 + [(1, 2)] * 3:
        logits = worker.step([states[i] for i in live], [fed[i][-1] for i in live])
        for i, row in zip(live, logits):
            got[i].append(row)
            fed[i].append(int(row.argmax()))
        if live == (0, 1):
            long_se = dec._batch.Se
    assert dec._batch.Se == max(s.encoder_length for s in states[1:]) <= long_se // 2
    for i in (1, 2):
        want = one_sequence_logits(model, docs[i], fed[i][:-1])
        np.testing.assert_allclose(np.array(got[i]), np.array(want), rtol=1e-4, atol=1e-4)


def test_a_batch_mostly_gone_is_compacted(summarizer):
    """One of four sequences leaves, then two more: the batch is gathered down to the one that stays (rows that
    left ride along only while they are fewer than the live ones), whose logits stay its own."""
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1)
    model, dec = worker.model, worker.decoder
    docs = [document_ids(model, text_of(n, seed=n)) for n in (30, 60, 45, 80)]
    start = worker.info.special_tokens["decoder_start"]
    states = worker.begin(docs)
    fed, got = [start], []  # the last sequence's tokens and logits
    tokens = {id(s): start for s in states}
    moves = []
    for live in [states] * 2 + [states[1:]] + [states[3:]] * 3:
        moved = dec.regroup.moved
        logits = worker.step(live, [tokens[id(s)] for s in live])
        moves.append(dec.regroup.moved - moved)
        for s, row in zip(live, logits):
            tokens[id(s)] = int(row.argmax())
        got.append(logits[-1])
        fed.append(tokens[id(states[3])])
    assert len(dec._batch.states) == 1 and dec.regroups == 2  # one of four left: it rides along; three: compacted
    row_bytes = dec.heads * dec._batch.Se * dec.head_dim * model.float_type(0).itemsize * len(dec.kv)
    past_bytes = dec.heads * 3 * dec.head_dim * model.float_type(0).itemsize * len(dec.kv)  # one row, 3 steps in
    assert moves[3] == row_bytes + past_bytes  # the last row moved down into the first: one row's copy
    assert dec._batch.capacity == 4  # the buffers stay, for the rows to come
    want = one_sequence_logits(model, docs[3], fed[:-1])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overlap", [False, True], ids=["encode-then-step", "encode-beside-steps"])
def test_scheduler_tokens_are_the_reference_searchs(summarizer, overlap):
    """Greedy requests joining the running batch at different steps and one beam search among them:
    every answer is `OnnxModel.generate`'s, and the batch's device state is freed at the end; also
    when newcomers are encoded on the second thread while the batch steps (as on a GPU)."""
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1)
    worker.overlaps_encoding = overlap
    model = worker.model
    docs = [document_ids(model, text_of(n, seed)) for n, seed in ((200, 1), (40, 2), (120, 3), (90, 4))]
    requests = [dict(max_new_tokens=20, min_length=16), dict(max_new_tokens=10), dict(max_new_tokens=14),
                dict(max_new_tokens=8, num_beams=3)]
    want = [reference(model, ids, **options) for ids, options in zip(docs, requests)]

    assert asyncio.run(scheduled(worker, docs, requests, reads=(2, 1, 0, 0))) == want
    assert worker.decoder._batch is None and worker.decoder.regroups >= 2


class HeldEncoder(FakeWorker):
    """A summarizer whose second `begin` waits for `hold`, with `held` set once it waits."""

    overlaps_encoding = True

    def __init__(self, **kwargs):
        super().__init__(task="summarize", **kwargs)
        self.hold, self.held, self.begins = threading.Event(), threading.Event(), 0

    def begin(self, input_ids):
        self.begins += 1
        if self.begins == 2:
            self.held.set()
            assert self.hold.wait(30), "the test never released the encoder"
        return super().begin(input_ids)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_batch_steps_while_a_newcomer_is_encoded(overlap):
    """A worker that overlaps encoding: while a newcomer's encoder is held, the running sequence
    still gets every token to its end; the newcomer then joins and finishes. Without the overlap
    (the CPU worker's way) the running sequence waits for the encoder."""
    worker = HeldEncoder(summary_tokens=6)
    worker.overlaps_encoding = overlap
    ids = [worker.tokenizer.token_to_id(w) for w in ("gold", "good", "bad", "the", "is", "where", "what")]
    settings = resolve_settings(worker.info.generation, max_new_tokens=8)

    async def go():
        scheduler = DecodeScheduler("sum", WorkerSlot(lambda: worker, worker, 0), Metrics(), max_decode_batch=8,
                                    max_queue_tokens=1 << 20, endpoint="summarize")
        scheduler.start()
        state = RequestState(deadline=time.monotonic() + 60)
        try:
            first = (await scheduler.submit(ids, settings, state)).__aiter__()
            head = [await first.__anext__()]
            second = await scheduler.submit(ids[::-1], settings, state)
            assert await asyncio.to_thread(worker.held.wait, 30)

            async def rest(stream):
                return [t async for t in stream]

            try:
                tail = await asyncio.wait_for(rest(first), 5)
            except TimeoutError:
                tail = None
            worker.hold.set()
            return head, tail, await rest(second)
        finally:
            worker.hold.set()
            await scheduler.close()

    head, tail, second = asyncio.run(go())
    assert second == [t for t in ids[::-1] if t > 6][:6]
    if overlap:
        assert head + tail == [t for t in ids if t > 6][:6]
    else:
        assert tail is None  # held behind the encoder
