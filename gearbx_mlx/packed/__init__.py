"""Packed integer weights and their kernels.

:mod:`.formats` (the packed layouts and their pure-MLX reference, the oracle
of every kernel), :mod:`.layers` (``PackedLinear``, ``PackedEmbedding``,
dispatching at call time), :mod:`.fused` (q/k/v and gate/up in one launch),
:mod:`.gpu` (Metal and CUDA launchers over the shared kernel sources),
:mod:`.cpu` (the C kernels through cffi, optional), :mod:`.nested_gpu` and
:mod:`.nested_cpu` (the same for the planes of the nested gears),
:mod:`.kernel_files` (where the kernel sources are; the format header's constants).
"""

from .fused import FusedPackedLinear, fuse_modules
from .layers import PackedEmbedding, PackedLinear

__all__ = ["FusedPackedLinear", "PackedEmbedding", "PackedLinear", "fuse_modules"]
