"""Self-speculative decoding: a lower gear drafts, the high gear verifies.

:mod:`.draft` (the drafter: the model tree with its managed layers in a lower
gear), :mod:`.host` (the drafter's decode step in numpy around the C kernels),
:mod:`.acceptance` (greedy and rejection-sampling acceptance), :mod:`.decode`
(the block loop and the streaming API), :mod:`.calibration` (measured step
costs, acceptance, the entropy stop), :mod:`.cli` (``--speculative``).
"""

from .decode import (
    SpeculativeConfig,
    SpeculativeResponse,
    speculative_generate,
    stream_speculative_generate,
)
from .draft import DraftModel, build_draft

__all__ = [
    "DraftModel", "SpeculativeConfig", "SpeculativeResponse", "build_draft", "speculative_generate",
    "stream_speculative_generate",
]
