"""Metrics that dashboards and alerts depend on: `longdoc_ready` answers what /readyz answers (0
while warming up, 1 once ready, 0 while a worker is restarted and once draining), and
`longdoc_input_tokens_total` counts real input tokens, not padding."""

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from longdoc.service.app import create_app
from longdoc.service.batcher import EncoderBatcher, RequestState, WorkerSlot
from longdoc.service.batching import BatchingPolicy
from longdoc.service.metrics import Metrics
from longdoc.service.settings import Settings
from longdoc.testing.fake_worker import FakeWorker
from tests.polling import until, until_async
from tests.service.conftest import running_app

ROOT = Path(__file__).resolve().parents[2]


def run(coro):
    return asyncio.run(coro)


def sample(text: str, name: str, missing: float | None = None, **labels) -> float:
    """One sample of a /metrics body, as a scraper parses it (`missing`, if given, when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    if missing is not None:
        return missing
    raise KeyError(f"{name} {labels} not in /metrics")


class GatedWarmup(FakeWorker):
    """Warm-up waits for `gate` (so the test can look at the service while it warms up); then the
    first `fail_after_warmup` runs fail."""

    def __init__(self, gate: threading.Event, warming: threading.Event, fail_after_warmup: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.gate, self.warming, self.fail_after_warmup = gate, warming, fail_after_warmup

    def warmup(self) -> None:
        self.warming.set()
        assert self.gate.wait(10), "the test never opened the gate"
        super().warmup()
        self.fail_runs = self.fail_after_warmup


def test_ready_gauge_follows_readyz_through_warmup_failure_and_drain():
    gate, warming = threading.Event(), threading.Event()
    made = []

    def factory(name, directory, device, settings):
        # the first worker fails its first run; its replacement does not
        w = GatedWarmup(gate, warming, name=name, task="qa", fail_after_warmup=0 if made else 1)
        made.append(w)
        return w

    app = create_app(Settings(models={"qa": "qa"}, worker_restart_backoff_s=0.3), worker_factory=factory)

    async def ready_now(c) -> bool:
        return (await c.get("/readyz")).status_code == 200

    async def go():
        seen = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:

            async def look(phase):
                ready = (await c.get("/readyz")).status_code
                gauge = sample((await c.get("/metrics")).text, "longdoc_ready")
                seen.append((phase, ready, gauge))

            lifespan = app.router.lifespan_context(app)
            starting = asyncio.create_task(lifespan.__aenter__())
            await until_async(warming.is_set, "the worker is warming up", timeout_s=10)
            await look("warming up")
            gate.set()
            await starting
            await look("ready")
            failed = await c.post("/v1/qa", json={"question": "q", "document": "gold"})
            assert failed.status_code == 503, failed.text
            await look("worker restarting")
            await until_async(lambda: ready_now(c), "the restarted worker made the app ready", timeout_s=10)
            await look("restarted")
            app.state.service.begin_drain()  # what SIGTERM does first
            await look("draining")
            await lifespan.__aexit__(None, None, None)
            await look("stopped")
        return seen

    seen = run(go())
    assert seen == [
        ("warming up", 503, 0.0),
        ("ready", 200, 1.0),
        ("worker restarting", 503, 0.0),
        ("restarted", 200, 1.0),
        ("draining", 503, 0.0),
        ("stopped", 503, 0.0),
    ]
    assert len(made) == 2  # the failed worker was replaced


def test_input_tokens_count_real_tokens_of_a_mixed_length_batch():
    # three sequences of 9, 11 and 14 tokens share one batch (one 16-token bucket at block size 8):
    # the worker sees 3 x 14 (padded to the longest), the batch is charged 3 x 16, 34 are real
    lengths = (9, 11, 14)

    async def go():
        metrics = Metrics()
        worker = FakeWorker(name="qa", task="qa", block_size=8)
        policy = BatchingPolicy(max_batch_tokens=4096, max_batch_size=len(lengths), max_wait_s=5.0, bucket_size=8)
        engine = EncoderBatcher("qa", [WorkerSlot(lambda: worker, worker, 0)], policy, metrics,
                                max_queue_tokens=1 << 20, pad_id=0, endpoint="qa")
        engine.start()
        try:
            seqs = [(tuple(10 + (i % 50) for i in range(n)), None) for n in lengths]
            results = await engine.submit(seqs, RequestState(deadline=time.monotonic() + 10))
        finally:
            await engine.close()
        return worker, results, metrics.render()[0].decode()

    worker, results, text = run(go())
    assert worker.batches == [(3, 14)]  # one batch, mixed lengths
    assert [r.outputs["start_logits"].shape for r in results] == [(n,) for n in lengths]
    assert sample(text, "longdoc_input_tokens_total", model="qa", endpoint="qa") == sum(lengths) == 34
    assert sample(text, "longdoc_batch_tokens_sum", model="qa") == 48  # the padded cost, for contrast


def test_input_tokens_per_endpoint_through_the_api():
    async def go():
        async with running_app() as c:
            before = (await c.get("/metrics")).text
            r = [
                await c.post("/v1/qa", json={"question": "where is the gold", "document": "a gold"}),
                await c.post("/v1/classify", json={"document": "good good bad"}),
                await c.post("/v1/summarize", json={"document": "w1 w2 w3"}),
                await c.post("/v1/summarize", json={"document": "w1 w2 w3", "num_beams": 2}),
            ]
            return before, r, (await c.get("/metrics")).text

    before, responses, after = run(go())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    for model, endpoint in (("qa", "qa"), ("cls", "classify"), ("sum", "summarize")):
        assert sample(before, "longdoc_input_tokens_total", model=model, endpoint=endpoint) == 0  # exported from 0
    # qa: [CLS] 4 question tokens [SEP] 2 document tokens [SEP]; classify: [CLS] 3 [SEP];
    # summarize: 3 document tokens + eos, greedy (joins the decoding batch) and beam search
    assert sample(after, "longdoc_input_tokens_total", model="qa", endpoint="qa") == 9
    assert sample(after, "longdoc_input_tokens_total", model="cls", endpoint="classify") == 5
    assert sample(after, "longdoc_input_tokens_total", model="sum", endpoint="summarize") == 8


def test_ready_gauge_multiprocess_mode_is_the_minimum_over_processes(tmp_path):
    # two "processes" (the second in a subprocess) share PROMETHEUS_MULTIPROC_DIR: the pod is
    # ready only when both are
    code = (
        "import sys\n"
        "from longdoc.service.metrics import Metrics\n"
        "m = Metrics()\n"
        "m.track_readiness(lambda: sys.argv[1] == 'ready')\n"
        "print(m.render()[0].decode())\n"
    )
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}

    def process(state: str) -> str:
        out = subprocess.run([sys.executable, "-c", code, state], capture_output=True, text=True, env=env,
                             timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert sample(process("ready"), "longdoc_ready") == 1.0
    assert sample(process("ready"), "longdoc_ready") == 1.0  # both ready
    assert sample(process("loading"), "longdoc_ready") == 0.0  # one is not


class GatedSteps(FakeWorker):
    """A summarizer whose decoder steps past a sequence's first token wait for `gate`: a stream
    holds at its first token until the test opens the gate."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def step(self, states, tokens):
        if any(s["length"] >= 1 for s in states):
            assert self.gate.wait(10), "the test never opened the gate"
        return super().step(states, tokens)


def test_a_stream_is_measured_to_its_last_event():
    """in_flight counts a stream until its last event; request and inference durations are
    recorded then (not when the response object is returned after the first token), and the
    inference time of a stream is not 0. A stream whose client goes away leaves in_flight too."""
    from tests.service.conftest import ThreadServer

    worker = GatedSteps(name="sum", task="summarize")
    settings = Settings(models={"sum": "summarize"}, warmup=False)
    labels = dict(model="sum", endpoint="summarize", length_bucket="le_8")
    with ThreadServer(settings, worker_factory=lambda *args: worker) as server:
        def scrape():
            return httpx.get(server.url + "/metrics").text

        def scraped_once_not_in_flight():
            text = scrape()
            return None if sample(text, "longdoc_in_flight_requests", endpoint="summarize") else text

        def in_flight_after_the_stream():  # the server finishes a response after its last byte
            return until(scraped_once_not_in_flight, "the stream left the in-flight gauge", 10)

        with httpx.stream("POST", server.url + "/v1/summarize",
                          json={"document": "w1 w2 w3 w4", "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"ids"')
            during = scrape()  # the stream is at its first token, the next decoder step is held
            worker.gate.set()
            rest = [line for line in lines if line.startswith("data: ")]
        assert '"summary": "w1 w2 w3 w4"' in rest[-1]
        after = in_flight_after_the_stream()

        worker.gate = threading.Event()
        with httpx.stream("POST", server.url + "/v1/summarize",
                          json={"document": "w1 w2 w3 w4", "stream": True}, timeout=30) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        worker.gate.set()  # the client is gone; the next event finds it gone
        gone = in_flight_after_the_stream()
    assert sample(during, "longdoc_in_flight_requests", endpoint="summarize") == 1
    assert sample(during, "longdoc_request_duration_seconds_count", missing=0, **labels) == 0
    assert sample(after, "longdoc_in_flight_requests", endpoint="summarize") == 0
    assert sample(after, "longdoc_request_duration_seconds_count", **labels) == 1
    assert sample(after, "longdoc_inference_duration_seconds_count", **labels) == 1
    assert sample(after, "longdoc_inference_duration_seconds_sum", **labels) > 0
    assert sample(after, "longdoc_request_duration_seconds_sum", **labels) >= \
        sample(after, "longdoc_inference_duration_seconds_sum", **labels)
    assert sample(gone, "longdoc_in_flight_requests", endpoint="summarize") == 0


def test_time_to_first_token_of_streams():
    """Issue 38, item 9: streams had no time-to-first-token histogram. One observation per stream
    (none for a summary answered whole), within the request's whole time."""
    async def go():
        async with running_app(models={"sum": "summarize"}) as c:
            async with c.stream("POST", "/v1/summarize", json={"document": "w1 w2 w3 w4", "stream": True}) as r:
                assert r.status_code == 200
                await r.aread()
            assert (await c.post("/v1/summarize", json={"document": "w1 w2 w3 w4"})).status_code == 200
            return (await c.get("/metrics")).text

    text = run(go())
    first = dict(model="sum", length_bucket="le_8")
    assert sample(text, "longdoc_time_to_first_token_seconds_count", **first) == 1
    assert 0 < sample(text, "longdoc_time_to_first_token_seconds_sum", **first) <= \
        sample(text, "longdoc_request_duration_seconds_sum", endpoint="summarize", **first)


def test_metrics_have_no_created_series():
    async def go():
        async with running_app() as c:
            await c.post("/v1/qa", json={"question": "q", "document": "gold"})
            return (await c.get("/metrics")).text

    text = run(go())
    assert "longdoc_request_duration_seconds_count" in text
    assert [line for line in text.splitlines() if "_created" in line] == []
