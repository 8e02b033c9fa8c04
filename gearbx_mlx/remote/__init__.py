"""Entropy telemetry and routing over OpenAI-compatible servers (mlx-lm, Ollama, llama.cpp).

:mod:`.transport` (one HTTP exchange bounded in time, bytes and events),
:mod:`.openai_client` (the servers' answers, read and checked),
:mod:`.bounds` (entropy bounds from top-k log-probabilities),
:mod:`.session` (per-prompt routing among server variants, per-token
telemetry) and :mod:`.cli` (``python -m gearbx_mlx.remote``, ``gearbx-remote``).
The traces it writes are :mod:`gearbx_mlx.telemetry`'s.
"""

from .session import RemoteSession, SessionOptions, Variant, parse_variants

__all__ = ["RemoteSession", "SessionOptions", "Variant", "parse_variants"]
