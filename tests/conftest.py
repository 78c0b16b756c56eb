"""Shared session fixtures: tiny exported model directories (see longdoc/testing/tiny_models.py).

Engineers' tests (export/, service/) use these; each is built once per test session."""

from __future__ import annotations

import pytest

from longdoc.testing.tiny_models import make_tiny_checkpoint, make_tiny_export


def _export(tmp_path_factory, task: str, dtype: str = "fp32"):
    root = tmp_path_factory.mktemp(f"tiny-{task}-{dtype}")
    checkpoint = make_tiny_checkpoint(root / "checkpoint", task)
    return make_tiny_export(root / "model", task, dtype=dtype, checkpoint_dir=checkpoint)


@pytest.fixture(scope="session")
def tiny_qa_dir(tmp_path_factory):
    """An exported tiny QA model directory (fp32)."""
    return _export(tmp_path_factory, "qa")


@pytest.fixture(scope="session")
def tiny_classify_dir(tmp_path_factory):
    """An exported tiny 3-label classifier (labels negative/neutral/positive), fp32."""
    return _export(tmp_path_factory, "classify")


@pytest.fixture(scope="session")
def tiny_summarize_dir(tmp_path_factory):
    """An exported tiny BigBird-Pegasus summarizer (encoder.onnx + decoder.onnx), fp32."""
    return _export(tmp_path_factory, "summarize")


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory):
    """factory(task) -> a tiny HF-format checkpoint directory (cached per task)."""
    cache = {}

    def make(task: str):
        if task not in cache:
            cache[task] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"ckpt-{task}"), task)
        return cache[task]

    return make
