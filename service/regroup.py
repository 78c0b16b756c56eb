"""Device-side regrouping of a decode batch: a tiny ONNX graph that ONNX Runtime runs on the
model's own device, so that a sequence's cross-attention keys/values and KV cache never go back
to the host when other sequences join or leave the batch (issue 24; vLLM keeps its KV blocks on
the device and moves only block tables for the same reason).

    take(m)       y_i = Pad(Slice(Gather(x_i, rows, axis=0), starts, ends, axes), pads), i < m
                  (Slice and Pad only where the call crops or pads):
                  the rows of one source (the running batch, or a group of sequences just encoded),
                  cropped or zero-padded along one axis (cross: right-padded to the batch's longest
                  encoder length; past: cropped on the left to its longest decoder length); into
                  new tensors, or in place into rows of buffers the caller holds (the batch's
                  slots: a newcomer is written into its row and the other rows stay where they are)

    fill          y_i = Expand(zero, shape): zeros written in place into buffers the caller holds
                  (a fixed-shape decoder's cache, whose masked positions must hold finite values)
    step tail     after a fixed-shape decoder step (service/workers.py DeviceDecoder): each
                  present's new column written into its cache at the row's position, in place
                  (ScatterND), and the greedy choice, ArgMax of the logits with each row's
                  banned tokens at -inf (`step_tail_graph`)

The graphs are written here as ONNX protobuf bytes (the serving install has no `onnx` package;
tests/service/test_device_decoder.py checks these bytes with `onnx.checker` and the results against
NumPy). Serving never branches on the architecture: a graph is built per element type and count.
"""

from __future__ import annotations

import numpy as np

# ONNX TensorProto.DataType
ELEM_TYPES = {np.dtype(np.float32): 1, np.dtype(np.int64): 7, np.dtype(np.float16): 10}
OPSET = 17
IR_VERSION = 8


# --- a minimal protobuf writer: just the ONNX messages these graphs use ------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # int64 fields: two's complement, as protobuf encodes negatives
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes(field: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _value_info(name: str, elem_type: int, rank: int) -> bytes:
    """ValueInfoProto: a tensor of `elem_type` and `rank` with named (free) dimensions."""
    dims = b"".join(_bytes(1, _bytes(2, f"{name}_d{i}")) for i in range(rank))  # Dimension.dim_param
    tensor = _int(1, elem_type) + _bytes(2, dims)  # TypeProto.Tensor: elem_type, shape
    return _bytes(1, name) + _bytes(2, _bytes(1, tensor))  # name, type (TypeProto.tensor_type)


def _value_info_shape(name: str, elem_type: int, shape: list[int]) -> bytes:
    """ValueInfoProto: a tensor of `elem_type` and fixed `shape`."""
    dims = b"".join(_bytes(1, _int(1, d)) for d in shape)  # Dimension.dim_value
    return _bytes(1, name) + _bytes(2, _bytes(1, _int(1, elem_type) + _bytes(2, dims)))


def _initializer(name: str, array: np.ndarray) -> bytes:
    """TensorProto: dims, data_type, name, raw_data (little-endian)."""
    array = np.ascontiguousarray(array)
    return (b"".join(_int(1, d) for d in array.shape) + _int(2, ELEM_TYPES[array.dtype]) + _bytes(8, name)
            + _bytes(9, array.astype(array.dtype.newbyteorder("<")).tobytes()))


def _node(op: str, inputs: list[str], outputs: list[str], **attrs: int | list[int]) -> bytes:
    def attribute(k, v):  # AttributeProto: name, i (type INT = 2) or ints (type INTS = 7)
        if isinstance(v, list):
            return _bytes(1, k) + b"".join(_int(8, x) for x in v) + _int(20, 7)
        return _bytes(1, k) + _int(3, v) + _int(20, 2)

    return (b"".join(_bytes(1, i) for i in inputs) + b"".join(_bytes(2, o) for o in outputs)
            + _bytes(3, f"{op}_{outputs[0]}") + _bytes(4, op)
            + b"".join(_bytes(5, attribute(k, v)) for k, v in attrs.items()))


def _model(name: str, nodes: list[bytes], inputs: list[bytes], outputs: list[bytes],
           initializers: list[bytes] = ()) -> bytes:
    graph = (b"".join(_bytes(1, n) for n in nodes) + _bytes(2, name)
             + b"".join(_bytes(5, t) for t in initializers)
             + b"".join(_bytes(11, i) for i in inputs) + b"".join(_bytes(12, o) for o in outputs))
    opset = _bytes(1, "") + _int(2, OPSET)  # OperatorSetIdProto: default domain
    return _int(1, IR_VERSION) + _bytes(2, "longdoc") + _bytes(7, graph) + _bytes(8, opset)


def take_graph(dtype, rank: int, m: int, crop: bool = True, pad: bool = True) -> bytes:
    """Gather, then Slice if `crop`, then Pad if `pad`: each op writes its whole output, so the
    variants without them copy the tensors once instead of three times."""
    t, i64 = ELEM_TYPES[np.dtype(dtype)], ELEM_TYPES[np.dtype(np.int64)]
    nodes = []
    for i in range(m):
        steps = [("Gather", ["rows"], {"axis": 0})] + [("Slice", ["starts", "ends", "axes"], {})] * crop \
            + [("Pad", ["pads"], {})] * pad
        x = f"x{i}"
        for j, (op, extra, attrs) in enumerate(steps):
            y = f"y{i}" if j == len(steps) - 1 else f"{op.lower()}{i}"
            nodes.append(_node(op, [x, *extra], [y], **attrs))
            x = y
    names = ["rows"] + ["starts", "ends", "axes"] * crop + ["pads"] * pad
    inputs = [_value_info(f"x{i}", t, rank) for i in range(m)] + [_value_info(n, i64, 1) for n in names]
    return _model(f"take{m}", nodes, inputs, [_value_info(f"y{i}", t, rank) for i in range(m)])


def fill_graph(dtype, rank: int, m: int) -> bytes:
    """y_i = Expand(zero, shape), i < m: zero a scalar of `dtype`, shape (rank,) int64."""
    t, i64 = ELEM_TYPES[np.dtype(dtype)], ELEM_TYPES[np.dtype(np.int64)]
    nodes = [_node("Expand", ["zero", "shape"], [f"y{i}"]) for i in range(m)]
    inputs = [_value_info("zero", t, 0), _value_info("shape", i64, 1)]
    return _model(f"fill{m}", nodes, inputs, [_value_info(f"y{i}", t, rank) for i in range(m)])


def step_tail_graph(dtype, m: int, batch: int, heads: int, cache: int, head_dim: int, vocab: int,
                    banned: int) -> bytes:
    """The tail of one fixed-shape decoder step, every shape fixed:

    inputs:  position_ids (batch, 1) int64; logits (batch, 1, vocab) float32; banned (batch, banned)
             int64, a row's banned tokens, `vocab` for an unused entry; present_i (batch, heads,
             cache + 1, head_dim), cache_i (batch, heads, cache, head_dim), i < m
    outputs: cache_out_i = cache_i with present_i[:, :, cache] written at each row's position
             (ScatterND; bound to cache_i's own buffer, written in place);
             tokens (batch,) int64, the first maximum of the logits without the banned tokens:
             at most `banned` are banned, so it is among the TopK(banned + 1) candidates; those
             banned go to -inf, and of the best the lowest token id wins (np.argmax's rule; TopK
             keeps the lower ids among equal values, as the ONNX spec says). A scatter of -inf
             into the logits, the obvious way, copies all of them: 15x slower on the CPU
    """
    t, i64, f32 = (ELEM_TYPES[np.dtype(x)] for x in (dtype, np.int64, np.float32))
    k = banned + 1
    grid = np.indices((batch, heads, 1)).transpose(1, 2, 3, 0)[:, :, 0, :2]  # (batch, heads, 2): b, h
    consts = {"rows_heads": np.ascontiguousarray(grid, dtype=np.int64),
              "position_shape": np.array([batch, 1, 1], np.int64), "index_shape": np.array([batch, heads, 1], np.int64),
              "starts": np.array([cache], np.int64), "ends": np.array([cache + 1], np.int64),
              "axes": np.array([2], np.int64), "update_shape": np.array([batch, heads, head_dim], np.int64),
              "k": np.array([k], np.int64), "candidates_shape": np.array([batch, k, 1], np.int64),
              "banned_shape": np.array([batch, 1, banned], np.int64), "ones": np.ones((banned, 1), np.float32),
              "hits_shape": np.array([batch, 1, k], np.int64), "zero": np.array(0, np.float32),
              "neg_inf": np.array(-np.inf, np.float32), "no_token": np.array(vocab, np.float32)}
    nodes = [_node("Reshape", ["position_ids", "position_shape"], ["row_positions"]),
             _node("Expand", ["row_positions", "index_shape"], ["head_positions"]),
             _node("Concat", ["rows_heads", "head_positions"], ["index"], axis=2)]  # (batch, heads, 3): b, h, t
    for i in range(m):  # ScatterND copies a slice at a time (ScatterElements, an element: 10x slower on the CPU)
        nodes += [_node("Slice", [f"present{i}", "starts", "ends", "axes"], [f"new{i}"]),
                  _node("Reshape", [f"new{i}", "update_shape"], [f"update{i}"]),  # (batch, heads, head_dim)
                  _node("ScatterND", [f"cache{i}", "index", f"update{i}"], [f"cache_out{i}"])]
    nodes += [_node("TopK", ["logits", "k"], ["top_values", "top_tokens"], axis=2),  # (batch, 1, k)
              _node("Reshape", ["top_tokens", "candidates_shape"], ["candidates"]),
              _node("Reshape", ["banned", "banned_shape"], ["banned_row"]),
              _node("Equal", ["candidates", "banned_row"], ["is_banned"]),  # (batch, k, banned)
              _node("Cast", ["is_banned"], ["is_banned_f"], to=1),
              _node("MatMul", ["is_banned_f", "ones"], ["hits3"]),  # (batch, k, 1): how often banned
              _node("Reshape", ["hits3", "hits_shape"], ["hits"]),
              _node("Greater", ["hits", "zero"], ["drop"]),
              _node("Where", ["drop", "neg_inf", "top_values"], ["allowed"]),
              _node("ReduceMax", ["allowed"], ["best"], axes=[2], keepdims=1),  # (batch, 1, 1)
              _node("Equal", ["allowed", "best"], ["is_best"]),
              _node("Cast", ["top_tokens"], ["top_tokens_f"], to=1),  # exact: token ids < 2^24
              _node("Where", ["is_best", "top_tokens_f", "no_token"], ["best_tokens"]),
              _node("ReduceMin", ["best_tokens"], ["lowest"], axes=[1, 2], keepdims=0),
              _node("Cast", ["lowest"], ["tokens"], to=7)]
    inputs = [_value_info_shape("position_ids", i64, [batch, 1]), _value_info_shape("logits", f32, [batch, 1, vocab]),
              _value_info_shape("banned", i64, [batch, banned])]
    inputs += [_value_info_shape(f"present{i}", t, [batch, heads, cache + 1, head_dim]) for i in range(m)]
    inputs += [_value_info_shape(f"cache{i}", t, [batch, heads, cache, head_dim]) for i in range(m)]
    outputs = [_value_info_shape(f"cache_out{i}", t, [batch, heads, cache, head_dim]) for i in range(m)]
    outputs.append(_value_info_shape("tokens", i64, [batch]))
    return _model("step_tail", nodes, inputs, outputs, [_initializer(k, v) for k, v in consts.items()])


# --- the kernels on a device -------------------------------------------------------------------

def small_graph_options():
    """Session options of the worker's small graphs (these kernels, the decoder step's tail): they run
    on the calling thread. ONNX Runtime's default is a pool of a thread per core that spins after each
    run, taking the cores from the decoder step that runs next: with a tail after every fixed-shape
    step, a batch of 8 stepped 1.37x slower on a 2-core CPU (bench/decode_steps.py)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class Regroup:
    """`take` on OrtValues that live on one device (any execution provider: the CPU
    provider runs the same code in tests). Sessions are built lazily per graph shape and kept.
    `moved` counts the bytes these kernels write on the device (device-to-device, never the host)."""

    def __init__(self, dtype, rank: int, providers: list, device_type: str, device_id: int = 0):
        import onnxruntime as ort

        self.ort = ort
        self.dtype, self.rank = np.dtype(dtype), rank
        self.providers = providers
        self.device_type, self.device_id = device_type, device_id
        self._sessions: dict[tuple, object] = {}
        self.moved = 0

    def _session(self, key: tuple, build):
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = self.ort.InferenceSession(build(), small_graph_options(), providers=self.providers)
        return s

    def _run(self, session, inputs: dict, cpu_inputs: dict, n_out: int, into: tuple | None = None) -> list:
        binding = session.io_binding()
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in cpu_inputs.items():
            binding.bind_cpu_input(name, value)
        for i in range(n_out):
            if into is None:
                binding.bind_output(f"y{i}", self.device_type, self.device_id)
            else:  # written in place: (pointers, shape) into buffers the caller holds
                binding.bind_output(f"y{i}", self.device_type, self.device_id, self.dtype.type, into[1], into[0][i])
        session.run_with_iobinding(binding)
        out = binding.get_outputs()
        self.moved += sum(int(np.prod(v.shape())) * self.dtype.itemsize for v in out)
        return out

    def allocate(self, shape: list[int], n: int) -> list:
        """n uninitialised tensors of `shape` on the device (slot buffers; see `take`'s `into`)."""
        return [self.ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype.type, self.device_type,
                                                               self.device_id) for _ in range(n)]

    def fill(self, buffers: list) -> None:
        """Zeros written in place into every tensor of `buffers` (all of one shape)."""
        shape = buffers[0].shape()
        session = self._session(("fill", len(buffers)), lambda: fill_graph(self.dtype, self.rank, len(buffers)))
        cpu = {"zero": np.zeros((), self.dtype), "shape": np.asarray(shape, np.int64)}
        self._run(session, {}, cpu, len(buffers), ([b.data_ptr() for b in buffers], list(shape)))

    def take(self, xs: list, rows: list[int], axis: int, start: int, stop: int, pad_before: int = 0,
             pad_after: int = 0, into: tuple[list[int], int] | None = None) -> list:
        """For each x (rank `rank`): x[rows][..., start:stop (on `axis`), ...] zero-padded on `axis`.
        Every row in order, uncropped and unpadded, is the input itself: nothing is copied.

        `into` = (buffers, row): written in place into rows row .. row + len(rows) of
        `buffers` (one per x, allocated by `allocate`, whose other rows are left as they are)."""
        shape = xs[0].shape()
        crop, pad = (start, stop) != (0, shape[axis]), bool(pad_before or pad_after)
        if into is None and not crop and not pad and list(rows) == list(range(shape[0])):
            return list(xs)
        if into is not None:
            buffers, row = into
            out_shape = [len(rows)] + list(buffers[0].shape()[1:])
            row_bytes = int(np.prod(out_shape[1:])) * self.dtype.itemsize
            into = ([b.data_ptr() + row * row_bytes for b in buffers], out_shape)
        session = self._session(("take", len(xs), crop, pad),
                                lambda: take_graph(self.dtype, self.rank, len(xs), crop, pad))
        cpu = {"rows": np.asarray(rows, np.int64)}
        if crop:
            cpu.update(starts=np.array([start], np.int64), ends=np.array([stop], np.int64),
                       axes=np.array([axis], np.int64))
        if pad:
            cpu["pads"] = np.zeros(2 * self.rank, np.int64)
            cpu["pads"][axis], cpu["pads"][self.rank + axis] = pad_before, pad_after
        return self._run(session, {f"x{i}": x for i, x in enumerate(xs)}, cpu, len(xs), into)
