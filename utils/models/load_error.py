"""The loader's one error type, in a module of its own so that the modules the loader is split into can raise it
without importing the loader."""


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one line meant for the user."""
