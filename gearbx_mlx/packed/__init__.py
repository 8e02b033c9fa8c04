"""Packed integer weights and their kernels.

:mod:`.formats` (the packed layouts and their pure-MLX reference, the oracle
of every kernel), :mod:`.layers` (``PackedLinear``, ``PackedEmbedding``,
dispatching at call time), :mod:`.fused` (q/k/v and gate/up in one launch),
:mod:`.gpu` (Metal and CUDA launchers over the shared kernel sources),
:mod:`.cpu` (the C kernels through cffi, optional).
"""

from .fused import FusedPackedLinear, fuse_modules
from .layers import PackedEmbedding, PackedLinear

__all__ = ["FusedPackedLinear", "PackedEmbedding", "PackedLinear", "fuse_modules"]
