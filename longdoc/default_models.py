"""Where `longdoc serve` with no --model finds its models: the same two places, in this order,
from a clone, an installed wheel and the container image.

1. ./models under the working directory: a clone run from its root, the image (working
   directory /, models mounted or baked in at /models), a directory of your own exports.
2. The installed longdoc-models distribution (import name longdoc_models, built from the
   repository's models/): `pip install ./models` beside the longdoc wheel, `pip install -e ./models`
   in a clone.

A model is a directory holding a manifest.json, named by its directory. Imports neither torch
nor onnx: `longdoc serve` runs this."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "longdoc_models"


def model_dirs(root: Path) -> dict[str, Path]:
    """Every exported model directly under `root`, by directory name."""
    return {d.name: d for d in sorted(root.glob("*")) if (d / "manifest.json").is_file()}


def installed_models_root() -> Path | None:
    """The longdoc_models package's directory, or None when longdoc-models is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def default_model_dirs() -> dict[str, Path]:
    """The models of the first place that holds any (see the module docstring)."""
    local = Path.cwd() / "models"
    for root in (local, installed_models_root()):
        if root is not None and (found := model_dirs(root)):
            return found
    raise ValueError(
        "no models. Pass --model NAME=DIR with a directory written by `longdoc export` "
        "(e.g. `longdoc export CHECKPOINT_DIR models/qa --task qa`), put exported model directories "
        f"under {local}/, or install the default models, the longdoc-models distribution built from the "
        "repository's models/ (`pip install ./models`; see docs/models.md)."
    )


def served_from(models: dict[str, Path]) -> str:
    """The start-up log's account of what is served: each folder (absolute) and the models in it,
    e.g. "/srv/models: classify, myqa, qa, summarize" (a model named otherwise than its directory
    as NAME=DIR)."""
    folders: dict[Path, list[str]] = {}
    for name, directory in models.items():
        directory = Path(directory).resolve()
        folders.setdefault(directory.parent, []).append(name if directory.name == name else f"{name}={directory.name}")
    return "; ".join(f"{folder}: {', '.join(names)}" for folder, names in folders.items())
