"""Model integrity and confinement: file checksums recorded at export and checked at load,
manifest paths confined to the model directory, a missing tokenizer named."""

import asyncio
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from longdoc.export.manifest import TOKENIZER_NAME, Manifest, ManifestError, sha256_of
from longdoc.export.runtime import OnnxModel

SHIPPED = Path(__file__).resolve().parents[2] / "models"


def copy_model(src, tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def edit_manifest(directory, **changes):
    path = Path(directory) / "manifest.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("task", ["qa", "summarize", "classify"])
def test_shipped_models_carry_checksums_and_load(task):
    m = Manifest.load(SHIPPED / task)
    assert set(m.files) == {*m.graphs.values(), TOKENIZER_NAME}
    for name, digest in m.files.items():
        assert sha256_of(SHIPPED / task / name) == digest
    model = OnnxModel(SHIPPED / task)
    assert model.manifest == m


def test_export_records_the_checksum_of_every_file(tiny_summarize_dir):
    m = Manifest.load(tiny_summarize_dir)
    assert set(m.files) == {"encoder.onnx", "decoder.onnx", TOKENIZER_NAME}
    assert m.files["decoder.onnx"] == sha256_of(tiny_summarize_dir / "decoder.onnx")


def test_a_corrupted_graph_fails_at_load_naming_the_file(tmp_path):
    d = copy_model(SHIPPED / "qa", tmp_path)
    with open(d / "encoder.onnx", "r+b") as f:  # 1 MB of random bytes into the weights
        f.seek(8 << 20)
        f.write(os.urandom(1 << 20))
    with pytest.raises(ManifestError, match=r"encoder\.onnx: sha256 \w+ does not match the manifest's"):
        OnnxModel(d)


def test_a_corrupted_model_stops_service_start_up(tmp_path, tiny_classify_dir):
    from longdoc.service.app import create_app
    from longdoc.service.settings import Settings

    d = copy_model(tiny_classify_dir, tmp_path)
    (d / TOKENIZER_NAME).write_text((d / TOKENIZER_NAME).read_text().replace('"[UNK]"', '"[UNQ]"', 1))
    app = create_app(Settings(models={"cls": d}, warmup=False))

    async def start():
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(ManifestError, match=r"tokenizer\.json: sha256 .* corrupted or was replaced"):
        asyncio.run(start())


@pytest.mark.parametrize("graphs", [{"encoder": "../encoder.onnx"}, {"encoder": "/etc/passwd"},
                                    {"encoder": "sub/../../x.onnx"}])
def test_graph_paths_must_stay_inside_the_model_directory(tmp_path, tiny_qa_dir, graphs):
    d = copy_model(tiny_qa_dir, tmp_path)
    edit_manifest(d, graphs=graphs, files={})
    with pytest.raises(ManifestError, match="must be a relative path inside the model directory"):
        Manifest.load(d)


def test_a_symlink_out_of_the_model_directory_is_refused(tmp_path, tiny_qa_dir):
    d = copy_model(tiny_qa_dir, tmp_path)
    outside = tmp_path / "outside.onnx"
    (d / "encoder.onnx").rename(outside)
    (d / "encoder.onnx").symlink_to(outside)
    with pytest.raises(ManifestError, match="resolves outside the model directory"):
        OnnxModel(d)


def test_a_missing_tokenizer_is_named(tmp_path, tiny_qa_dir):
    d = copy_model(tiny_qa_dir, tmp_path)
    (d / TOKENIZER_NAME).unlink()
    with pytest.raises(ManifestError, match=r"tokenizer\.json: missing"):
        OnnxModel(d)
    edit_manifest(d, files={})  # an old manifest: no checksums to name it
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        OnnxModel(d)


def test_manifest_without_checksums_loads_with_a_warning(tmp_path, tiny_qa_dir, caplog):
    d = copy_model(tiny_qa_dir, tmp_path)
    edit_manifest(d, files={})
    with caplog.at_level(logging.WARNING, logger="longdoc.export"):
        OnnxModel(d)
    assert "records no file checksums" in caplog.text


def test_every_graph_needs_a_checksum(tmp_path, tiny_qa_dir):
    d = copy_model(tiny_qa_dir, tmp_path)
    edit_manifest(d, files={TOKENIZER_NAME: sha256_of(d / TOKENIZER_NAME)})
    with pytest.raises(ManifestError, match="no checksum for 'encoder.onnx'"):
        OnnxModel(d)


def test_external_weights_are_checksummed_too(tmp_path, tiny_checkpoint_dir, monkeypatch):
    """A graph over 2 GiB keeps its weights in NAME.onnx.data: that file is recorded and checked."""
    import onnx

    from longdoc.export import exporter
    from longdoc.testing.tiny_models import make_tiny_export

    def save_external(model, path):  # what longdoc.export.graph.save_model does over 1.8 GB, at any size
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=Path(path).name + ".data", size_threshold=1024)

    monkeypatch.setattr(exporter, "save_model", save_external)
    d = make_tiny_export(tmp_path / "model", "classify", checkpoint_dir=tiny_checkpoint_dir("classify"))
    m = Manifest.load(d)
    assert set(m.files) == {"encoder.onnx", "encoder.onnx.data", TOKENIZER_NAME}
    OnnxModel(d)
    with open(d / "encoder.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(os.urandom(64))
    with pytest.raises(ManifestError, match=r"encoder\.onnx\.data: sha256"):
        OnnxModel(d)
