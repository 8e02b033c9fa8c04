"""Where models and texts come from: PyPI wheels, GGUF files, local folders.

:mod:`.registry` (the models and texts on PyPI, with their hashes),
:mod:`.cache` (pinned downloads and conversions in the user's cache),
:mod:`.entries` (cache entries: integrity records, repair, stale temporaries),
:mod:`.gguf` (GGUF reading and conversion to mlx-lm folders),
:mod:`.prequant` (a GGUF kept as MLX quantized layers), :mod:`.models`
(``resolve_model``: what ``--model`` names).
"""

from .models import corpus_path, resolve_model

__all__ = ["corpus_path", "resolve_model"]
