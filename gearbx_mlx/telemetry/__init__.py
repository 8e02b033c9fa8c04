"""What a run leaves behind and how to read it.

:mod:`.trace` (the JSON Lines trace format, writer and reader),
:mod:`.analyze` (statistics of traces, side by side), :mod:`.plots` (their
figures, with the optional matplotlib), :mod:`.transport` (one HTTP
exchange bounded in time, bytes and events), :mod:`.openai_client` and
:mod:`.remote` (telemetry from OpenAI-compatible servers), :mod:`.bounds`
(entropy bounds from top-k log-probabilities).
"""

from .trace import TraceWriter, read_trace

__all__ = ["TraceWriter", "read_trace"]
