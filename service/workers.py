"""Workers: the only things that run a model. The seam to the HTTP side is narrow (as in
text-embeddings-inference's backend trait): `info`, `health()`, `max_batch_tokens`,
`warmup()`, `run(batch)` for encoders, and `begin`/`step`/`generate` for summarization.
A worker never sees a pydantic model or a request; the batcher calls it from one thread.
`step` returns raw next-token logits: the scheduler chooses tokens with model/search.py, per
sequence with its own `SearchSettings`. `generate(input_ids, settings, should_stop)` runs the
whole search (beam search) and calls `should_stop()` (from the worker thread) before every
decoder step, raising `GenerationStopped` when it returns true.

- `OnnxWorker`: `longdoc.export.runtime.OnnxModel` on ONNX Runtime's CPU execution provider
  (intra-op threads configurable), or on CUDA (`CudaWorker`).
- `FakeWorker`: a deterministic stand-in with a tiny in-code tokenizer, for API tests.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
from tokenizers import Tokenizer

from longdoc.export.generation import GenerationStopped, generated_tokens, search_defaults  # numpy only, no torch
from longdoc.model.search import SearchSettings, beam_search, greedy_search
from longdoc.export.runtime import parse_device

__all__ = ["GenerationStopped"]  # re-exported for the batcher


@dataclass(frozen=True, eq=False)
class ModelInfo:
    """What the router may know about a model (from its manifest)."""

    name: str
    task: str  # "qa" | "classify" | "summarize"
    max_length: int  # encoder tokens, specials included
    block_size: int
    tokenizer: Tokenizer
    special_tokens: dict[str, int | None]
    labels: tuple[str, ...] | None = None
    plan: str = ""
    attention: dict[str, Any] = field(default_factory=dict)
    dtype: str = "fp32"
    max_new_tokens: int = 256  # summarize: decoder positions available
    directory: str = ""
    # summarize: generation defaults under transformers' names (longdoc.export.generation.search_defaults),
    # what a request's settings are resolved against (longdoc.model.search.resolve_settings)
    generation: dict[str, Any] = field(default_factory=dict)
    summarize_input: str = "doc-eos"  # summarize: the encoder input's template (manifest.SUMMARIZE_INPUTS)


@dataclass(frozen=True)
class EncoderBatch:
    input_ids: np.ndarray  # (B, S) int64, padded with the pad id
    attention_mask: np.ndarray  # (B, S) int64, 1 = real token
    token_type_ids: np.ndarray | None  # (B, S) int64 or None


class Worker(Protocol):
    info: ModelInfo
    device: str
    max_batch_tokens: int

    def health(self) -> bool: ...
    def warmup(self) -> None: ...
    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]: ...  # outputs (B, S, ...)
    def begin(self, input_ids: list[list[int]]) -> list[Any]: ...  # summarize: encode, one state each
    def step(self, states: list[Any], tokens: list[int]) -> np.ndarray: ...  # (n, vocab) next-token logits
    def generate(self, input_ids: list[int], settings: SearchSettings,
                 should_stop: Callable[[], bool] | None = None) -> list[int]: ...  # generated tokens, no eos
    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# ONNX Runtime workers


def _info_from_model(name: str, directory: Path, model) -> ModelInfo:
    m = model.manifest
    max_new = 256
    if m.decoder:
        max_new = int(m.decoder.get("max_positions", 256)) - 1
    tok = model.tokenizer
    return ModelInfo(
        name=name,
        task=m.task,
        max_length=m.max_length,
        block_size=m.block_size,
        tokenizer=tok,
        special_tokens=dict(m.special_tokens),
        labels=tuple(m.labels) if m.labels else None,
        plan=str(m.attention.get("plan", "")),
        attention=dict(m.attention),
        dtype=m.dtype,
        max_new_tokens=max_new,
        directory=str(directory),
        generation=search_defaults(m) if m.task == "summarize" else {},
        summarize_input=m.summarize_input,
    )


@dataclass
class _DecodeState:
    """One sequence being summarized: its own encoder state and decoder KV cache, so that
    sequences of different ages can be stacked into one decoder step and leave it freely."""

    cross: list[np.ndarray]  # per decoder layer key, value: (1, H, Se, D)
    encoder_mask: np.ndarray  # (1, Se)
    past: list[np.ndarray]  # per decoder layer key, value: (1, H, P, D), P = length
    length: int = 0  # decoder tokens fed so far (= its next position id)


def _stack_padded(arrays: list[np.ndarray], axis: int, left: bool = False) -> np.ndarray:
    """Concatenate (1, ...) arrays along batch, zero-padding `axis` to the longest."""
    n = max(a.shape[axis] for a in arrays)
    out = []
    for a in arrays:
        pad = [(0, 0)] * a.ndim
        pad[axis] = (n - a.shape[axis], 0) if left else (0, n - a.shape[axis])
        out.append(np.pad(a, pad) if n != a.shape[axis] else a)
    return np.concatenate(out, axis=0)


class OnnxWorker:
    """ONNX Runtime on the CPU execution provider; threads = intra-op threads (None: ORT's choice)."""

    def __init__(self, name: str, directory: Path, device: str = "cpu", threads: int | None = None,
                 max_batch_tokens: int = 16384):
        from longdoc.export.runtime import OnnxModel  # torch-free

        self.device = device
        kind, device_id = parse_device(device)
        self.model = OnnxModel(directory, device=kind, threads=threads, device_id=device_id)
        self.info = _info_from_model(name, Path(directory), self.model)
        # the padded-token budget of one batch; a single sequence over it still runs (alone)
        self.max_batch_tokens = max_batch_tokens
        self._healthy = True

    def health(self) -> bool:
        return self._healthy

    def warmup(self) -> None:
        """One pass at the maximum length: allocates ORT's buffers and the layout cache."""
        s = self.info.max_length
        ids = np.full((1, s), self.info.special_tokens.get("sep") or 1, dtype=np.int64)
        if self.info.task == "summarize":
            states = self.begin([ids[0].tolist()])
            self.step(states, [self.info.special_tokens["decoder_start"]])
        else:
            self.run(EncoderBatch(ids, np.ones_like(ids), np.zeros_like(ids)))

    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]:
        try:
            return self.model.run_encoder(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        except Exception:
            self._healthy = False
            raise

    # summarization: one state per sequence; step() stacks sequences of different ages
    def begin(self, input_ids: list[list[int]]) -> list[_DecodeState]:
        longest = max(len(x) for x in input_ids)
        pad = self.info.special_tokens.get("pad") or 0
        ids = np.full((len(input_ids), longest), pad, dtype=np.int64)  # (B, S)
        mask = np.zeros_like(ids)
        for i, x in enumerate(input_ids):
            ids[i, : len(x)], mask[i, : len(x)] = x, 1
        enc = self.model.encode_for_decoding(ids, mask)  # cross: (B, H, Se, D) per layer k/v
        empty = self.model.empty_past(1)
        return [
            _DecodeState([c[i : i + 1] for c in enc.cross], enc.encoder_mask[i : i + 1], list(empty))
            for i in range(len(input_ids))
        ]

    def step(self, states: list[_DecodeState], tokens: list[int]) -> np.ndarray:
        from longdoc.export.runtime import EncoderState

        n_kv = len(states[0].past)
        cross = [_stack_padded([s.cross[k] for s in states], axis=2) for k in range(n_kv)]  # (B, H, Se, D)
        enc_mask = _stack_padded([s.encoder_mask for s in states], axis=1)  # (B, Se)
        # past left-padded to the oldest sequence; the self mask hides the padding
        past = [_stack_padded([s.past[k] for s in states], axis=2, left=True) for k in range(n_kv)]  # (B, H, P, D)
        P = past[0].shape[2]
        self_mask = np.zeros((len(states), P + 1), dtype=np.int64)  # (B, P + 1)
        for i, s in enumerate(states):
            self_mask[i, P - s.length :] = 1
        positions = np.array([[s.length] for s in states], dtype=np.int64)  # (B, 1)
        ids = np.array([[t] for t in tokens], dtype=np.int64)  # (B, 1)
        logits, present = self.model.decoder_step(EncoderState(cross, enc_mask), ids, positions, self_mask, past)
        for i, s in enumerate(states):
            s.past = [p[i : i + 1, :, P - s.length :] for p in present]  # (1, H, length + 1, D)
            s.length += 1
        return logits[:, -1]  # (B, V)

    def generate(self, input_ids: list[int], settings: SearchSettings,
                 should_stop: Callable[[], bool] | None = None) -> list[int]:
        from longdoc.export.generation import generate

        ids = np.asarray([input_ids], dtype=np.int64)
        out = generate(self.model, ids, np.ones_like(ids), should_stop, settings=settings)
        return generated_tokens(out[0], settings)

    def close(self) -> None:
        self.model = None


class IoBindingEncoder:
    """The encoder through ONNX Runtime I/O binding: the layout tables (identical for every
    batch of one padded length) are uploaded to the device once per length and bound as
    OrtValues; only ids and masks are copied per run. Works on any execution provider (the
    tests run it on CPU against `OnnxModel.run_encoder`). Uses OnnxModel's `_encoder_feed` and
    `sessions` (export/runtime.py) to build exactly the inputs `run_encoder` would."""

    def __init__(self, model, device_type: str = "cpu", device_id: int = 0, cache_size: int = 16):
        import onnxruntime as ort

        from longdoc.export.layout_feed import LAYOUT_INPUTS  # NumPy only: serve-only installs have no onnx

        self.ort = ort
        self.model = model
        self.session = model.sessions["encoder"]
        self.device_type, self.device_id = device_type, device_id
        self.layout_names = set(LAYOUT_INPUTS)
        self.outputs = [n for n in model.manifest.outputs if n in {o.name for o in self.session.get_outputs()}]
        self._layouts: dict[int, dict[str, Any]] = {}  # padded length -> name -> OrtValue on the device
        self.cache_size = cache_size

    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]:
        feed, S = self.model._encoder_feed(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        padded = feed["input_ids"].shape[1]
        binding = self.session.io_binding()
        cached = self._layouts.get(padded)
        if cached is None:
            cached = {k: self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), self.device_type, self.device_id)
                      for k, v in feed.items() if k in self.layout_names}
            if len(self._layouts) >= self.cache_size:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[padded] = cached
        for name, value in feed.items():
            if name in cached:
                binding.bind_ortvalue_input(name, cached[name])
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in self.outputs:
            binding.bind_output(name, "cpu")  # results come back to the host anyway
        self.session.run_with_iobinding(binding)
        result = {}
        for name, value in zip(self.outputs, binding.copy_outputs_to_cpu()):
            per_sequence = name == "logits" and self.model.manifest.task == "classify"
            result[name] = value if per_sequence else value[:, :S]
        return result


class IoBindingDecoder:
    """Greedy decoder steps through ONNX Runtime I/O binding, for the summarizer on a GPU: the
    batch's KV cache (`present_*`), its cross-attention keys/values and encoder mask stay on the
    device between steps; per step only the new token ids, position ids and the self mask go up
    and only the logits come back. Valid while the batch is the same sequences in the same order
    (the DecodeScheduler's steady state); when sequences join or leave, the device cache is copied
    back into each state's `past` (`release`) and the new batch is stacked on the host and
    uploaded, as `OnnxWorker.step` does. Works on any execution provider (tested on CPU against
    `OnnxWorker.step`, i.e. `OnnxModel.decoder_step`)."""

    def __init__(self, model, device_type: str = "cpu", device_id: int = 0):
        import onnxruntime as ort

        self.ort = ort
        self.model = model
        self.session = model.sessions["decoder"]
        self.device_type, self.device_id = device_type, device_id
        L = model.manifest.decoder["num_layers"]
        self.kv = [f"{kind}_{i}" for i in range(L) for kind in ("key", "value")]  # past order: key_0, value_0, ...
        self._batch: dict[str, Any] | None = None  # the batch whose caches live on the device
        self.uploads = 0  # times a batch was stacked and uploaded (tests: reuse between steps)

    def _device(self, a: np.ndarray):
        return self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.device_type, self.device_id)

    def release(self) -> None:
        """Copy the device KV cache back into the states' `past` and forget the device batch."""
        b, self._batch = self._batch, None
        if b is None:
            return
        host = [v.numpy() for v in b["past"]]  # (B, H, P, D)
        P = host[0].shape[2]
        for i, s in enumerate(b["states"]):
            s.past = [p[i : i + 1, :, P - s.length :] for p in host]

    def _upload(self, states: list[_DecodeState]) -> dict[str, Any]:
        n_kv = len(self.kv)
        cross = [_stack_padded([s.cross[k] for s in states], axis=2) for k in range(n_kv)]  # (B, H, Se, D)
        enc_mask = _stack_padded([s.encoder_mask for s in states], axis=1)  # (B, Se)
        past = [_stack_padded([s.past[k] for s in states], axis=2, left=True) for k in range(n_kv)]  # (B, H, P, D)
        self.uploads += 1
        return {"key": tuple(map(id, states)), "states": tuple(states), "P": past[0].shape[2],
                "past": [self._device(p) for p in past], "cross": [self._device(c) for c in cross],
                "encoder_mask": self._device(enc_mask)}

    def step(self, states: list[_DecodeState], tokens: list[int]) -> np.ndarray:
        b = self._batch
        if b is None or b["key"] != tuple(map(id, states)):  # the states are held by b: ids are unique
            self.release()
            b = self._upload(states)
        P = b["P"]
        self_mask = np.zeros((len(states), P + 1), dtype=np.int64)  # (B, P + 1), past left-padded
        for i, s in enumerate(states):
            self_mask[i, P - s.length :] = 1
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.array([[t] for t in tokens], dtype=np.int64))  # (B, 1)
        binding.bind_cpu_input("position_ids", np.array([[s.length] for s in states], dtype=np.int64))
        binding.bind_cpu_input("self_mask", self_mask)
        binding.bind_ortvalue_input("encoder_mask", b["encoder_mask"])
        for name, past, cross in zip(self.kv, b["past"], b["cross"]):
            binding.bind_ortvalue_input(f"past_{name}", past)
            binding.bind_ortvalue_input(f"cross_{name}", cross)
        binding.bind_output("logits", "cpu")
        for name in self.kv:
            binding.bind_output(f"present_{name}", self.device_type, self.device_id)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        logits = outputs[0].numpy()  # (B, 1, V)
        for s in states:
            s.past = None  # on the device until release()
            s.length += 1
        self._batch = dict(b, past=outputs[1:], P=P + 1)
        return logits[:, -1]


class CudaWorker(OnnxWorker):
    """One GPU: ONNX Runtime's CUDA execution provider (OnnxModel(device="cuda")), encoder runs
    through I/O binding (layout tables kept on the GPU per length). The model directory should
    hold an fp16 export (`longdoc export --dtype fp16`; a warning otherwise). Greedy decoder
    steps of a summarizer go through `IoBindingDecoder` (the KV cache stays on the GPU). Both
    I/O-binding paths are tested on CPU (tests/fake_cuda.py) and on a real GPU where there is one
    (tests/service/test_gpu.py; run on an H200: docs/gpu.md). `cuda:N` runs on GPU N (the CUDA
    provider's `device_id` option; `cuda` is GPU 0)."""

    def __init__(self, name: str, directory: Path, device: str = "cuda:0", threads: int | None = None,
                 max_batch_tokens: int = 16384):
        kind, device_id = parse_device(device)
        if kind != "cuda":
            raise ValueError(f"device {device!r}: CudaWorker needs cuda or cuda:N")
        super().__init__(name, directory, device=device, threads=threads, max_batch_tokens=max_batch_tokens)
        self.encoder = IoBindingEncoder(self.model, "cuda", device_id)
        self.decoder = IoBindingDecoder(self.model, "cuda", device_id) if self.info.task == "summarize" else None
        if self.info.dtype != "fp16":
            import logging

            logging.getLogger("longdoc.service").warning("model %s on %s is %s, not fp16", name, device,
                                                         self.info.dtype)

    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]:
        try:
            return self.encoder.run(batch)
        except Exception:
            self._healthy = False
            raise

    def step(self, states: list[_DecodeState], tokens: list[int]) -> np.ndarray:
        """One greedy decoder step; the batch's KV cache stays on the GPU between steps."""
        try:
            return self.decoder.step(states, tokens)
        except Exception:
            self._healthy = False
            raise


def onnx_worker_factory(name: str, directory: Path, device: str, settings) -> Worker:
    if device.startswith("cuda"):
        return CudaWorker(name, directory, device, settings.threads, settings.batch_tokens_for(device))
    return OnnxWorker(name, directory, device, settings.threads, settings.batch_tokens_for(device))


# ---------------------------------------------------------------------------------------------
# The fake worker (tests): deterministic "models" over a tiny word-level tokenizer.

FAKE_SPECIALS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "eos": 5, "bos": 6, "decoder_start": 0}
FAKE_GENERATION = {"eos_token_id": 5, "pad_token_id": 0, "decoder_start_token_id": 0}
FAKE_WORDS = ("gold", "good", "bad", "the", "is", "where", "what", "a", "of", "and", "answer")


def fake_tokenizer(extra_words: int = 200) -> Tokenizer:
    from tokenizers import models, normalizers, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "</s>": 5, "<s>": 6}
    for w in (*FAKE_WORDS, *(f"w{i}" for i in range(extra_words))):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


class FakeWorker:
    """qa: start and end logits peak on the token "gold"; classify: logits = counts of "bad" and
    "good" per window (labels bad, good); summarize: copies the document's first tokens, then
    eos. `delay_s` sleeps per run/step; `fail_runs` makes that many runs raise."""

    def __init__(self, name: str = "fake", task: str = "qa", max_length: int = 64, block_size: int = 8,
                 delay_s: float = 0.0, fail_runs: int = 0, summary_tokens: int = 6, max_batch_tokens: int = 4096):
        self.device = "cpu"
        self.tokenizer = fake_tokenizer()
        self.info = ModelInfo(
            name=name, task=task, max_length=max_length, block_size=block_size, tokenizer=self.tokenizer,
            special_tokens=dict(FAKE_SPECIALS), labels=("bad", "good") if task == "classify" else None,
            plan="hf-eval", max_new_tokens=64, generation=dict(FAKE_GENERATION),
        )
        self.max_batch_tokens = max_batch_tokens
        self.delay_s = delay_s
        self.fail_runs = fail_runs
        self.summary_tokens = summary_tokens
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.batches: list[tuple[int, int]] = []  # (batch size, padded length) per run
        self.steps: list[int] = []  # requests per decoder step
        self._lock = threading.Lock()
        self._healthy = True
        self.closed = False

    def health(self) -> bool:
        return self._healthy

    def warmup(self) -> None:
        n = self.info.max_length
        self.run(EncoderBatch(np.ones((1, n), np.int64), np.ones((1, n), np.int64), None))
        self.batches.clear()

    def _maybe_fail(self) -> None:
        with self._lock:
            if self.fail_runs > 0:
                self.fail_runs -= 1
                self._healthy = False
                raise RuntimeError("fake worker failure")

    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]:
        self._maybe_fail()
        if self.delay_s:
            time.sleep(self.delay_s)
        ids = batch.input_ids
        assert ids.shape[1] <= self.info.max_length, ids.shape
        self.batches.append(ids.shape)
        vocab = self.tokenizer.get_vocab()
        if self.info.task == "qa":
            hit = (ids == vocab["gold"]).astype(np.float32) * 10.0
            return {"start_logits": hit, "end_logits": hit.copy()}
        bad = (ids == vocab["bad"]).sum(axis=1)
        good = (ids == vocab["good"]).sum(axis=1)
        return {"logits": np.stack([bad, good], axis=1).astype(np.float32)}

    def begin(self, input_ids: list[list[int]]) -> list[Any]:
        self._maybe_fail()
        return [{"source": list(ids), "length": 0} for ids in input_ids]

    def step(self, states: list[Any], tokens: list[int]) -> np.ndarray:
        self.steps.append(len(states))
        return self._next_logits(states)

    def _next_logits(self, states: list[Any]) -> np.ndarray:
        if self.delay_s:
            time.sleep(self.delay_s)
        logits = np.zeros((len(states), self.vocab_size), np.float32)
        for i, s in enumerate(states):
            source = [t for t in s["source"] if t > FAKE_SPECIALS["bos"]]
            n = s["length"]
            nxt = source[n] if n < min(len(source), self.summary_tokens) else FAKE_SPECIALS["eos"]
            logits[i, nxt] = 1.0
            s["length"] += 1
        return logits

    def generate(self, input_ids: list[int], settings: SearchSettings,
                 should_stop: Callable[[], bool] | None = None) -> list[int]:
        """model/search.py over the decoder steps: the next token depends only on the position,
        so beams need no reordering."""
        states = self.begin([input_ids] * settings.num_beams)

        def next_logits(sequences: np.ndarray) -> np.ndarray:
            self.steps.append(1)  # one request, however many beams
            return self._next_logits(states)

        if settings.num_beams == 1:
            out = greedy_search(next_logits, 1, settings, should_stop)
        else:
            out = beam_search(next_logits, lambda rows: None, 1, settings, should_stop)
        return generated_tokens(out[0].tolist(), settings)

    def close(self) -> None:
        self.closed = True
