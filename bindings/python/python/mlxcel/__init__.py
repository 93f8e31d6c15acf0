"""mlxcel: in-process LLM inference over MLX.

>>> import mlxcel
>>> model = mlxcel.load()          # the default model, SmolLM2-135M-Instruct
>>> model.generate("Hello", max_tokens=8)
>>> for chunk in model.chat_stream([{"role": "user", "content": "Hi!"}]):
...     print(chunk.text, end="", flush=True)
>>> embedder = mlxcel.load_embedder()   # all-MiniLM-L6-v2
>>> embedder.embed(["A cat.", "A kitten."]).shape   # NumPy when installed
(2, 384)
>>> mlxcel.load_transcriber().transcribe("speech.flac")["text"]   # whisper-tiny.en
' The quick brown fox ...'

BLAS: on Linux the extension links no BLAS of its own beyond the reference
BLAS bundled in the ``mlx-cpu`` wheel. At import, ``libopenblas.so.0``
(Debian/Ubuntu: ``apt install libopenblas0``) is loaded first with
``RTLD_GLOBAL`` when the system has it, so MLX's cblas calls resolve to
OpenBLAS (several times faster prompt processing). ``MLXCEL_OPENBLAS=/path/to/
libopenblas.so`` names another library; ``MLXCEL_BLAS=bundled`` skips the
preload. ``mlxcel.BLAS`` tells which one is in use.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
from typing import Optional

from ._errors import GenerationError, InvalidParameter, MlxcelError, ModelLoadError, TokenizerError


def _preload_openblas() -> Optional[str]:
    """Loads OpenBLAS into the global symbol scope before libmlx is loaded.

    libmlx leaves ``cblas_sgemm`` and friends undefined, to be found in its
    bundled reference BLAS; a library already loaded with RTLD_GLOBAL comes
    first in symbol lookup, so OpenBLAS's definitions win.
    """
    if sys.platform != "linux" or os.environ.get("MLXCEL_BLAS", "").lower() == "bundled":
        return None
    explicit = os.environ.get("MLXCEL_OPENBLAS")
    candidates = [explicit] if explicit else ["libopenblas.so.0", "libopenblas.so"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "cblas_sgemm"):
            return name
    return None


_openblas = _preload_openblas()

from . import _mlxcel  # noqa: E402  (after the OpenBLAS preload on purpose)
from ._mlxcel import (  # noqa: E402
    MLX_VERSION,
    Chunk,
    Embedder,
    Model,
    ModelInfo,
    Reranker,
    Stream,
    TokenLogprob,
    Transcriber,
    __version__,
    default_model_path,
    generation_defaults,
)

#: Loads a model: ``mlxcel.load(path, **options)`` is ``Model(path, **options)``
#: (see ``Model`` for the options).
load = Model

#: Loads a sentence-embedding model: ``mlxcel.load_embedder(path)`` is
#: ``Embedder(path)``; without a path, all-MiniLM-L6-v2 (fetched on first use).
load_embedder = Embedder

#: Loads a cross-encoder: ``mlxcel.load_reranker(path)`` is ``Reranker(path)``.
load_reranker = Reranker

#: Loads a Whisper model: ``mlxcel.load_transcriber(path)`` is
#: ``Transcriber(path)``; without a path, whisper-tiny.en (fetched on first use).
load_transcriber = Transcriber

# Ends every generation (one cancelled by Ctrl-C or close() may still be in
# its current step) and stops the engines' scheduler threads before MLX is
# torn down.
atexit.register(_mlxcel._stop_engines)

#: "openblas" when OpenBLAS was preloaded (see the module docstring), else
#: "bundled" (the mlx-cpu wheel's reference BLAS) on Linux, "platform" elsewhere.
BLAS: str = "openblas" if _openblas else ("bundled" if sys.platform == "linux" else "platform")

__all__ = [
    "load",
    "load_embedder",
    "load_reranker",
    "load_transcriber",
    "default_model_path",
    "generation_defaults",
    "Model",
    "Embedder",
    "Reranker",
    "Transcriber",
    "ModelInfo",
    "Stream",
    "Chunk",
    "TokenLogprob",
    "MlxcelError",
    "ModelLoadError",
    "InvalidParameter",
    "GenerationError",
    "TokenizerError",
    "BLAS",
    "MLX_VERSION",
    "__version__",
]
