"""The default models of `longdoc serve`, installed as the longdoc-models distribution (see
pyproject.toml here): one directory per model as `longdoc export` writes it, with its LICENSE and
TRAINING-DATA-COPYRIGHT. Found by longdoc/default_models.py; nothing to import here."""
