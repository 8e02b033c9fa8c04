"""The evaluation of issue 4: quality and speed of every gear policy on a real model.

One concern per module: :mod:`.variants` (multi-variant layers for one
batched pass), :mod:`.specs` (policies compared, model layout, §9 cost
model), :mod:`.teacher` (teacher-forced routing and quality metrics),
:mod:`.speed` (decode speed on the real kernels), :mod:`.speculative` (the
speculative policy of issue 7: replayed acceptance, modeled bytes and speed),
:mod:`.workloads` (gear distribution of real generation by workload),
:mod:`.report` (table and JSON), :mod:`.plots` (figures). :mod:`gearbx_mlx.evaluate` ties them together.
"""
