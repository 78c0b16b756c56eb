"""Workers: the only things that run a model. The seam to the HTTP side is narrow (as in
text-embeddings-inference's backend trait): `info`, `health()`, `max_batch_tokens`,
`warmup()`, `run(batch)` for encoders, and `begin`/`step_greedy`/`release`/`generate` for
summarization. A worker never sees a pydantic model or a request; the batcher calls it from one
thread (and `begin` from a second one when `overlaps_encoding`). `step_greedy(states, tokens,
constraints)` returns each sequence's greedy token under its `StepConstraints` (model/search.py
`step_constraints`, per sequence with its own `SearchSettings`); `step` returns the raw
next-token logits (tests, benchmarks). `generate(input_ids, settings, should_stop)` runs the
whole search (beam search) and calls `should_stop()` (from the worker thread) before every
decoder step, raising `GenerationStopped` when it returns true.

- `OnnxWorker`: `longdoc.export.runtime.OnnxModel` on ONNX Runtime's CPU execution provider
  (intra-op threads configurable), or on CUDA (`CudaWorker`).

The tests' deterministic stand-in for a worker, `FakeWorker`, is in `longdoc.testing` (which the
service never imports).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
from tokenizers import Tokenizer

from longdoc.export.generation import generated_tokens, search_defaults  # numpy only, no torch
from longdoc.model.search import SearchSettings, StepConstraints, constrained_argmax
from longdoc.export.runtime import KEY_ALIGNMENT, aligned_key_length, aligned_self_mask, next_past_window, parse_device
from longdoc.service.batching import bucket_length, budget_groups


@dataclass(frozen=True, eq=False)
class ModelInfo:
    """What the router may know about a model (from its manifest)."""

    name: str
    task: str  # "qa" | "classify" | "summarize" | "embed"
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
    # embed: {"pooling", "normalize"} (manifest.embedding; the graph pools, the service normalizes)
    embedding: dict[str, Any] | None = None
    hidden_size: int = 0  # embed: the vectors' dimensions


@dataclass(frozen=True)
class EncoderBatch:
    input_ids: np.ndarray  # (B, S) int64, padded with the pad id
    attention_mask: np.ndarray  # (B, S) int64, 1 = real token
    token_type_ids: np.ndarray | None  # (B, S) int64 or None


class Worker(Protocol):
    info: ModelInfo
    device: str
    max_batch_tokens: int
    overlaps_encoding: bool  # summarize: `begin` may run on a second thread beside `step` (service/batcher.py)

    def health(self) -> bool: ...
    def warmup(self) -> None: ...
    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]: ...  # outputs (B, S, ...)
    def begin(self, input_ids: list[list[int]]) -> list[Any]: ...  # summarize: encode, one state each
    def step(self, states: list[Any], tokens: list[int]) -> np.ndarray: ...  # (n, vocab) next-token logits
    def step_greedy(self, states: list[Any], tokens: list[int],
                    constraints: list[StepConstraints]) -> list[int]: ...  # each one's greedy choice
    def release(self) -> None: ...  # summarize: nothing is decoding, free the batch's device state
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
        embedding=dict(m.embedding) if m.embedding else None,
        hidden_size=m.hidden_size,
    )


class OnnxWorker:
    """ONNX Runtime on the CPU execution provider; threads = intra-op threads (None: ORT's choice)."""

    overlaps_encoding = False  # see CudaWorker

    def __init__(self, name: str, directory: Path, device: str = "cpu", threads: int | None = None,
                 max_batch_tokens: int = 16384, decoder_steps: str | None = None):
        from longdoc.export.runtime import OnnxModel  # torch-free

        self.device = device
        kind, device_id = parse_device(device)
        self.model = OnnxModel(directory, device=kind, threads=threads, device_id=device_id)
        self.info = _info_from_model(name, Path(directory), self.model)
        # the padded-token budget of one batch; a single sequence over it still runs (alone)
        self.max_batch_tokens = max_batch_tokens
        self._healthy = True
        self.decoder = None
        if self.info.task == "summarize":
            steps = DEFAULT_DECODER_STEPS[kind] if decoder_steps in (None, "auto") else decoder_steps
            self.decoder = DeviceDecoder(self.model, kind, device_id, steps)

    def health(self) -> bool:
        return self._healthy

    def warmup(self) -> None:
        """One pass at the maximum length: allocates ORT's buffers and the layout cache."""
        s = self.info.max_length
        ids = np.full((1, s), self.info.special_tokens.get("sep") or 1, dtype=np.int64)
        if self.info.task == "summarize":
            states = self.begin([ids[0].tolist()])
            self.step(states, [self.info.special_tokens["decoder_start"]])
            self.release()
        else:
            self.run(EncoderBatch(ids, np.ones_like(ids), np.zeros_like(ids)))

    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]:
        return self._guard(self.model.run_encoder, batch.input_ids, batch.attention_mask, batch.token_type_ids)

    # summarization: one state per sequence, kept on the worker's device (DeviceDecoder)
    def begin(self, input_ids: list[list[int]]) -> list[DecodeState]:
        """Encode newcomers in encoder batches of one bucket each within this worker's token budget
        (`budget_groups`: each is encoded at the length it has alone), back to back; they join the
        running batch together, at its next step. Their states in `input_ids` order."""
        states: list[DecodeState | None] = [None] * len(input_ids)
        for group in budget_groups([len(x) for x in input_ids], self.max_batch_tokens, self.info.block_size):
            for i, state in zip(group, self._guard(self.decoder.begin, [input_ids[i] for i in group])):
                states[i] = state
        return states

    def step(self, states: list[DecodeState], tokens: list[int]) -> np.ndarray:
        return self._guard(self.decoder.step, states, tokens)

    def step_greedy(self, states: list[DecodeState], tokens: list[int],
                    constraints: list[StepConstraints]) -> list[int]:
        return self._guard(self.decoder.step_greedy, states, tokens, constraints)

    def release(self) -> None:
        """Nothing is decoding: free the running batch's device state."""
        if self.decoder is not None:
            self.decoder.release()

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except Exception:
            self._healthy = False
            raise

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
    OrtValues; only ids and masks are copied per run. Works on any execution provider (the tests
    run it on CPU against `OnnxModel.run_encoder`). Uses OnnxModel's `encoder_feed` and
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

    def bind_inputs(self, binding, feed: dict[str, np.ndarray]) -> int:
        """Bind one feed of `encoder_feed`; the bytes copied to the device (layout tables: once
        per padded length)."""
        padded = feed["input_ids"].shape[1]
        cached, copied = self._layouts.get(padded), 0
        if cached is None:
            cached = {k: self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), self.device_type, self.device_id)
                      for k, v in feed.items() if k in self.layout_names}
            copied += sum(feed[k].nbytes for k in cached)
            if len(self._layouts) >= self.cache_size:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[padded] = cached
        for name, value in feed.items():
            if name in cached:
                binding.bind_ortvalue_input(name, cached[name])
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
                copied += value.nbytes
        return copied

    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]:
        feed, S = self.model.encoder_feed(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        binding = self.session.io_binding()
        self.bind_inputs(binding, feed)
        for name in self.outputs:
            binding.bind_output(name, "cpu")  # results come back to the host anyway
        self.session.run_with_iobinding(binding)
        result = {}
        for name, value in zip(self.outputs, binding.copy_outputs_to_cpu()):
            per_sequence = name == "logits" and self.model.manifest.task == "classify"
            result[name] = value if per_sequence else value[:, :S]
        return result


@dataclass(eq=False)
class _EncodedGroup:
    """The sequences of one `DeviceDecoder.begin`: their cross-attention keys/values, on the device
    as the encoder wrote them, until their first step moves them into the running batch."""

    cross: list[Any]  # OrtValues, per decoder layer key, value: (n, H, Se, D)
    length: int  # Se: the group's encoder length (padded to the block size)


@dataclass(eq=False)
class DecodeState:
    """One sequence being summarized. Its encoder state and KV cache live on the worker's device:
    in its encoded group until its first step, then in the running batch (`DeviceDecoder._batch`).
    The host keeps only its encoder mask row and its length."""

    group: _EncodedGroup | None  # None once it is in the running batch
    row: int  # its row in `group`
    encoder_mask: np.ndarray  # (Se,) int64, 1 = real token
    length: int = 0  # decoder tokens fed so far (= its next position id)
    left: bool = False  # a step ran without it: it has left the batch for good

    @property
    def encoder_length(self) -> int:
        """Its encoder positions up to the last real token: the part of its cross state a batch
        keeps (a group's shorter sequences are padded to its longest)."""
        return int(np.flatnonzero(self.encoder_mask)[-1]) + 1


@dataclass(eq=False)
class _Batch:
    """The running decode batch on the device. Row r of every tensor is `states[r]`'s; a row whose
    sequence left (`left`) is masked until a newcomer takes it over or the batch is compacted."""

    states: list[DecodeState]
    ids: frozenset[int]
    cross: list[Any]  # slot buffers, OrtValues (capacity, H, Se, D), right-padded; rows >= B unused
    # dynamic steps: OrtValues (B, H, P, D), left-padded (P a multiple of KEY_ALIGNMENT), masked;
    # fixed-shape steps: the cache, OrtValues (capacity, H, P, D), a row's position t at index t
    past: list[Any]
    encoder_mask: Any  # OrtValue (B or capacity, Se) int64
    Se: int
    P: int

    @property
    def capacity(self) -> int:
        return self.cross[0].shape()[0]


DECODER_STEPS = ("dynamic", "fixed", "captured")
# how a device runs decoder steps unless the settings say (`decoder_steps`); on the CPU both ways
# keep a sequence's logits bitwise those it has decoding alone (export/runtime.py `KEY_ALIGNMENT`), and
# the choice is their measurement (docs/benchmarks.md, "Fixed-shape decoder steps")
DEFAULT_DECODER_STEPS = {"cpu": "dynamic", "cuda": "captured"}


class _FixedShapes:
    """The device buffers and sessions of fixed-shape decoder steps: one set per shape, allocated
    on first use and kept for the worker's life, so that every tensor a step touches has the same
    shape and address each time (a captured CUDA graph replays at the addresses it was captured
    with). Buffers are keyed by the dimensions they depend on: capacity (rows), Se (encoder length
    bucket), P (cache length), K (banned tokens per row)."""

    MAX_STEP_SESSIONS = 8  # decoder sessions kept, the most recently used (each holds the weights)

    def __init__(self, decoder: DeviceDecoder, cuda_graph: bool):
        from collections import OrderedDict

        self.decoder, self.cuda_graph = decoder, cuda_graph
        self._buffers: dict[tuple, list[Any]] = {}
        self._steps: OrderedDict[tuple, tuple] = OrderedDict()  # (capacity, Se, P) -> session, its binding
        self._tails: dict[tuple, tuple] = {}  # (capacity, P, K) -> tail session, its binding
        self.runs: Counter[tuple] = Counter()  # runs per step shape (the first ones capture)

    def buffers(self, kind: str, shape: list[int], dtype, n: int = 1, zero: bool = False) -> list[Any]:
        key = (kind, tuple(shape))
        found = self._buffers.get(key)
        if found is None:
            d = self.decoder
            found = self._buffers[key] = [d.regroup.ort.OrtValue.ortvalue_from_shape_and_type(
                shape, dtype, d.device_type, d.device_id) for _ in range(n)]
            if zero:  # masked positions and unused rows must hold finite values
                d.regroup.fill(found)
        return found

    def cross(self, capacity: int, Se: int) -> list[Any]:
        d = self.decoder
        # zeroed: the step runs every row, the unused ones too, and an int8 graph quantizes each
        # activation with one scale over all rows (a NaN left in memory would reach every row)
        return self.buffers("cross", [capacity, d.heads, Se, d.head_dim], d.model.float_type, len(d.kv), zero=True)

    def cache(self, capacity: int, P: int) -> list[Any]:
        d = self.decoder
        return self.buffers("cache", [capacity, d.heads, P, d.head_dim], d.model.float_type, len(d.kv), zero=True)

    def step(self, capacity: int, Se: int, P: int):
        """The decoder session of this shape (free-dimension overrides), bound once to its buffers."""
        key = (capacity, Se, P)
        if key not in self._steps:
            d, g = self.decoder, self.decoder.graph
            session = self._session(lambda capture: d.model.fixed_decoder_session(g.dimensions(capacity, P, Se),
                                                                                  capture))
            binding = session.io_binding()
            for name, shape in zip(g.STEP_INPUTS, ([capacity, 1], [capacity, 1], [capacity, P + 1])):
                binding.bind_ortvalue_input(name, self.buffers(name, shape, np.int64)[0])
            binding.bind_ortvalue_input(g.ENCODER_MASK, self.buffers(g.ENCODER_MASK, [capacity, Se], np.int64)[0])
            for names, values in ((g.past, self.cache(capacity, P)), (g.cross, self.cross(capacity, Se))):
                for name, value in zip(names, values):
                    binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(g.LOGITS, self.buffers(g.LOGITS, [capacity, 1, d.vocab], np.float32)[0])
            for name, value in zip(g.present, self.present(capacity, P)):
                binding.bind_ortvalue_output(name, value)
            self._steps[key] = (session, binding)
            while len(self._steps) > self.MAX_STEP_SESSIONS:  # a shape seen again is built and captured again
                gone = self._steps.popitem(last=False)[0]
                for shape in [s for s in self.runs if s[:3] == gone]:
                    del self.runs[shape]
        self._steps.move_to_end(key)
        return self._steps[key]

    def _session(self, build):
        """build(capture) -> a session. ONNX Runtime refuses to capture a graph that has a node off
        the CUDA provider: then this worker's steps run uncaptured from here on, and say so."""
        if self.cuda_graph:
            try:
                return build(True)
            except Exception as exc:
                import logging

                logging.getLogger("longdoc.service").warning(
                    "CUDA graph capture refused (%s: %s); fixed-shape decoder steps run uncaptured",
                    type(exc).__name__, exc)
                self.cuda_graph = False
        return build(False)

    def present(self, capacity: int, P: int) -> list[Any]:
        d = self.decoder
        return self.buffers("present", [capacity, d.heads, P + 1, d.head_dim], d.model.float_type, len(d.kv))

    def tail(self, capacity: int, P: int, K: int):
        """The step's tail (service/regroup.py `step_tail_graph`): cache write and greedy choice."""
        key = (capacity, P, K)
        if key not in self._tails:
            import onnxruntime as ort

            from longdoc.service.regroup import small_graph_options, step_tail_graph

            d, g = self.decoder, self.decoder.graph
            options = small_graph_options()
            graph = step_tail_graph(d.model.float_type, len(d.kv), capacity, d.heads, P, d.head_dim, d.vocab, K)
            captured = [("CUDAExecutionProvider", {"device_id": d.device_id, "enable_cuda_graph": "1"})]
            session = self._session(lambda capture: ort.InferenceSession(
                graph, options, providers=captured if capture else d.regroup.providers))
            binding = session.io_binding()
            binding.bind_ortvalue_input("position_ids", self.buffers("position_ids", [capacity, 1], np.int64)[0])
            binding.bind_ortvalue_input("logits", self.buffers(g.LOGITS, [capacity, 1, d.vocab], np.float32)[0])
            binding.bind_ortvalue_input("banned", self.buffers("banned", [capacity, K], np.int64)[0])
            for i, (present, cache) in enumerate(zip(self.present(capacity, P), self.cache(capacity, P))):
                binding.bind_ortvalue_input(f"present{i}", present)
                binding.bind_ortvalue_input(f"cache{i}", cache)
                binding.bind_ortvalue_output(f"cache_out{i}", cache)  # in place
            binding.bind_ortvalue_output("tokens", self.buffers("tokens", [capacity], np.int64)[0])
            self._tails[key] = (session, binding)
        return self._tails[key]


class DeviceDecoder:
    """Iteration-level decoding with the decode state on the worker's device (issue 24). A
    sequence's cross-attention keys/values are written there by the encoder (`begin`: its outputs
    are bound to the device) and never cross to the host. The running batch keeps the cross state
    in slot buffers (`_assemble`): a newcomer is written into a free row by `Regroup` on the
    device, the other rows stay; the host sends only per-step tensors: token ids, position ids,
    the self mask, and the encoder mask when the batch changes. `copied` counts the bytes sent to
    the device by kind, `fetched` those read back, `regroup.moved` those written device-to-device.
    The same code runs on the CPU provider (the CPU worker) and CUDA.

    `steps` (DECODER_STEPS), how a step runs:
    - "dynamic": the batch's live rows at their own lengths (rounded up to KEY_ALIGNMENT); the KV
      cache (`present_*`) becomes the next step's `past_*`, left-padded to KEY_ALIGNMENT positions
      again (one device copy of the small cache a step); logits come to the host.
    - "fixed": every tensor a step touches is fixed in shape and address (`_FixedShapes`): the
      batch at its capacity (unused rows masked), the cross state padded to a power-of-two
      number of blocks, the self-attention cache preallocated (a power of two of positions, grown
      by doubling) and written in place at each row's position by the step's tail
      (ScatterND), positions not yet written masked; the decoder session has every
      symbolic dimension fixed, one per shape. Greedy steps choose on the device (ArgMax after
      the banned tokens) and only the token ids come to the host (`step_greedy`).
    - "captured": "fixed", and ONNX Runtime captures each shape's step and tail as CUDA graphs and
      replays them (CUDA only). While a shape is captured, nothing else may run on the GPU, so
      its first runs and the encoder exclude each other (`_exclusive`)."""

    # A sequence's logits do not depend on its batch, and are those `longdoc eval` gets (issue 40):
    # every key axis aligned by export/runtime.py's rule (KEY_ALIGNMENT says why)
    MIN_CACHE = KEY_ALIGNMENT  # positions of the smallest fixed-shape cache (a power of two)
    CAPTURE_RUNS = 2  # ONNX Runtime runs a graph once, then captures it on the next run

    def __init__(self, model, device_type: str = "cpu", device_id: int = 0, steps: str = "dynamic"):
        import threading

        from longdoc.export.runtime import execution_providers
        from longdoc.service.regroup import Regroup

        if steps not in DECODER_STEPS:
            raise ValueError(f"decoder steps must be one of {', '.join(DECODER_STEPS)}, got {steps!r}")
        if steps == "captured" and model.device != "cuda":
            raise ValueError(f"decoder steps 'captured' (CUDA graphs) need a cuda device, not {model.device!r}")
        self.model = model
        self.graph = model.decoder_graph
        self.session = model.sessions["decoder"]
        d = model.manifest.decoder
        self.kv = self.graph.kv  # past order
        self.heads, self.head_dim = d["num_heads"], d["head_dim"]
        self.vocab = model.decoder_vocab_size() if steps != "dynamic" else None
        self.max_positions = int(d.get("max_positions", 256))
        self.steps = steps
        self.encoder = IoBindingEncoder(model, device_type, device_id)
        self.regroup = Regroup(model.float_type, 4, execution_providers(model.device, model.device_id),
                               device_type, device_id)
        self.device_type, self.device_id = device_type, device_id
        self.fixed = _FixedShapes(self, steps == "captured") if steps != "dynamic" else None
        self._exclusive = threading.Lock()
        self._batch: _Batch | None = None
        self.copied: Counter[str] = Counter()  # host -> device bytes: encoder_inputs, masks, step_inputs, past
        self.fetched: Counter[str] = Counter()  # device -> host bytes: logits, tokens
        self.regroups = 0  # times the batch was reassembled (joins and leaves)

    def begin(self, input_ids: list[list[int]]) -> list[DecodeState]:
        """Encode a group of sequences; their cross keys/values stay on the device."""
        longest = max(len(x) for x in input_ids)
        pad = self.model.manifest.special_tokens.get("pad") or 0
        ids = np.full((len(input_ids), longest), pad, dtype=np.int64)  # (n, S)
        mask = np.zeros_like(ids)
        for i, x in enumerate(input_ids):
            ids[i, : len(x)], mask[i, : len(x)] = x, 1
        feed, _ = self.model.encoder_feed(ids, mask)
        binding = self.encoder.session.io_binding()
        self.copied["encoder_inputs"] += self.encoder.bind_inputs(binding, feed)
        for name in self.graph.cross:
            binding.bind_output(name, self.device_type, self.device_id)
        with self._exclusive:  # never while a CUDA graph is being captured
            self.encoder.session.run_with_iobinding(binding)
        enc_mask = feed["attention_mask"]  # (n, Se), padded to the block size
        group = _EncodedGroup(binding.get_outputs(), enc_mask.shape[1])
        return [DecodeState(group, i, enc_mask[i]) for i in range(len(input_ids))]

    def release(self) -> None:
        self._batch = None

    # the running batch, read-only (empty or 0 when none runs): what a step did, for tests and probes
    @property
    def rows(self) -> list[DecodeState]:
        """Each row's sequence, those that left included (masked until a newcomer takes the row
        or the batch is compacted)."""
        return list(self._batch.states) if self._batch else []

    @property
    def capacity(self) -> int:
        """Rows the slot buffers have room for."""
        return self._batch.capacity if self._batch else 0

    @property
    def source_length(self) -> int:
        """The slot buffers' encoder length (Se)."""
        return self._batch.Se if self._batch else 0

    @property
    def past_length(self) -> int:
        """The length (P) of the self-attention past the next step reads (fixed-shape steps: the cache's)."""
        return self._batch.P if self._batch else 0

    @property
    def cross_addresses(self) -> list[int]:
        """The device addresses of the slot buffers (cross keys/values)."""
        return [v.data_ptr() for v in self._batch.cross] if self._batch else []

    def _upload(self, kind: str, a: np.ndarray):
        self.copied[kind] += a.nbytes
        return self.regroup.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.device_type,
                                                             self.device_id)

    def _source_length(self, n: int) -> int:
        """The slot buffers' encoder length for a longest sequence of n positions: n rounded up to
        KEY_ALIGNMENT for dynamic steps; fixed-shape steps pad it to a power-of-two number of
        blocks, a block rounded up to KEY_ALIGNMENT positions (at most the model's longest input,
        so rounded up), so that few shapes serve every length."""
        if self.fixed is None:
            return aligned_key_length(n)
        unit = aligned_key_length(self.model.manifest.block_size)
        longest = bucket_length(self.model.manifest.max_length, unit)
        return min(unit << (-(-n // unit) - 1).bit_length(), longest)

    def _cache_length(self, n: int) -> int:
        """A fixed-shape cache for rows of up to n positions: a power of two, at least MIN_CACHE."""
        return max(self.MIN_CACHE, 1 << (n - 1).bit_length())

    def _assemble(self, states: list[DecodeState]) -> _Batch:
        """The batch for `states` (the running batch's rows, newcomers from `begin`). The cross
        keys/values live in slot buffers with room for `capacity` rows, and the step reads the
        first B rows in place (fixed-shape steps: all of them). A newcomer is written into the row
        of a sequence that left, else the next row, and nothing else is copied; once as many rows
        have left as are live, the live rows past the first ones move down into rows that left
        (one row copy each). All live rows are copied, into new buffers, only when the batch
        outgrows them (to the next power of two), a newcomer's encoder length is longer than
        theirs, or the longest live sequence needs at most half their length (every step reads
        the whole length)."""
        old = self._batch
        wanted = {id(s) for s in states}
        new = [s for s in states if old is None or id(s) not in old.ids]
        if any(s.group is None for s in new):
            raise ValueError("a sequence that left the decode batch cannot rejoin it (its state was freed)")
        rows = list(old.states) if old else []  # row -> its sequence, those that left included
        at = {id(s): r for r, s in enumerate(rows)}  # the rows of the batch's tensors now
        stay = [s for s in rows if id(s) in wanted]
        Se = self._source_length(max(s.encoder_length for s in stay + new))
        order: list = [s if id(s) in wanted else None for s in rows]  # None: a row that left
        for s in new:  # newcomers take over rows that left, then append
            hole = next((r for r, x in enumerate(order) if x is None), len(order))
            order[hole:hole + 1] = [s]
        live = len(stay) + len(new)
        if len(order) - live >= max(1, live):  # compacted: the live rows past `live` move down
            tops = [r for r in range(live, len(order)) if order[r] is not None]
            for hole, top in zip([r for r in range(live) if order[r] is None], tops):
                order[hole] = order[top]
            order = order[:live]
        moved: list[tuple[int, int]] = []
        in_place = old is not None and len(order) <= old.capacity and old.Se // 2 < Se <= old.Se
        if in_place:
            Se, cross, capacity = old.Se, old.cross, old.capacity
            moved = [(at[id(s)], r) for r, s in enumerate(order) if s in stay and at[id(s)] != r]
            for src, dst in moved:  # into rows that left: source and destination never overlap
                self.regroup.take(cross, [src], 2, 0, Se, into=(cross, dst))
            order = [x if x is not None else rows[r] for r, x in enumerate(order)]  # left rows stay, masked
        else:  # new buffers: the live rows first, in order, then the newcomers
            order = stay + new
            capacity = max(1 << (len(order) - 1).bit_length(), old.capacity if old else 1)
            shape = [capacity, self.heads, Se, self.head_dim]
            cross = self.fixed.cross(capacity, Se) if self.fixed else self.regroup.allocate(shape, len(self.kv))
            if stay:
                self.regroup.take(old.cross, [at[id(s)] for s in stay], 2, 0, min(old.Se, Se),
                                  pad_after=max(0, Se - old.Se), into=(cross, 0))
        for r, s in enumerate(order):  # each newcomer into its row
            if s in new:
                n = s.encoder_length
                self.regroup.take(s.group.cross, [s.row], 2, 0, n, pad_after=Se - n, into=(cross, r))
        # where each row's self-attention cache comes from: its own row, else (newcomers, who have
        # none, and rows that left, who need none) any row's, masked
        source = [at[id(s)] if id(s) in at else r if r < len(rows) else at[id(stay[0])] for r, s in enumerate(order)] \
            if stay else []
        past, P = self._assemble_past(old, stay, source, moved, capacity, len(order), in_place)
        enc_mask = np.zeros((capacity if self.fixed else len(order), Se), np.int64)  # (B, Se)
        for i, s in enumerate(order):
            n = min(Se, len(s.encoder_mask))  # a row that left may be longer than the rebuilt buffers: it is masked
            enc_mask[i, :n] = s.encoder_mask[:n]
        if self.fixed:
            mask = self.fixed.buffers(self.graph.ENCODER_MASK, list(enc_mask.shape), np.int64)[0]
            mask.update_inplace(enc_mask)
            self.copied["masks"] += enc_mask.nbytes
        else:
            mask = self._upload("masks", enc_mask)
        for s in new:
            s.group = None
        self.regroups += 1
        return _Batch(order, frozenset(map(id, order)), cross, past, mask, Se, P)

    def _assemble_past(self, old: _Batch | None, stay: list[DecodeState], source: list[int],
                       moved: list[tuple[int, int]], capacity: int, rows: int, in_place: bool) -> tuple[list[Any], int]:
        """The batch's self-attention cache and its length P: dynamic steps, the live rows' last
        positions, left-padded to P, the longest rounded up to KEY_ALIGNMENT; fixed-shape steps, the cache of P positions (P from
        `_cache_length`, kept while the longest row needs more than a quarter of it), in place
        when the capacity and P stay (rows moved down by a compaction move with their cache)."""
        longest = max((s.length for s in stay), default=0)  # rows that left need no past: any values do
        if self.fixed is None:  # left-padded to a multiple of KEY_ALIGNMENT
            P = aligned_key_length(longest)
            if stay and P == old.P:  # the rows in their new order (nothing copied if it is the same)
                return self.regroup.take(old.past, source, 2, 0, P), P
            if stay:
                return self.regroup.take(old.past, source, 2, old.P - longest, old.P, pad_before=P - longest), P
            past = self.regroup.allocate([rows, self.heads, P, self.head_dim], len(self.kv))
            self.regroup.fill(past)  # masked; zeros on the device, nothing sent from the host
            return past, P
        P = self._cache_length(longest + 1)
        if old is not None and old.P >= longest + 1 and old.P // 4 < P:
            P = old.P
        cache = self.fixed.cache(capacity, P)
        if old is None or not stay:
            return cache, P
        if cache is old.past and in_place:
            for src, dst in moved:  # as the cross state's: into rows that left
                self.regroup.take(cache, [src], 2, 0, P, into=(cache, dst))
        elif cache is old.past:  # the same buffers, the rows in a new order: through a copy
            reordered = self.regroup.take(old.past, source, 2, 0, P)
            self.regroup.take(reordered, list(range(rows)), 2, 0, P, into=(cache, 0))
        else:
            keep = min(old.P, P)
            self.regroup.take(old.past, source, 2, 0, keep, pad_after=P - keep, into=(cache, 0))
        return cache, P

    def _batch_for(self, states: list[DecodeState]) -> _Batch:
        """The running batch with `states` in it: reassembled when a newcomer joins, as many rows
        have left as are live, or (fixed-shape steps) a row's next position is past the cache."""
        if any(s.left for s in states):
            raise ValueError("a sequence that left the decode batch cannot rejoin it (its state was freed)")
        b = self._batch
        wanted = {id(s) for s in states}
        if b is not None:
            for s in b.states:
                s.left = s.left or id(s) not in wanted
        dead = 0 if b is None else sum(s.left for s in b.states)
        full = self.fixed is not None and b is not None and max((s.length for s in states), default=0) >= b.P
        if b is None or not wanted <= b.ids or dead >= max(1, len(states)) or full:
            b = self._batch = self._assemble(states)
        return b

    def step(self, states: list[DecodeState], tokens: list[int]) -> np.ndarray:
        """One decoder step for `states` (any order; newcomers from `begin` join here, absent ones
        leave for good): (n, V) next-token logits, rows in `states` order."""
        b = self._batch_for(states)
        logits = self._run(b, states, tokens, None)
        self.fetched["logits"] += logits.nbytes
        rows = [r for r, s in enumerate(b.states) if not s.left]
        at = {id(s): i for i, s in enumerate(states)}
        out = np.empty((len(states), logits.shape[1]), logits.dtype)
        out[[at[id(b.states[r])] for r in rows]] = logits[rows]
        self._advance(b)
        return out

    def step_greedy(self, states: list[DecodeState], tokens: list[int],
                    constraints: list[StepConstraints]) -> list[int]:
        """One decoder step and each sequence's greedy choice under its `constraints`
        (longdoc.model.search.step_constraints): `greedy_tokens`' token ids, in `states` order.
        Fixed-shape steps choose on the device and fetch only the ids; dynamic steps fetch the
        logits and choose on the host."""
        if self.fixed is None:
            return [constrained_argmax(row, c) for row, c in zip(self.step(states, tokens), constraints)]
        b = self._batch_for(states)
        chosen = self._run(b, states, tokens, constraints)
        self.fetched["tokens"] += chosen.nbytes
        row_of = {id(s): r for r, s in enumerate(b.states)}
        self._advance(b)
        return [min(c.forced) if c.forced else int(chosen[row_of[id(s)]]) for s, c in zip(states, constraints)]

    def _advance(self, b: _Batch) -> None:
        for s in b.states:
            s.length += not s.left

    def _run(self, b: _Batch, states: list[DecodeState], tokens: list[int],
             constraints: list[StepConstraints] | None) -> np.ndarray:
        """Run one step of batch `b`: (rows of b, V) logits, or with `constraints` (fixed-shape
        steps only) the rows' greedy token ids (capacity,)."""
        at = {id(s): i for i, s in enumerate(states)}
        P = b.P
        rows = b.capacity if self.fixed else len(b.states)
        width = P + 1
        ids = np.zeros((rows, 1), dtype=np.int64)  # rows that left (and unused ones): token 0 at position 0,
        positions = np.zeros((rows, 1), dtype=np.int64)  # attending to itself
        for i, s in enumerate(b.states):
            if not s.left:
                ids[i, 0], positions[i, 0] = tokens[at[id(s)]], s.length
        if self.fixed is None:  # the past right-aligned: each row's last `length` positions
            self_mask = aligned_self_mask(P, [0 if s.left else s.length for s in b.states])  # (B, P + 1)
            return self._run_dynamic(b, ids, positions, self_mask)
        self_mask = np.zeros((rows, width), dtype=np.int64)  # (capacity, P + 1): the cache's first `length`
        self_mask[:, P] = 1
        for i, s in enumerate(b.states):
            if not s.left:
                self_mask[i, : s.length] = 1
        K = max([4] + [len(c.banned) for c in constraints or []])  # a power of two: few tail shapes
        K = 1 << (K - 1).bit_length()
        banned = np.full((rows, K), self.vocab, np.int64)  # `vocab`: no token
        for i, s in enumerate(b.states):
            if constraints is not None and not s.left:
                c = [t for t in constraints[at[id(s)]].banned if t < self.vocab]
                banned[i, : len(c)] = c
        f = self.fixed
        session, binding = f.step(rows, b.Se, P)
        tail, tail_binding = f.tail(rows, P, K)
        for name, value in zip(self.graph.STEP_INPUTS + ("banned",), (ids, positions, self_mask, banned)):
            f.buffers(name, list(value.shape), np.int64)[0].update_inplace(value)
            self.copied["step_inputs"] += value.nbytes
        shape = (rows, b.Se, P, K)
        capturing = f.cuda_graph and f.runs[shape] < self.CAPTURE_RUNS
        f.runs[shape] += 1
        if capturing:
            self._exclusive.acquire()
        try:
            session.run_with_iobinding(binding)
            tail.run_with_iobinding(tail_binding)
        finally:
            if capturing:
                self._exclusive.release()
        if constraints is not None:
            return f.buffers("tokens", [rows], np.int64)[0].numpy()
        return f.buffers(self.graph.LOGITS, [rows, 1, self.vocab], np.float32)[0].numpy()[:, -1]

    def _run_dynamic(self, b: _Batch, ids: np.ndarray, positions: np.ndarray, self_mask: np.ndarray) -> np.ndarray:
        g, B = self.graph, len(b.states)
        binding = self.session.io_binding()
        for name, value in zip(g.STEP_INPUTS, (ids, positions, self_mask)):
            binding.bind_cpu_input(name, value)
            self.copied["step_inputs"] += value.nbytes
        binding.bind_ortvalue_input(g.ENCODER_MASK, b.encoder_mask)
        view = [B, self.heads, b.Se, self.head_dim]  # the first B rows of the slot buffers, in place
        for past_name, cross_name, past, cross in zip(g.past, g.cross, b.past, b.cross):
            binding.bind_ortvalue_input(past_name, past)
            binding.bind_input(cross_name, self.device_type, self.device_id, self.model.float_type, view,
                               cross.data_ptr())
        binding.bind_output(g.LOGITS, "cpu")
        for name in g.present:
            binding.bind_output(name, self.device_type, self.device_id)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        # the next step's past, (B, H, P + 1, D) with the new keys at P, left-padded to a multiple of
        # KEY_ALIGNMENT again
        longest = max((s.length for s in b.states if not s.left), default=0) + 1
        start, stop, pad_before = next_past_window(b.P, longest)
        b.past = self.regroup.take(outputs[1:], list(range(B)), 2, start, stop, pad_before=pad_before)
        b.P = stop - start + pad_before
        return outputs[0].numpy()[:, -1]  # (B, V)


class CudaWorker(OnnxWorker):
    """One GPU: ONNX Runtime's CUDA execution provider (OnnxModel(device="cuda")), encoder runs
    through I/O binding (layout tables kept on the GPU per length). The model directory should
    hold an fp16 export (`longdoc export --dtype fp16`; a warning otherwise). A summarizer's decode
    state stays on the GPU (`DeviceDecoder`, as on the CPU worker). Both I/O-binding paths are
    tested on CPU (tests/fake_cuda.py) and on a real GPU where there is one
    (tests/service/test_gpu.py; run on an H200: docs/gpu.md). `cuda:N` runs on GPU N (the CUDA
    provider's `device_id` option; `cuda` is GPU 0)."""

    # a summarizer's newcomers are encoded on a second thread while the running batch's decoder
    # steps go on (service/batcher.py): on a GPU the two share the device well (small decoder
    # kernels leave it mostly idle); on the CPU both would compete for the same cores
    overlaps_encoding = True


    def __init__(self, name: str, directory: Path, device: str = "cuda:0", threads: int | None = None,
                 max_batch_tokens: int = 16384, decoder_steps: str | None = None):
        kind, device_id = parse_device(device)
        if kind != "cuda":
            raise ValueError(f"device {device!r}: CudaWorker needs cuda or cuda:N")
        super().__init__(name, directory, device=device, threads=threads, max_batch_tokens=max_batch_tokens,
                         decoder_steps=decoder_steps)
        self.encoder = IoBindingEncoder(self.model, "cuda", device_id)
        if self.info.dtype != "fp16":
            import logging

            logging.getLogger("longdoc.service").warning("model %s on %s is %s, not fp16", name, device,
                                                         self.info.dtype)

    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]:
        return self._guard(self.encoder.run, batch)


def onnx_worker_factory(name: str, directory: Path, device: str, settings) -> Worker:
    cls = CudaWorker if device.startswith("cuda") else OnnxWorker
    worker = cls(name, directory, device, settings.threads, settings.batch_tokens_for(device),
                 getattr(settings, "decoder_steps", "auto"))
    if getattr(settings, "overlap_encoding", None) is not None:  # else the worker class's default
        worker.overlaps_encoding = settings.overlap_encoding
    return worker

