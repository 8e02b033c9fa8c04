"""Packed integer weights and the layers that hold them.

:mod:`.formats` (the packed layouts and their pure-MLX reference, the oracle
of every kernel), :mod:`.layers` (``PackedLinear``, ``PackedEmbedding``,
dispatching at call time), :mod:`.fused` (q/k/v and gate/up in one launch),
:mod:`.checks` (the packed kernels' self-checks). The kernels' launchers, the
C library's loader and the first-use guard are :mod:`gearbx_mlx.bindings`.
"""

from .fused import FusedPackedLinear, fuse_modules
from .layers import PackedEmbedding, PackedLinear

__all__ = ["FusedPackedLinear", "PackedEmbedding", "PackedLinear", "fuse_modules"]
