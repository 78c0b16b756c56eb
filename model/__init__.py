"""BigBird, BigBird-Pegasus, BERT2BERT, Longformer, LED, ModernBERT and BERT models in PyTorch (one
block-sparse attention, one decoder stack, one greedy / beam search; weight-compatible with the
public Hugging Face checkpoints) and training code.

`longdoc.model.layout`, `longdoc.model.lengths`, `longdoc.model.search` (greedy / beam search) and `longdoc.model.tokenization`
are pure NumPy / tokenizers and importable without torch (the service uses them). Everything
torch-backed is loaded lazily on first attribute access, so `import longdoc.model.layout` never imports
torch.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it (torch-backed; imported on first use)
_LAZY = {
    "load_pretrained": "longdoc.model.checkpoint",
    "save_pretrained": "longdoc.model.checkpoint",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
