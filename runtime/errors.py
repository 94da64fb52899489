"""Errors the runtime raises on bad input. Each message is one line meant for the user."""


class MtadEdgeError(Exception):
    """Base class: the CLI prints the message as a one-line error and exits non-zero."""


class ModelLoadError(MtadEdgeError):
    """A model file is missing, not a GGUF file, corrupt, or unsupported by the backend."""


class IncompatiblePairError(MtadEdgeError):
    """Target and auxiliary models do not share a vocabulary."""


class ContextOverflowError(MtadEdgeError):
    """The prompt does not fit in the context window."""
