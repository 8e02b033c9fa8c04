"""Gears on a model sharded over several processes with ``mlx.distributed``.

Tensor parallelism stays mlx-lm's and MLX's: ``mlx.launch`` starts the
ranks, ``mx.distributed`` carries every collective, mlx-lm's ``model.shard()``
splits the model. This package makes the gearbox work there:
:mod:`.shard` (checks that a model can be split over the ranks, then shards
it), :mod:`.layers` (every gear built from the rank's own shard; the
sharded-to-all gears keep the sum over the ranks), :mod:`.exchange` (rank 0's
token and entropy of each step on every rank, in one small collective, so
that every rank takes the same gear), :mod:`.ranks` (stages that fail on
every rank when one fails, agreement on the model, settings and prompt).
"""

from .exchange import StepExchange
from .layers import ShardedSumLinear, group_of, local_linear, shard_gear
from .ranks import RankError, Ranks, launched_group, model_identity
from .shard import check_shardable, shard_model

__all__ = [
    "RankError", "Ranks", "ShardedSumLinear", "StepExchange", "check_shardable", "group_of", "launched_group",
    "local_linear", "model_identity", "shard_gear", "shard_model",
]
