"""The exceptions mlxcel raises (all subclasses of MlxcelError)."""

from __future__ import annotations

from typing import Optional

__all__ = ["MlxcelError", "ModelLoadError", "InvalidParameter", "GenerationError", "TokenizerError"]


class MlxcelError(Exception):
    """Base class of every error mlxcel raises."""


class ModelLoadError(MlxcelError):
    """A model could not be loaded: a missing or bad directory, config,
    weights or tokenizer, or the default model could not be fetched."""


class InvalidParameter(MlxcelError, ValueError):
    """An argument is out of range (e.g. ``temperature=-1``), the prompt is
    empty or longer than the model's context, or the prompt plus
    ``max_tokens`` needs more KV cache than the model's whole KV pool
    (``name`` is then ``"max_tokens"``). ``name`` is the argument's name."""

    def __init__(self, message: str, name: Optional[str] = None) -> None:
        super().__init__(message)
        self.name = name


class GenerationError(MlxcelError):
    """Generation failed while running the model."""


class TokenizerError(MlxcelError):
    """Tokenizing, detokenizing or rendering the chat template failed."""


for _cls in (MlxcelError, ModelLoadError, InvalidParameter, GenerationError, TokenizerError):
    _cls.__module__ = "mlxcel"
del _cls
