"""longdoc: serve long-document BigBird models. The CLI lives in :mod:`longdoc.cli`."""
