"""Through the service, an answer does not depend on the load (issue 40): the same requests sent one
at a time and then all at once, held at a gate until the batcher has queued every one of them, get
identical answers (QA spans and scores, labels and scores, greedy and beam summaries), on int8
exports of tiny models (int8 is where a shared activation scale used to make them differ).

A summary beside others, at the worker: newcomers are encoded as they would be alone (a group
holds one bucket, so a short document is never padded into a longer one's block-sparse attention),
and each decoder step's logits of a sequence are bitwise those of the sequence decoding alone,
whatever joins or leaves around it, with either way of running the steps (every key axis a multiple
of 16 positions, each sequence's keys at the same places modulo 16: export/runtime.py KEY_ALIGNMENT).
`longdoc eval`'s search follows the same rule, so it decodes a summary as the service does."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import numpy as np

from longdoc.export.exporter import export_model
from longdoc.export.manifest import INT8_ATTENTION
from longdoc.export.registry import LOWERINGS
from longdoc.export.generation import generated_tokens
from longdoc.service.workers import OnnxWorker
from longdoc.testing.tiny_models import (TINY_WORDS, make_tiny_checkpoint, make_tiny_encoder_decoder, make_tiny_export,
                                         make_tiny_led, vocab_size)
from tests.polling import until_async
from tests.service.conftest import running_app

# documents of several lengths around the tiny models' 144-token full-attention threshold and past
# their 512 tokens (QA: several windows), in pairs that share a length bucket (16 tokens, a word a
# token) so that the batcher can group them: equal lengths, and lengths that pad one of the pair
WORD_COUNTS = (40, 40, 130, 136, 230, 226, 600, 620)


def document(n_words: int, offset: int) -> str:
    return " ".join(TINY_WORDS[(offset + 7 * i) % len(TINY_WORDS)] for i in range(n_words))


DOCUMENTS = [document(n, i * 31) for i, n in enumerate(WORD_COUNTS)]


class GatedOnnxWorker(OnnxWorker):
    """A real ONNX worker whose encoder runs and decoder steps wait at `gate` while it is closed."""

    gate: threading.Event
    entered: threading.Event

    def _wait(self):
        self.entered.set()
        assert self.gate.wait(60), "gate never opened"

    def run(self, batch):
        self._wait()
        self.batch_sizes.append(len(batch.input_ids))
        return super().run(batch)

    def step(self, states, tokens):
        self._wait()
        self.batch_sizes.append(len(states))
        return super().step(states, tokens)

    def step_greedy(self, states, tokens, *args, **kwargs):
        self._wait()
        self.batch_sizes.append(len(states))
        return super().step_greedy(states, tokens, *args, **kwargs)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance-serve")
    return {task: make_tiny_export(root / task, task, dtype="int8") for task in ("qa", "classify", "summarize")}


def gated_factory(gate: threading.Event):
    made = {}

    def factory(name, directory, device, settings):
        worker = GatedOnnxWorker(name, directory, device, settings.threads, settings.batch_tokens_for(device))
        worker.gate, worker.entered, worker.batch_sizes = gate, threading.Event(), []
        made[name] = worker
        return worker

    factory.made = made
    return factory


REQUESTS = {  # model -> (route, bodies)
    "qa": ("/v1/qa", [{"question": "what does the water do", "document": d, "top_k": 3} for d in DOCUMENTS]),
    "cls": ("/v1/classify", [{"document": d} for d in DOCUMENTS]),
    "sum": ("/v1/summarize", [{"document": d, "max_new_tokens": 10, **beams}
                              for d in DOCUMENTS for beams in ({}, {"num_beams": 3})]),
}


def answer(response) -> dict:
    assert response.status_code == 200, response.text
    body = response.json()
    body.pop("usage", None)  # timings
    return body


@pytest.mark.parametrize("model", list(REQUESTS))
def test_answers_under_concurrency_equal_answers_alone(model_dirs, model):
    route, bodies = REQUESTS[model]
    gate = threading.Event()
    gate.set()
    factory = gated_factory(gate)
    models = {"qa": str(model_dirs["qa"]), "cls": str(model_dirs["classify"]), "sum": str(model_dirs["summarize"])}

    async def go():
        async with running_app(factory, models={model: models[model]}, warmup=False, threads=1) as c:
            alone = [answer(await c.post(route, json={**b, "model": model})) for b in bodies]
            worker = factory.made[model]
            worker.batch_sizes.clear()
            gate.clear()
            worker.entered.clear()
            held = asyncio.create_task(c.post(route, json={**bodies[0], "model": model}))
            await until_async(worker.entered.is_set, "the first request is held at the worker")
            others = [asyncio.create_task(c.post(route, json={**b, "model": model})) for b in bodies]
            service = c.app.state.service.models[model].engine
            queued = (lambda: len(service.pending) == len(bodies)) if model == "sum" else \
                (lambda: len(service.policy) >= len(bodies))
            await until_async(queued, "every request is queued behind the held one")
            gate.set()
            together = [answer(await t) for t in others]
            assert answer(await held) == alone[0]
            return alone, together, worker.batch_sizes

    alone, together, batch_sizes = asyncio.run(go())
    assert max(batch_sizes) > 1, "the requests never shared a batch"
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b == a, f"{model} request {i}: alone {a}, under load {b}"


# --- a summary beside others, at the worker ---------------------------------------------------

SUMMARIZERS = {"pegasus": lambda d: make_tiny_checkpoint(d, "summarize"), "led": make_tiny_led,
               "bert2bert": make_tiny_encoder_decoder}
# encoder tokens (the tiny encoders: blocks of 16, full attention up to 144 tokens) and the step at
# which each sequence joins the running batch: short and long, alone in their bucket or not
JOBS = ((60, 0), (230, 0), (100, 0), (37, 2), (300, 2), (140, 3), (20, 5))
STEPS = 20  # the cache grows past its first 16 positions


@pytest.fixture(scope="module")
def summarizers(tmp_path_factory):
    """(family, dtype) -> exported model directory, built on first use."""
    root = tmp_path_factory.mktemp("invariance-decode")
    built = {}

    def get(family: str, dtype: str, int8_attention: str = "off"):
        key = (family, dtype, int8_attention)
        if key not in built:
            checkpoint = root / f"{family}-checkpoint"
            if not checkpoint.is_dir():
                SUMMARIZERS[family](checkpoint)
            built[key] = root / "-".join(key)
            export_model(checkpoint, built[key], "summarize", dtype=dtype, int8_attention=int8_attention,
                         progress=lambda _msg: None)
        return built[key]

    return get


def job_ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(7, vocab_size(), n)]


def decode(worker: OnnxWorker, jobs: list[tuple[list[int], int]]) -> list[list[np.ndarray]]:
    """Each job's (ids, join step) logits over STEPS greedy steps from its join; the jobs that join
    at one step are encoded in one `begin`, as the decode scheduler's newcomers are."""
    start = worker.info.special_tokens["decoder_start"]
    states, fed, logits = [None] * len(jobs), [[start] for _ in jobs], [[] for _ in jobs]
    for step in range(max(join for _, join in jobs) + STEPS):
        joining = [i for i, (_, join) in enumerate(jobs) if join == step]
        if joining:
            for i, state in zip(joining, worker.begin([jobs[i][0] for i in joining])):
                states[i] = state
        live = [i for i, (_, join) in enumerate(jobs) if join <= step < join + STEPS]
        for i, row in zip(live, worker.step([states[i] for i in live], [fed[i][-1] for i in live])):
            logits[i].append(row)
            fed[i].append(int(row.argmax()))
    worker.release()
    return logits


@pytest.mark.parametrize("dtype", ["fp32", "int8", *(f"int8-attention-{m}" for m in INT8_ATTENTION[1:])])
@pytest.mark.parametrize("family", SUMMARIZERS)
def test_newcomers_are_encoded_as_they_would_be_alone(summarizers, family, dtype):
    """One `begin` of documents of several lengths: each one's cross keys/values are bitwise those
    of the same document begun alone. A short document used to be padded to the group's longest,
    and past the full-attention length that ran it through block-sparse attention. The
    `--int8-attention` modes too (one key and value scale per sequence and head, over its padded
    length: the length it has alone)."""
    int8_attention = dtype.removeprefix("int8-attention-") if dtype.startswith("int8-attention-") else "off"
    if int8_attention != "off":
        checkpoint = summarizers(family, "fp32").parent / f"{family}-checkpoint"
        why_not = LOWERINGS[json.loads((checkpoint / "config.json").read_text())["model_type"]].no_int8_attention
        if why_not:
            pytest.skip(f"{family}: {why_not}")
    directory = summarizers(family, "int8" if int8_attention != "off" else dtype, int8_attention)
    worker = OnnxWorker("sum", directory, "cpu", threads=1)
    docs = [job_ids(n, seed) for seed, (n, _) in enumerate(JOBS)]
    together = worker.begin(docs)
    for doc, state in zip(docs, together):
        alone = worker.begin([doc])[0]
        for a, b in zip(alone.group.cross, state.group.cross):
            np.testing.assert_array_equal(b.numpy()[state.row], a.numpy()[0], err_msg=f"{len(doc)} tokens")


@pytest.mark.parametrize("steps", ["dynamic", "fixed"])
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
@pytest.mark.parametrize("family", SUMMARIZERS)
def test_decoder_steps_do_not_depend_on_the_running_batch(summarizers, family, dtype, steps):
    """Sequences of other encoder lengths joining at other steps (the scheduler's continuous
    batching) leave a sequence's logits bitwise those of the sequence decoded alone, at every step,
    past the first 16 cache positions."""
    worker = OnnxWorker("sum", summarizers(family, dtype), "cpu", threads=1, decoder_steps=steps)
    jobs = [(job_ids(n, seed), join) for seed, (n, join) in enumerate(JOBS)]
    together = decode(worker, jobs)
    for i, job in enumerate(jobs):
        alone = decode(worker, [(job[0], 0)])[0]
        for step, (a, b) in enumerate(zip(alone, together[i])):
            np.testing.assert_array_equal(b, a, err_msg=f"{family} {dtype}: job {i} ({len(job[0])} tokens, joins at "
                                                        f"{job[1]}), step {step}")


# --- `longdoc eval` decodes as the service ------------------------------------------------------

EVAL_LENGTHS = (37, 100, 230)  # encoder tokens, none a multiple of KEY_ALIGNMENT


@pytest.mark.parametrize("steps", ["dynamic", "fixed"])
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
@pytest.mark.parametrize("family", SUMMARIZERS)
def test_eval_decodes_as_the_service(summarizers, family, dtype, steps):
    """`longdoc eval`'s search (longdoc.export.generation.generate, what export/evaluate.py runs)
    gives the service's answers: greedy and beam tokens equal the scheduler's over the worker, and
    greedy's logits at every step are bitwise the worker's dynamic steps' (both align every key
    axis by export/runtime.py's KEY_ALIGNMENT rule; at exact lengths they moved in the last bits
    from the fourth step). Fixed-shape steps run another session (every dimension fixed, other
    kernels), so their logits are the same only to rounding."""
    from longdoc.export.generation import generate, settings_for

    worker = OnnxWorker("sum", summarizers(family, dtype), "cpu", threads=1, decoder_steps=steps)
    model = worker.model
    seen = []
    step = model.decoder_step
    model.decoder_step = lambda *args: (lambda out: seen.append(out[0][:, -1]) or out)(step(*args))
    docs, answers = [job_ids(n, seed) for seed, n in enumerate(EVAL_LENGTHS)], []
    for ids in docs:
        seen.clear()  # every step runs (eos banned)
        want = generate(model, np.array([ids]), settings=settings_for(model.manifest, max_new_tokens=STEPS,
                                                                      min_length=STEPS))[0]
        logits = list(seen)
        states = worker.begin([ids])
        for k, token in enumerate(want[:-1]):
            got = worker.step(states, [token])[0]
            if steps == "dynamic":
                np.testing.assert_array_equal(got, logits[k][0], err_msg=f"{len(ids)} tokens, step {k}")
            else:
                np.testing.assert_allclose(got, logits[k][0], rtol=0, atol=1e-4, err_msg=f"{len(ids)} tokens, step {k}")
        worker.release()
        for beams in (1, 3):
            s = settings_for(model.manifest, max_new_tokens=STEPS, num_beams=beams)
            answers.append(generated_tokens(generate(model, np.array([ids]), settings=s)[0], s))
    assert answers == asyncio.run(service_answers(worker, docs)), f"{family} {dtype} {steps}"


async def service_answers(worker: OnnxWorker, docs: list[list[int]]) -> list[list[int]]:
    """Each document's greedy and beam-3 summary from the decode scheduler over `worker`, one
    request at a time (each alone in the batch)."""
    from longdoc.model.search import resolve_settings
    from longdoc.service.batcher import DecodeScheduler, RequestState, WorkerSlot
    from longdoc.service.metrics import Metrics

    scheduler = DecodeScheduler("sum", WorkerSlot(lambda: worker, worker, 0), Metrics(), max_decode_batch=8,
                                max_queue_tokens=1 << 20, endpoint="summarize")
    scheduler.start()
    try:
        answers = []
        for ids in docs:
            for beams in (1, 3):
                settings = resolve_settings(worker.info.generation, max_new_tokens=STEPS, num_beams=beams)
                state = RequestState(deadline=time.monotonic() + 120)
                answers.append([t async for t in await scheduler.submit(ids, settings, state)])
        return answers
    finally:
        await scheduler.close()
