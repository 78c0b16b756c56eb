"""longdoc: serve long-document transformer models (BigBird, BigBird-Pegasus, BERT2BERT, Longformer,
LED, ModernBERT). The CLI lives in :mod:`longdoc.cli`."""

from importlib.metadata import PackageNotFoundError, version

try:  # pyproject.toml's version, the one place it is written
    __version__ = version("longdoc")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
