"""Errors the worker's loaders raise, below every module that raises them."""


class ModelLoadError(Exception):
    """The model reference cannot be loaded; the message says why and what is supported."""


class ImageInputError(ValueError):
    """An image the worker cannot use as its request says (its processor makes another number
    of placeholders, its file does not open): that request fails, not the worker."""
