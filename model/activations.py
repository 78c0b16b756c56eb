"""The one table of activation functions: every name a model config may give (`hidden_act`,
`activation_function`; transformers' ACT2FN spellings), with what the PyTorch models compute for it.
The ONNX export lowers the same names (`longdoc.export.graph.LOWERED_ACTIVATIONS`, a test holds the
two equal) and refuses a config naming any other one when it reads the config, before any weight."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016) as in Google's BERT/BigBird code ("gelu_new")."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def gelu_accurate(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_new": gelu_tanh,
    "gelu_fast": gelu_fast,
    "gelu_accurate": gelu_accurate,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_python_tanh": gelu_tanh,
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10.0, 10.0),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu6": F.relu6,
    "relu2": lambda x: torch.square(F.relu(x)),
    "leaky_relu": F.leaky_relu,  # negative slope 0.01
    "silu": F.silu,
    "swish": F.silu,
    "mish": F.mish,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "linear": lambda x: x,
}


def check_activation(name: str, key: str = "hidden_act") -> None:
    """Raise ValueError unless `name` is in the table (config classes call it on load)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{key} {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
