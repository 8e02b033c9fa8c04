"""Nested gears: all three gears of a weight in one buffer of bit planes.

:mod:`.planes` (the planes and their pure-MLX product, the oracle of every
fused kernel), :mod:`.matmul` (a gear's product through the fastest kernel
that applies: ``NestedProduct``, ``nested_matmul``).
"""
