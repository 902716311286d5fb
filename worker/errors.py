"""Errors the worker's loaders raise, below every module that raises them."""


class ModelLoadError(Exception):
    """The model reference cannot be loaded; the message says why and what is supported."""
