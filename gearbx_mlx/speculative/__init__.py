"""Self-speculative decoding: a lower gear drafts, the high gear verifies.

:mod:`.draft` (the drafter: the model tree with its managed layers in a lower
gear), :mod:`.host` (the drafter's decode step in numpy around the C kernels),
:mod:`.drafter` (the draft paths: host step, MLX tree, none), :mod:`.sparse`
(the activation-sparse drafter: FFN blocks a token barely uses are skipped),
:mod:`.acceptance` (greedy and rejection-sampling acceptance), :mod:`.decode`
(the block loop; the streaming API is :mod:`gearbx_mlx.pipeline`'s), :mod:`.calibration` (measured step
costs, acceptance, the entropy stop), :mod:`.plan` (whether drafting pays
here, measured at start), :mod:`.cli` (``--speculative``).
"""

from .decode import SpeculativeConfig, SpeculativeResponse
from .draft import DraftModel, build_draft
from .plan import SpeculativePlan, plan_speculative

__all__ = [
    "DraftModel", "SpeculativeConfig", "SpeculativePlan", "SpeculativeResponse", "build_draft", "plan_speculative",
]
