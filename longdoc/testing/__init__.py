"""Test doubles and tiny models, for the tests, the benchmarks and the docs' examples (installed
with the package, so that none of them imports from `tests/`).

- `longdoc.testing.tiny_models`: tiny random BigBird, BigBird-Pegasus, BERT2BERT, Longformer, LED
  and ModernBERT checkpoints and exported model directories (seconds to build; the builders import torch
  and transformers when called, not on import).
- `longdoc.testing.fake_worker`: `FakeWorker`, a deterministic worker with no model behind it
  (NumPy and tokenizers only), for the API, the batcher and the host pool.

Layering: this package may import longdoc.model, longdoc.export and longdoc.service; none of those
imports it. Importing either module imports no torch (tests/service/test_no_torch.py).
"""
