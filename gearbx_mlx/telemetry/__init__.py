"""What a run leaves behind and how to read it.

:mod:`.trace` (the JSON Lines trace format, writer and reader),
:mod:`.analyze` (statistics of traces, side by side), :mod:`.plots` (their
figures, with the optional matplotlib). Telemetry from OpenAI-compatible
servers is :mod:`gearbx_mlx.remote`'s.
"""

from .trace import TraceWriter, read_trace

__all__ = ["TraceWriter", "read_trace"]
