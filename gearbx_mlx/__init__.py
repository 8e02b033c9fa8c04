"""gearbx_mlx: entropy-routed dynamic quantization for MLX decoding.

    >>> import gearbx_mlx
    >>> model, tokenizer, gearbox = gearbx_mlx.load()          # default model
    >>> for r in gearbx_mlx.stream_generate(model, tokenizer, "Hi", gearbox):
    ...     print(r.text, r.gear, r.entropy)

Importing the package has no side effects: nothing is compiled, downloaded or
written until a function is called. (In a process started as one of the
package's commands, its start-up answers Ctrl-C with one line and exit 130:
:mod:`gearbx_mlx.launch`.)
"""

# The start-up guard goes first: the imports below take seconds.
# ruff: noqa: E402
from . import launch

launch.guard_start_up()

from .calibration import Calibration
from .config import GEARS, GearboxConfig
from .entropy import EntropyMonitor, entropy_bits
from .gearbox import Gearbox
from .generation import GearboxResponse, SamplingOptions, load
from .pipeline import generate, prepare, speculative_generate, stream_generate, stream_speculative_generate
from .policies import EntropyPolicy, PositionPolicy, RandomPolicy, StaticPolicy
from .precision import PrecisionManager
from .speculative import SpeculativeConfig, SpeculativeResponse

__version__ = "0.1.0"

__all__ = [
    "Calibration", "GEARS", "GearboxConfig", "EntropyMonitor", "entropy_bits", "Gearbox",
    "GearboxResponse", "SamplingOptions", "generate", "load", "prepare", "stream_generate", "EntropyPolicy",
    "PositionPolicy", "RandomPolicy", "StaticPolicy", "PrecisionManager",
    "SpeculativeConfig", "SpeculativeResponse", "speculative_generate", "stream_speculative_generate",
]
