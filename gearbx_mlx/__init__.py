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

# The start-up guard goes first: the public names below import modules that take
# seconds (mlx-lm, and through it transformers), so they load on first use
# (PEP 562): a command that needs none of them (the selftest and its workers)
# does not pay for them.
from importlib import import_module
from typing import Any

from . import launch

launch.guard_start_up()

#: Public name -> the module that defines it.
_LAZY = {
    "Calibration": "calibration", "GEARS": "config", "GearboxConfig": "config", "EntropyMonitor": "entropy",
    "entropy_bits": "entropy", "Gearbox": "gearbox", "GearboxResponse": "generation",
    "SamplingOptions": "generation", "load": "generation", "generate": "pipeline", "prepare": "pipeline",
    "speculative_generate": "pipeline", "stream_generate": "pipeline", "stream_speculative_generate": "pipeline",
    "EntropyPolicy": "policies", "PositionPolicy": "policies", "RandomPolicy": "policies",
    "StaticPolicy": "policies", "PrecisionManager": "precision", "SpeculativeConfig": "speculative",
    "SpeculativeResponse": "speculative",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gearbx_mlx' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "Calibration", "GEARS", "GearboxConfig", "EntropyMonitor", "entropy_bits", "Gearbox",
    "GearboxResponse", "SamplingOptions", "generate", "load", "prepare", "stream_generate", "EntropyPolicy",
    "PositionPolicy", "RandomPolicy", "StaticPolicy", "PrecisionManager",
    "SpeculativeConfig", "SpeculativeResponse", "speculative_generate", "stream_speculative_generate",
]
