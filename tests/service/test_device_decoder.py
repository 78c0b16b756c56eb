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

from longdoc.export.runtime import KEY_ALIGNMENT
from longdoc.model.search import StepConstraints, resolve_settings
from longdoc.service.batcher import DecodeScheduler, RequestState, WorkerSlot
from longdoc.service.batching import bucket_length, budget_groups
from longdoc.service.metrics import Metrics
from longdoc.service.regroup import Regroup, fill_graph, step_tail_graph, take_graph
from longdoc.service.workers import CudaWorker, OnnxWorker
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
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1, decoder_steps="dynamic")
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
        # rows (those that left ride along); the step's past: the longest, left-padded to KEY_ALIGNMENT
        B, P = len(dec.rows), bucket_length(max(len(fed[i]) - 1 for i in live), KEY_ALIGNMENT)
        per_step = 8 * B * (P + 3)  # ids, positions, self mask (int64)
        masks = 8 * B * dec.source_length
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
    assert dec.rows == []


def test_newcomers_are_encoded_within_the_workers_batch_budget(summarizer):
    """A group of newcomers is encoded in batches of one bucket and at most the worker's
    `max_batch_tokens` (one 4096-token document at a time on a CPU); they still join the running
    batch together and decode as they would alone."""
    docs_lengths = (40, 120, 42, 70, 38)
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1)
    block = worker.info.block_size
    bucket = lambda n: bucket_length(n, block)  # noqa: E731
    model, dec = worker.model, worker.decoder
    docs = [document_ids(model, text_of(n, seed=n)) for n in docs_lengths]
    worker.max_batch_tokens = 2 * bucket(len(docs[0]))  # the 40s' bucket: two of them, then the third alone
    states = worker.begin(docs)
    groups = list({id(s.group): s.group for s in states}.values())
    expect = budget_groups([len(d) for d in docs], worker.max_batch_tokens, block)
    assert len(groups) == len(expect) > 1 and max(map(len, expect)) == 2
    for g, rows in zip(groups, expect):
        assert [states[i].group for i in rows] == [g] * len(rows)
        assert [states[i].row for i in rows] == list(range(len(rows)))
        assert len({bucket(len(docs[i])) for i in rows}) == 1
        assert bucket(len(docs[rows[0]])) * len(rows) <= worker.max_batch_tokens or len(rows) == 1
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
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1, decoder_steps="dynamic")
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
    assert len(dec.rows) == 3
    buffers = dec.cross_addresses
    row_bytes = dec.heads * dec.source_length * dec.head_dim * item * len(dec.kv)  # one sequence's cross state
    past_bytes = lambda rows, P: rows * dec.heads * P * dec.head_dim * item * len(dec.kv)  # noqa: E731

    # every step writes the batch's next past (left-padded to KEY_ALIGNMENT positions again)
    realigned = lambda: past_bytes(len(dec.rows), dec.past_length)  # noqa: E731
    moved = dec.regroup.moved
    step([0, 1, 2, 3])  # a join: the newcomer's row, and the (small) self-attention cache of 4 rows
    assert dec.regroup.moved - moved == row_bytes + past_bytes(4, dec.past_length) + realigned()
    assert dec.cross_addresses == buffers and dec.rows[3] is states[3]
    moved = dec.regroup.moved
    step([0, 2, 3])  # 1 leaves: its row is masked, no row moves
    assert dec.regroup.moved - moved == realigned()
    moved = dec.regroup.moved
    step([0, 2, 3, 4])  # 4 takes over 1's row
    assert dec.rows[1] is states[4] and len(dec.rows) == 4
    assert dec.regroup.moved - moved == row_bytes + realigned()  # the batch did not grow: the cache stays
    assert dec.cross_addresses == buffers
    step([0, 2, 3, 4])
    assert dec.capacity == 4
    for i, ids in enumerate(docs):
        want = one_sequence_logits(model, ids, fed[i][:-1])
        np.testing.assert_allclose(np.array(got[i]), np.array(want), rtol=1e-4, atol=1e-4)


def test_the_buffers_shrink_when_the_longest_sequence_has_gone(summarizer):
    """A long document leaves; a short one joins: the slot buffers are rebuilt at the short
    sequences' length (every step reads the buffers' whole encoder length; a sequence encoded with
    the long one keeps only its own positions), and each row still decodes as it would alone."""
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1, decoder_steps="dynamic")
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
            long_se = dec.source_length
    assert dec.source_length == bucket_length(max(s.encoder_length for s in states[1:]), KEY_ALIGNMENT)
    assert dec.source_length <= long_se // 2
    for i in (1, 2):
        want = one_sequence_logits(model, docs[i], fed[i][:-1])
        np.testing.assert_allclose(np.array(got[i]), np.array(want), rtol=1e-4, atol=1e-4)


def test_a_batch_mostly_gone_is_compacted(summarizer):
    """One of four sequences leaves, then two more: the batch is gathered down to the one that stays (rows that
    left ride along only while they are fewer than the live ones), whose logits stay its own."""
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1, decoder_steps="dynamic")
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
    assert len(dec.rows) == 1 and dec.regroups == 2  # one of four left: it rides along; three: compacted
    row_bytes = dec.heads * dec.source_length * dec.head_dim * model.float_type(0).itemsize * len(dec.kv)
    # one row's past: moved down, then realigned after its step (KEY_ALIGNMENT positions, 3 steps in)
    past_bytes = dec.heads * KEY_ALIGNMENT * dec.head_dim * model.float_type(0).itemsize * len(dec.kv)
    assert moves[3] == row_bytes + 2 * past_bytes  # the last row moved down into the first: one row's copy
    assert dec.capacity == 4  # the buffers stay, for the rows to come
    want = one_sequence_logits(model, docs[3], fed[:-1])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overlap", [False, True], ids=["encode-then-step", "encode-beside-steps"])
def test_scheduler_tokens_are_the_reference_searchs(summarizer, overlap):
    """Greedy requests joining the running batch at different steps and one beam search among them:
    every answer is `OnnxModel.generate`'s, and the batch's device state is freed at the end; also
    when newcomers are encoded on the second thread while the batch steps (as on a GPU)."""
    worker = OnnxWorker("sum", summarizer, "cpu", threads=1, decoder_steps="dynamic")
    worker.overlaps_encoding = overlap
    model = worker.model
    docs = [document_ids(model, text_of(n, seed)) for n, seed in ((200, 1), (40, 2), (120, 3), (90, 4))]
    requests = [dict(max_new_tokens=20, min_length=16), dict(max_new_tokens=10), dict(max_new_tokens=14),
                dict(max_new_tokens=8, num_beams=3)]
    want = [reference(model, ids, **options) for ids, options in zip(docs, requests)]

    assert asyncio.run(scheduled(worker, docs, requests, reads=(2, 1, 0, 0))) == want
    assert worker.decoder.rows == [] and worker.decoder.regroups >= 2


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


# --- fixed-shape steps (docs/gpu.md, "Fixed-shape decoder steps") ---------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_step_tail_writes_the_cache_in_place_and_chooses_greedily(dtype):
    """The fixed-shape step's tail: each present's new column lands in its cache at the row's
    position (the buffer bound as input and output alike, nothing else written), and the token
    is the first maximum of the logits without the row's banned tokens (`vocab` = no token)."""
    B, H, P, D, V, K = 3, 2, 5, 4, 11, 2
    graph = step_tail_graph(dtype, 2, B, H, P, D, V, K)
    onnx.checker.check_model(onnx.load_from_string(graph), full_check=True)
    onnx.checker.check_model(onnx.load_from_string(fill_graph(dtype, 4, 2)), full_check=True)
    rng = np.random.default_rng(0)
    present = [rng.standard_normal((B, H, P + 1, D)).astype(dtype) for _ in range(2)]
    cache = [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((B, H, P, D)).astype(dtype)) for _ in range(2)]
    was = [c.numpy().copy() for c in cache]
    positions = np.array([[0], [4], [2]], np.int64)
    logits = rng.integers(-2, 3, (B, 1, V)).astype(np.float32)  # ties: the first maximum wins
    banned = np.array([[V, V], [3, V], [int(logits[2, 0].argmax()), 7]], np.int64)
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    for name, value in (("position_ids", positions), ("logits", logits), ("banned", banned)):
        binding.bind_cpu_input(name, value)
    for i in range(2):
        binding.bind_cpu_input(f"present{i}", present[i])
        binding.bind_ortvalue_input(f"cache{i}", cache[i])
        binding.bind_ortvalue_output(f"cache_out{i}", cache[i])
    binding.bind_output("tokens", "cpu")
    session.run_with_iobinding(binding)
    for i in range(2):
        want = was[i].copy()
        want[np.arange(B), :, positions[:, 0]] = present[i][:, :, P]
        np.testing.assert_array_equal(cache[i].numpy(), want)
    scores = logits[:, 0].copy()
    for r, row in enumerate(banned):
        scores[r, row[row < V]] = -np.inf
    np.testing.assert_array_equal(binding.get_outputs()[-1].numpy(), scores.argmax(axis=1))


def fixed_worker(directory) -> OnnxWorker:
    return OnnxWorker("sum", directory, "cpu", threads=1, decoder_steps="fixed")


def bound_addresses(dec) -> dict:
    """Every device address the fixed-shape sessions are bound to, by shape."""
    return {key: [v.data_ptr() for v in dec.fixed._buffers[key]] for key in dec.fixed._buffers}


def test_fixed_shape_steps_touch_fixed_buffers_and_copy_only_step_inputs(summarizer):
    """Fixed-shape steps (every dimension fixed: the batch at its capacity, the cross state at a
    length bucket, a preallocated self-attention cache): three sequences, one joining at step 4,
    one leaving at step 7, a new order after, and a cache that grows from 16 positions to 32.
    Each row's logits are its one-sequence logits; a step copies to the device only its per-step
    inputs (ids, positions, self mask, banned tokens; the encoder mask when the batch changes);
    greedy steps bring back only token ids; a shape's buffers keep their addresses, and there is
    one decoder session per shape."""
    worker = fixed_worker(summarizer)
    model, dec = worker.model, worker.decoder
    docs = [document_ids(model, text_of(n, seed=n)) for n in (40, 120, 70)]
    start = worker.info.special_tokens["decoder_start"]
    states = worker.begin(docs[:2]) + worker.begin(docs[2:])
    encoded = dec.copied["encoder_inputs"]
    fed = {i: [start] for i in range(3)}
    got = {i: [] for i in range(3)}
    plan = [(0, 1)] * 3 + [(0, 1, 2)] * 3 + [(1, 2)] * 2 + [(2, 1)] * 12
    addresses, shapes = None, set()
    for step, live in enumerate(plan):
        before, fetched, regroups = sum(dec.copied.values()), dec.fetched["tokens"], dec.regroups
        if step % 2:  # greedy on the device, every other step
            chosen = worker.step_greedy([states[i] for i in live], [fed[i][-1] for i in live],
                                        [StepConstraints()] * len(live))
            assert dec.fetched["tokens"] - fetched == 8 * dec.capacity  # ids, not logits
            logits = None
        else:
            logits = worker.step([states[i] for i in live], [fed[i][-1] for i in live])
            chosen = [int(row.argmax()) for row in logits]
        rows, P, Se = dec.capacity, dec.past_length, dec.source_length
        reassembled = dec.regroups != regroups
        shapes.add((rows, Se, P))
        per_step = 8 * rows * (1 + 1 + (P + 1) + 4)  # ids, positions, self mask, 4 banned slots
        sent = sum(dec.copied.values()) - before
        assert sent == per_step + (8 * rows * Se if reassembled else 0), step
        if not reassembled:  # the same shape: the same buffers
            assert bound_addresses(dec) == addresses
        addresses = bound_addresses(dec)
        for j, (i, tok) in enumerate(zip(live, chosen)):
            if logits is not None:
                got[i].append(logits[j])
            fed[i].append(tok)
    assert dec.copied["encoder_inputs"] == encoded and "past" not in dec.copied
    assert {P for _, _, P in shapes} == {16, 32}  # the cache grew once
    assert set(dec.fixed._steps) == shapes  # one decoder session per shape
    for i in range(3):  # the logits of the steps that brought them back, against the oracle's
        want = one_sequence_logits(model, docs[i], fed[i][:-1])
        steps = [k for k, live in enumerate(plan) if i in live]
        np.testing.assert_allclose(np.array(got[i]), np.array([want[n] for n, k in enumerate(steps) if k % 2 == 0]),
                                   rtol=1e-4, atol=1e-4)
    worker.release()
    assert dec.rows == []


def test_fixed_shape_sessions_fix_every_dimension(summarizer):
    """A fixed-shape decoder session takes only tensors of its shape (the free-dimension overrides
    hold): fed another past length, ONNX Runtime refuses it."""
    worker = fixed_worker(summarizer)
    states = worker.begin([document_ids(worker.model, text_of(30, seed=1))])
    worker.step(states, [worker.info.special_tokens["decoder_start"]])
    dec = worker.decoder
    Se, P = dec.source_length, dec.past_length
    session, _ = dec.fixed.step(dec.capacity, Se, P)
    g, d = worker.model.decoder_graph, worker.model.manifest.decoder
    kv = lambda n: np.zeros((1, d["num_heads"], n, d["head_dim"]), worker.model.float_type)  # noqa: E731
    one = np.ones((1, 1), np.int64)
    feed = {"input_ids": one, "position_ids": one, g.ENCODER_MASK: np.ones((1, Se), np.int64),
            **{n: kv(Se) for n in g.cross}}
    session.run([g.LOGITS], {**feed, "self_mask": np.ones((1, P + 1), np.int64), **{n: kv(P) for n in g.past}})
    with pytest.raises(Exception, match="past|dimension|shape|Got"):
        session.run([g.LOGITS], {**feed, "self_mask": np.ones((1, P), np.int64), **{n: kv(P - 1) for n in g.past}})


@pytest.mark.parametrize("overlap", [False, True], ids=["encode-then-step", "encode-beside-steps"])
def test_fixed_shape_scheduler_tokens_are_the_reference_searchs(summarizer, overlap):
    """The scheduler over fixed-shape steps, greedy chosen on the device: greedy requests joining
    at different steps (one past 16 positions, so the cache grows) and a beam search among them
    give `OnnxModel.generate`'s answers, newcomers encoded beside the steps or not."""
    worker = fixed_worker(summarizer)
    worker.overlaps_encoding = overlap
    model = worker.model
    docs = [document_ids(model, text_of(n, seed)) for n, seed in ((200, 1), (40, 2), (120, 3), (90, 4))]
    requests = [dict(max_new_tokens=24, min_length=20), dict(max_new_tokens=10, no_repeat_ngram_size=2),
                dict(max_new_tokens=14), dict(max_new_tokens=8, num_beams=3)]
    want = [reference(model, ids, **options) for ids, options in zip(docs, requests)]

    assert asyncio.run(scheduled(worker, docs, requests, reads=(2, 1, 0, 0))) == want
    assert worker.decoder.fetched["tokens"] > 0 and worker.decoder.fetched["logits"] == 0


class GatedSession:
    """An encoder session whose `gated`-th run waits for `gate` (`held` is set once it waits)."""

    def __init__(self, session, gated: int):
        self._session, self.gated, self.runs = session, gated, 0
        self.gate, self.held = threading.Event(), threading.Event()

    def run_with_iobinding(self, binding, *args):
        self.runs += 1
        if self.runs == self.gated:
            self.held.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return self._session.run_with_iobinding(binding, *args)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_fixed_shape_steps_go_on_while_the_encoder_runs(summarizer):
    """The encoder beside the steps (issue 36, item 3): while a newcomer's encoder session is
    mid-run (held at a gate), the running sequence's fixed-shape steps go on to its last token;
    then the newcomer joins, and both answers are the reference search's. The steps wait for the
    newcomer's encoder to reach its run (the second step until the newcomer is submitted, so that
    it is admitted after it; the later ones until the encoder is held), else the running sequence
    may finish before the encoder thread gets to run at all, and nothing is shown to overlap."""
    worker = fixed_worker(summarizer)
    worker.overlaps_encoding = True
    dec = worker.decoder
    gate = dec.encoder.session = GatedSession(dec.encoder.session, gated=2)
    submitted, while_held = threading.Event(), []  # per step: did it run while the encoder was held?
    step_greedy = worker.step_greedy

    def gated_step(*args):
        if len(while_held) == 1:
            assert submitted.wait(60), "the test never submitted the newcomer"
        elif while_held:
            assert gate.held.wait(60), "the newcomer's encoder never got to its run"
        while_held.append(gate.held.is_set() and not gate.gate.is_set())
        return step_greedy(*args)

    worker.step_greedy = gated_step
    model = worker.model
    docs = [document_ids(model, text_of(n, seed)) for n, seed in ((60, 1), (90, 2))]
    settings = resolve_settings(worker.info.generation, max_new_tokens=12)
    want = [reference(model, ids, max_new_tokens=12) for ids in docs]

    async def go():
        scheduler = DecodeScheduler("sum", WorkerSlot(lambda: worker, worker, 0), Metrics(), max_decode_batch=8,
                                    max_queue_tokens=1 << 20, endpoint="summarize")
        scheduler.start()
        state = RequestState(deadline=time.monotonic() + 120)
        try:
            first = (await scheduler.submit(docs[0], settings, state)).__aiter__()
            head = [await first.__anext__()]
            second = await scheduler.submit(docs[1], settings, state)
            submitted.set()

            async def rest(stream):
                return [t async for t in stream]

            tail = await asyncio.wait_for(rest(first), 60)  # to its end, the encoder still held
            assert not gate.gate.is_set()
            gate.gate.set()
            return head + tail, [t async for t in second]
        finally:
            submitted.set()
            gate.gate.set()
            await scheduler.close()

    first, second = asyncio.run(go())
    assert [first, second] == want and len(first) > 2
    # the running sequence's steps after its second all ran while the newcomer's encoder was held
    assert while_held[:len(first)] == [False, False] + [True] * (len(first) - 2)


def test_a_refused_capture_leaves_the_steps_uncaptured(summarizer, monkeypatch, caplog):
    """When ONNX Runtime will not capture (here: sessions that claim CUDA run on the CPU, which
    captures nothing), the CUDA worker says so once and its fixed-shape steps run uncaptured,
    with the reference's tokens."""
    from tests.fake_cuda import claim_cuda

    claim_cuda(ort, monkeypatch.setattr)
    worker = CudaWorker("sum", summarizer, "cuda", threads=1)
    worker.model.device = "cpu"  # as tests/fake_cuda.on_cpu, but capture left asked for
    dec = worker.decoder
    worker.encoder.device_type = dec.device_type = dec.encoder.device_type = dec.regroup.device_type = "cpu"
    assert worker.decoder.steps == "captured" and worker.decoder.fixed.cuda_graph
    ids = document_ids(worker.model, text_of(50, seed=3))
    want = [reference(worker.model, ids, max_new_tokens=6)]
    decoder = worker.decoder
    with caplog.at_level("WARNING", logger="longdoc.service"):
        got = asyncio.run(scheduled(worker, [ids], [dict(max_new_tokens=6)], reads=(0,)))
    assert got == want and not decoder.fixed.cuda_graph
    assert sum("capture refused" in r.getMessage() for r in caplog.records) == 1


def test_fixed_shape_sessions_are_bounded(summarizer, monkeypatch):
    """Each fixed-shape decoder session holds its own weights: the worker keeps the most recently
    used few, and a shape seen again gets a new session (captured again on CUDA: its run count
    starts over) with the same buffers, and the same tokens."""
    from longdoc.service import workers

    monkeypatch.setattr(workers._FixedShapes, "MAX_STEP_SESSIONS", 1)
    worker = fixed_worker(summarizer)
    dec = worker.decoder
    start = worker.info.special_tokens["decoder_start"]
    short, long = (document_ids(worker.model, text_of(n, seed=n)) for n in (30, 300))
    got, sessions = [], []
    for ids in (short, long, short):  # the source bucket changes: another shape each time
        states = worker.begin([ids])
        tokens = [start]
        for _ in range(3):
            tokens = worker.step_greedy(states, tokens, [StepConstraints()])
        got.append(tokens)
        sessions.append(next(iter(dec.fixed._steps.values()))[0])
        worker.release()
        assert len(dec.fixed._steps) == 1 and all(s[:3] in dec.fixed._steps for s in dec.fixed.runs)
    assert got[0] == got[2] and sessions[0] is not sessions[1] and sessions[2] is not sessions[0]
