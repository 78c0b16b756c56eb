"""Run an exported model directory with ONNX Runtime. No torch, no transformers: this is the
service worker's only engine (docs/DESIGN.md, "export/runtime.py").

The host side of the block-sparse graph lives here: for each padded length it builds the layout
table with `longdoc.model.layout.build_layout` (NumPy), stacks it over layers and caches it, then feeds
it as graph inputs next to the token ids.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from longdoc.export.manifest import TOKENIZER_NAME, Manifest
from longdoc.export.layout_feed import LAYOUT_INPUTS, dense_layout_feed, layout_feed, without_window

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def parse_device(device: str) -> tuple[str, int]:
    """"cpu" -> ("cpu", 0); "cuda" -> ("cuda", 0); "cuda:N" -> ("cuda", N)."""
    if device == "cpu":
        return "cpu", 0
    if device == "cuda":
        return "cuda", 0
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    return "cuda", int(index)


def require_device(kind: str) -> None:
    """RuntimeError unless this ONNX Runtime build runs on `kind` ("cpu" or "cuda")."""
    import onnxruntime as ort

    if kind == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError("device='cuda' needs onnxruntime-gpu (CUDAExecutionProvider is not available)")


def execution_providers(device: str, device_id: int = 0) -> list:
    """The `providers` argument of `onnxruntime.InferenceSession` for a device: the CPU provider,
    or the CUDA provider on GPU `device_id` (its `device_id` provider option), CPU as fallback."""
    if device not in PROVIDERS:
        raise ValueError(f"device must be one of {', '.join(PROVIDERS)}, got {device!r}")
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"device_id must be a non-negative integer, got {device_id!r}")
    if device == "cpu":
        if device_id != 0:
            raise ValueError(f"device_id {device_id} needs device='cuda' (the CPU has no device ids)")
        return list(PROVIDERS["cpu"])
    return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]


@dataclass(frozen=True)
class DecoderGraph:
    """The decoder step graph's inputs and outputs, as export/lowering.py writes them
    (`_decoder_step_inputs`, `_cached_self_attention`): the one description that
    `OnnxModel.decoder_step` and the service's DeviceDecoder bind by.

    inputs:  input_ids, position_ids (batch, new); self_mask (batch, total); encoder_mask
             (batch, source); past_<kv> (batch, H, past, D); cross_<kv> (batch, H, source, D)
    outputs: logits (batch, new, vocab) float32; present_<kv> (batch, H, total, D)
    where <kv> runs key_0, value_0, key_1, ... and total = past + new."""

    num_layers: int
    STEP_INPUTS = ("input_ids", "position_ids", "self_mask")  # (batch, new), (batch, new), (batch, total)
    ENCODER_MASK = "encoder_mask"
    LOGITS = "logits"

    @staticmethod
    def layer(kind: str, i: int) -> tuple[str, str]:
        """Layer i's (key, value) tensor names of a kind: "past", "present" or "cross"."""
        return f"{kind}_key_{i}", f"{kind}_value_{i}"

    @property
    def kv(self) -> list[str]:
        """key_0, value_0, key_1, ...: the order of `past`, `present` and `cross`."""
        return [f"{kind}_{i}" for i in range(self.num_layers) for kind in ("key", "value")]

    def _all(self, kind: str) -> list[str]:
        return [name for i in range(self.num_layers) for name in self.layer(kind, i)]

    @property
    def past(self) -> list[str]:
        return self._all("past")

    @property
    def present(self) -> list[str]:
        return self._all("present")

    @property
    def cross(self) -> list[str]:
        """Also the encoder graph's outputs of a summarizer (its cross-attention keys/values)."""
        return self._all("cross")

    @staticmethod
    def dimensions(batch: int, past: int, source: int) -> dict[str, int]:
        """Every symbolic dimension of one step of one new token per row, by its name in the graph
        (for ONNX Runtime's free-dimension overrides; vocab is fixed by the weights)."""
        return {"batch": batch, "new": 1, "past": past, "total": past + 1, "source": source}


# Key alignment: a sequence's decoder logits do not depend on what else is in its batch, nor on
# whether the service or `longdoc eval` decodes it (issue 40; tests/service/test_batch_invariance.py,
# `test_eval_decodes_as_the_service`), because every key axis a step reduces over has a
# length that is a multiple of KEY_ALIGNMENT (the cross state's; the past's, whose new key sits at its
# end) and each sequence's keys sit at the same places modulo KEY_ALIGNMENT whoever decodes it: its
# cross state from position 0, padded after (`aligned_key_length`); its past right-aligned against the
# new key, left-padded to a multiple of KEY_ALIGNMENT again after every step (`next_past_window`,
# `aligned_self_mask`; the service's fixed-shape steps keep position t at index t instead). ONNX
# Runtime's CPU kernels (MLAS) then add a key's terms in the same order whatever the axis length:
# Softmax sums in 16 lanes (AVX-512; 8 with AVX2), the one-row P.V product takes the keys in groups
# of 4 and Q.K^T works in column blocks of 16, so the masked padding adds exact zeros. Cropped to
# the longest sequence and left-padded to the longest row (or at exact lengths), a row's keys move
# between lanes and groups, and its logits in their last bits (a near-tied token can flip).
KEY_ALIGNMENT = 16


def aligned_key_length(n: int) -> int:
    """The length of a key axis that holds n positions: n rounded up to KEY_ALIGNMENT (at least
    KEY_ALIGNMENT, so the first step's empty past is KEY_ALIGNMENT masked positions)."""
    return max(1, -(-n // KEY_ALIGNMENT)) * KEY_ALIGNMENT


def next_past_window(P: int, longest: int) -> tuple[int, int, int]:
    """A step over a past of P positions writes a present of P + 1 (the new keys at P); the next
    step's past is its last `longest` positions (the longest row's tokens so far), left-padded to
    `aligned_key_length(longest)`: (start, stop, pad_before) along the present's position axis (its
    oldest position, padding for every row, dropped, or KEY_ALIGNMENT - 1 more added)."""
    n = aligned_key_length(longest)
    return P + 1 - min(n, P + 1), P + 1, max(0, n - P - 1)


def aligned_self_mask(P: int, lengths) -> np.ndarray:
    """(B, P + 1) int64 self mask of a step over a right-aligned past of P positions: row i attends
    to its last lengths[i] past positions and its new token (at P)."""
    mask = np.zeros((len(lengths), P + 1), np.int64)
    for i, n in enumerate(lengths):
        mask[i, P - n:] = 1
    return mask


@dataclass
class EncoderState:
    """What the decoder needs from one encoder pass (per batch row)."""

    cross: list[np.ndarray]  # per decoder layer: cross_key_l, cross_value_l, each (B, H, Se, D)
    encoder_mask: np.ndarray  # (B, Se) int64
    # the same arrays as OrtValues on the model's device, uploaded by the first decoder step and bound
    # by every later one (on a GPU the cross keys/values are most of a step's input: 268 MB per row of
    # BigBird-Pegasus-large at 4096 tokens, fp16)
    on_device: dict | None = field(default=None, repr=False, compare=False)

    def select(self, rows: np.ndarray) -> EncoderState:
        """The state for the given batch rows (beam search repeats rows)."""
        return EncoderState([c[rows] for c in self.cross], self.encoder_mask[rows])

    def aligned(self) -> EncoderState:
        """The state as a decoder step reads it (KEY_ALIGNMENT): each row's positions up to its last
        real token, zeros after, the source axis `aligned_key_length` of the longest (the
        encoder's output is padded to the block size instead)."""
        lengths = [int(np.flatnonzero(m)[-1]) + 1 if m.any() else 1 for m in self.encoder_mask]  # per row
        Se = aligned_key_length(max(lengths))
        mask = np.zeros((len(lengths), Se), np.int64)  # (B, Se)
        cross = [np.zeros(c.shape[:2] + (Se,) + c.shape[3:], c.dtype) for c in self.cross]  # (B, H, Se, D)
        for i, n in enumerate(lengths):
            mask[i, :n] = self.encoder_mask[i, :n]
            for a, c in zip(cross, self.cross):
                a[i, :, :n] = c[i, :, :n]
        return EncoderState(cross, mask)


class OnnxModel:
    def __init__(self, model_dir: str | Path, device: str = "cpu", threads: int | None = None,
                 layout_cache_size: int = 64, device_id: int = 0):
        """device: "cpu" or "cuda"; device_id: which GPU (CUDA provider option `device_id`)."""
        import onnxruntime as ort
        import tokenizers

        self.model_dir = Path(model_dir)
        self.manifest = Manifest.load(self.model_dir)
        self.manifest.check_files(self.model_dir)  # before any file is parsed
        tokenizer_path = self.manifest.path_of(self.model_dir, TOKENIZER_NAME)
        if not tokenizer_path.is_file():  # tokenizers' own error does not name the file
            raise FileNotFoundError(f"{tokenizer_path}: the model directory has no {TOKENIZER_NAME}")
        self.tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        providers = execution_providers(device, device_id)
        self.device, self.device_id = device, device_id
        require_device(device)
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = int(threads)
            options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # ONNX Runtime's memory pattern pre-plans one arena block for all intermediates of a
        # shape; with per-request lengths it raised the activation peak at 4096 tokens from
        # 0.29 to 0.66 GiB (BigBird-base, docs/export.md) and bought no speed
        options.enable_mem_pattern = False
        self.sessions = {}
        for name, filename in self.manifest.graphs.items():
            path = self.manifest.path_of(self.model_dir, filename)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: graph {name!r} named in the manifest is missing")
            self.sessions[name] = ort.InferenceSession(str(path), options, providers=providers)
            if device == "cuda" and "CUDAExecutionProvider" not in self.sessions[name].get_providers():
                # ONNX Runtime falls back to the CPU when the CUDA provider's libraries do not load
                # (it only logs): a "GPU" worker would serve at CPU speed without a word
                raise RuntimeError(f"graph {name!r}: the CUDA execution provider did not load (CUDA or cuDNN "
                                   f"libraries missing or not on the library path?); the session runs on "
                                   f"{self.sessions[name].get_providers()}")
        self.encoder_inputs = {i.name for i in self.sessions["encoder"].get_inputs()}
        self.sparse = LAYOUT_INPUTS[0] in self.encoder_inputs
        self.float_type = np.float16 if self.manifest.dtype == "fp16" else np.float32
        self.decoder_graph = DecoderGraph(self.manifest.decoder["num_layers"]) if self.manifest.decoder else None
        self._options, self._providers = options, providers
        self._layouts: OrderedDict[tuple[int, str], dict[str, np.ndarray]] = OrderedDict()
        self._layout_cache_size = layout_cache_size
        from longdoc.model.layout import AttentionSpec  # NumPy only

        # one spec per encoder layer (the manifest's `layer_attention`, else `attention` for all)
        self.layer_specs = ([AttentionSpec.from_dict(a) for a in self.manifest.layer_attention_specs()]
                            if self.sparse else None)
        _release_freed_heap()

    # --- lengths and layouts ---------------------------------------------------------
    def padded_length(self, seq_len: int) -> tuple[int, str]:
        """(padded length, "block_sparse" | "full") for a batch tensor of seq_len tokens."""
        m = self.manifest
        if not 1 <= seq_len <= m.max_length:
            raise ValueError(f"sequence length {seq_len} is outside [1, {m.max_length}]")
        padded = -(-seq_len // m.block_size) * m.block_size
        if not self.sparse or seq_len <= m.full_attention_max_length:
            return padded, "full"
        return padded, "block_sparse"

    def layout_inputs(self, padded_len: int, attention: str) -> dict[str, np.ndarray]:
        """The layout graph inputs for one padded length (built once, then cached)."""
        key = (padded_len, attention)
        feed = self._layouts.get(key)
        if feed is None:
            from longdoc.model.layout import build_layout

            m, nb = self.manifest, padded_len // self.manifest.block_size
            if attention == "full":
                feed = dense_layout_feed(m.num_layers, m.num_heads, nb)
            else:
                feed = layout_feed([build_layout(spec, nb, m.num_heads, layer)
                                    for layer, spec in enumerate(self.layer_specs)], nb,
                                   global_rows=LAYOUT_INPUTS[2] in self.encoder_inputs)
            if m.sparse_gather == "window":  # the graph reads each row's window from slices
                feed = without_window(feed, self.layer_specs[0].window_blocks)
            self._layouts[key] = feed
            if len(self._layouts) > self._layout_cache_size:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return feed

    def encoder_feed(self, input_ids, attention_mask, token_type_ids=None, global_attention_mask=None):
        """The encoder graph's inputs for a batch, as `run_encoder` feeds them: ids and masks
        padded to the block size, the layout tables of that length. Returns (feed, S), S the
        unpadded length. For callers that run the encoder session themselves (the service's
        I/O binding)."""
        input_ids = _as_2d_int64(input_ids, "input_ids")
        B, S = input_ids.shape
        attention_mask = np.ones_like(input_ids) if attention_mask is None else _as_2d_int64(attention_mask,
                                                                                              "attention_mask")
        if attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask has shape {attention_mask.shape}, input_ids {input_ids.shape}")
        padded, attention = self.padded_length(S)
        pad = padded - S
        if "token_type_ids" in self.encoder_inputs:
            if token_type_ids is None:
                token_type_ids = self._default_token_types(input_ids)
            token_type_ids = _as_2d_int64(token_type_ids, "token_type_ids")
            if token_type_ids.shape != (B, S):
                raise ValueError(f"token_type_ids has shape {token_type_ids.shape}, input_ids {input_ids.shape}")
        pad_id = self.manifest.special_tokens.get("pad") or 0
        feed = {"input_ids": np.pad(input_ids, ((0, 0), (0, pad)), constant_values=pad_id),
                "attention_mask": np.pad(attention_mask, ((0, 0), (0, pad)))}
        if "token_type_ids" in self.encoder_inputs:
            feed["token_type_ids"] = np.pad(token_type_ids, ((0, 0), (0, pad)))
        if "global_attention_mask" in self.encoder_inputs:
            if global_attention_mask is None:
                global_attention_mask = default_global_mask(self.manifest, input_ids)
            global_attention_mask = _as_2d_int64(global_attention_mask, "global_attention_mask")
            if global_attention_mask.shape != (B, S):
                raise ValueError(f"global_attention_mask has shape {global_attention_mask.shape}, "
                                 f"input_ids {input_ids.shape}")
            feed["global_attention_mask"] = np.pad(global_attention_mask, ((0, 0), (0, pad)))
        elif global_attention_mask is not None:
            raise ValueError(f"this {self.manifest.architecture} export takes no global_attention_mask")
        if self.sparse:  # a Longformer graph takes the window table only (its global tokens are per request)
            feed.update((k, v) for k, v in self.layout_inputs(padded, attention).items() if k in self.encoder_inputs)
        return feed, S

    def _default_token_types(self, input_ids: np.ndarray) -> np.ndarray:
        """transformers' defaults: zeros, except QA, where tokens after the first [SEP] are 1."""
        if self.manifest.task != "qa":
            return np.zeros_like(input_ids)
        sep = self.manifest.special_tokens.get("sep")
        q_len = np.argmax(input_ids == sep, axis=1)[:, None] + 1  # (B, 1)
        return (np.arange(input_ids.shape[1])[None] >= q_len).astype(np.int64)

    # --- encoder -----------------------------------------------------------------------
    def run_encoder(self, input_ids, attention_mask=None, token_type_ids=None,
                    global_attention_mask=None) -> dict[str, np.ndarray]:
        """(B, S) int64 inputs, S in [1, max_length] -> the task's outputs, padding stripped.
        global_attention_mask (Longformer exports only; 1 = global): default from the manifest's
        `global_tokens` (`default_global_mask`)."""
        feed, S = self.encoder_feed(input_ids, attention_mask, token_type_ids, global_attention_mask)
        session = self.sessions["encoder"]
        names = [n for n in self.manifest.outputs if n in {o.name for o in session.get_outputs()}]
        outs = session.run(names, feed)
        result = {}
        for name, value in zip(names, outs):
            result[name] = value[:, :S] if name in self.manifest.per_token_outputs else value
        return result

    # --- summarize -----------------------------------------------------------------------
    def encode_for_decoding(self, input_ids, attention_mask=None) -> EncoderState:
        feed, S = self.encoder_feed(input_ids, attention_mask)
        cross = self.sessions["encoder"].run(self.decoder_graph.cross, feed)
        return EncoderState(cross, feed["attention_mask"])

    def empty_past(self, batch: int, length: int = 0) -> list[np.ndarray]:
        """A past of `length` positions of zeros (to be masked), per layer key and value."""
        d = self.manifest.decoder
        shape = (batch, d["num_heads"], length, d["head_dim"])
        return [np.zeros(shape, self.float_type) for _ in range(2 * d["num_layers"])]

    def decoder_step(self, state: EncoderState, input_ids, position_ids, self_mask, past):
        """One step for T new tokens per row. past: [key_0, value_0, key_1, ...] (B, H, P, D);
        self_mask (B, P+T) 1 = attend. Returns (logits (B, T, V) fp32, present)."""
        import onnxruntime as ort

        g = self.decoder_graph
        if state.on_device is None:  # once per encoder state: the encoder outputs stay on the device
            state.on_device = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), self.device,
                                                                       self.device_id)
                               for name, value in zip(g.cross + [g.ENCODER_MASK], [*state.cross, state.encoder_mask])}
        binding = self.sessions["decoder"].io_binding()
        for name, value in state.on_device.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(g.STEP_INPUTS, (input_ids, position_ids, self_mask)):
            binding.bind_cpu_input(name, _as_2d_int64(value, name))
        for name, value in zip(g.past, past):  # the self-attention cache: a few MB, it follows beam reorders on the host
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in [g.LOGITS] + g.present:
            binding.bind_output(name, "cpu")
        self.sessions["decoder"].run_with_iobinding(binding)
        outs = binding.copy_outputs_to_cpu()
        return outs[0], outs[1:]

    def decoder_vocab_size(self) -> int:
        """The logits' last dimension (symbolic in the graph): one step of one token, on zeros."""
        d, g = self.manifest.decoder, self.decoder_graph
        kv = lambda n: np.zeros((1, d["num_heads"], n, d["head_dim"]), self.float_type)  # noqa: E731
        one = np.ones((1, 1), np.int64)
        feed = {"input_ids": one * 0, "position_ids": one * 0, "self_mask": one, g.ENCODER_MASK: one,
                **{name: kv(0) for name in g.past}, **{name: kv(1) for name in g.cross}}
        return int(self.sessions["decoder"].run([g.LOGITS], feed)[0].shape[-1])

    def fixed_decoder_session(self, dimensions: dict[str, int], cuda_graph: bool = False):
        """A new session of the decoder graph with every symbolic dimension fixed (ONNX Runtime's
        free-dimension overrides, `DecoderGraph.dimensions`): its shape arithmetic folds to
        constants at load, so every node runs on the model's device. With `cuda_graph` (CUDA only),
        ONNX Runtime captures the step as a CUDA graph on its first runs and replays it after (the
        CUDA provider's `enable_cuda_graph`; inputs and outputs must then stay bound at the same
        device addresses). One session per shape; each holds its own copy of the weights."""
        import onnxruntime as ort

        if cuda_graph and self.device != "cuda":
            raise ValueError(f"CUDA graphs need device='cuda', this model runs on {self.device!r}")
        options = ort.SessionOptions()
        for name in ("intra_op_num_threads", "inter_op_num_threads", "log_severity_level", "enable_mem_pattern"):
            setattr(options, name, getattr(self._options, name))
        for name, value in dimensions.items():
            options.add_free_dimension_override_by_name(name, int(value))
        providers = self._providers
        if cuda_graph:
            providers = [("CUDAExecutionProvider", {"device_id": self.device_id, "enable_cuda_graph": "1"})]
        path = self.manifest.path_of(self.model_dir, self.manifest.graphs["decoder"])
        return ort.InferenceSession(str(path), options, providers=providers)

    def generate(self, input_ids, attention_mask=None, max_new_tokens: int | None = 64, num_beams: int | None = None,
                 length_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
                 early_stopping: bool | str | None = None, min_length: int | None = None,
                 should_stop=None) -> list[list[int]]:
        """Unset (None) options are the model's generation defaults (manifest), else transformers'.
        should_stop: optional () -> bool, checked before each decoder step (thread-safe is the
        caller's business); true raises longdoc.export.generation.GenerationStopped."""
        from longdoc.export.generation import generate

        if self.manifest.task != "summarize":
            raise ValueError(f"generate needs a summarize model, this one is {self.manifest.task!r}")
        return generate(self, input_ids, attention_mask, max_new_tokens=max_new_tokens, num_beams=num_beams,
                        length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                        early_stopping=early_stopping, min_length=min_length, should_stop=should_stop)


def default_global_mask(manifest: Manifest, input_ids: np.ndarray) -> np.ndarray:
    """(B, S) int64, 1 = global, from the manifest's `global_tokens`: "question" = the tokens before
    the first separator (transformers' LongformerForQuestionAnswering: `<s> question </s></s> context
    </s>`, the separator itself local), "first" = the first token (its classification default),
    "none" = no token."""
    mask = np.zeros(input_ids.shape, np.int64)
    if manifest.global_tokens == "first":
        mask[:, 0] = 1
    elif manifest.global_tokens == "question":
        is_sep = input_ids == manifest.special_tokens.get("sep")
        missing = np.flatnonzero(~is_sep.any(axis=1))
        if len(missing):
            raise ValueError(f"QA input without a separator (id {manifest.special_tokens.get('sep')}) in row(s) "
                             f"{missing.tolist()}: pass global_attention_mask (the question's tokens) explicitly")
        mask[np.arange(input_ids.shape[1])[None, :] < np.argmax(is_sep, axis=1)[:, None]] = 1
    return mask


def _release_freed_heap() -> None:
    """Give the pages freed while the sessions were built back to the OS (glibc only).

    Building a session frees about as much as the weights (the parsed model file, the weights
    ONNX Runtime replaced by its prepacked copies), but glibc keeps freed heap pages resident and
    the run-time arena allocates large blocks elsewhere (mmap), so they would stay in the RSS for
    the process's life: 0.79 -> 0.55 GiB after loading BigBird-base fp32 (docs/export.md).
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        pass


def _as_2d_int64(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2:
        raise ValueError(f"{name} must be (batch, sequence), got shape {a.shape}")
    if a.dtype.kind not in "iub":
        raise ValueError(f"{name} must hold integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)
