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


def _node(op: str, inputs: list[str], outputs: list[str], **ints: int) -> bytes:
    attrs = b"".join(_bytes(5, _bytes(1, k) + _int(3, v) + _int(20, 2)) for k, v in ints.items())  # INT
    return (b"".join(_bytes(1, i) for i in inputs) + b"".join(_bytes(2, o) for o in outputs)
            + _bytes(3, f"{op}_{outputs[0]}") + _bytes(4, op) + attrs)


def _model(name: str, nodes: list[bytes], inputs: list[bytes], outputs: list[bytes]) -> bytes:
    graph = (b"".join(_bytes(1, n) for n in nodes) + _bytes(2, name)
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


# --- the kernels on a device -------------------------------------------------------------------

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
            options = self.ort.SessionOptions()
            options.log_severity_level = 3
            s = self._sessions[key] = self.ort.InferenceSession(build(), options, providers=self.providers)
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
