"""Errors the runtime raises on bad input. Each message is one line meant for the user."""

from __future__ import annotations

from typing import Optional


class MtadEdgeError(Exception):
    """Base class: the CLI prints the message as a one-line error and exits non-zero; the server
    answers 400 (or the status its subclass names)."""


class OptionError(MtadEdgeError, ValueError):
    """A request option has a bad value; ``param`` names it (a ValueError too, for API users)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(MtadEdgeError):
    """A model file is missing, not a GGUF file, corrupt, or unsupported by the backend."""


class IncompatiblePairError(MtadEdgeError):
    """Target and auxiliary models do not share a vocabulary."""


class ContextOverflowError(MtadEdgeError):
    """The prompt does not fit in the context window."""
