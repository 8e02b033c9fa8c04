"""The evaluation harness: quality and speed of every gear policy on a real model.

One concern per module: :mod:`.variants` (multi-variant layers for one
batched pass), :mod:`.specs` (policies compared, model layout, §9 cost
model), :mod:`.teacher` (teacher-forced routing and quality metrics),
:mod:`.speed` (decode speed on the real kernels), :mod:`.speculative` (the
speculative policy: replayed acceptance, modeled bytes and speed),
:mod:`.workloads` (gear distribution of real generation by workload),
:mod:`.report` (table and JSON), :mod:`.plots` (figures), and
:mod:`.harness`, whose :func:`~.harness.evaluate` ties them together.
``python -m gearbx_mlx.evaluate`` is its command line.
"""
