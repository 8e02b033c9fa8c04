"""The evaluation harness: quality and speed of every gear policy on a real model.

One concern per module: :mod:`.variants` (multi-variant layers, a gear per
row or per position), :mod:`.specs` (policies compared, model layout, §9
cost model), :mod:`.chunked` (one row over one window, many decode steps per
forward pass), :mod:`.metrics` (NLL, KL, top-1 and entropy per position),
:mod:`.teacher` (teacher-forced passes over windows), :mod:`.significance`
(paired tests of two rows), :mod:`.text` (the text and its tokens),
:mod:`.speed` (decode speed on the real kernels), :mod:`.speculative` (the
speculative policy: replayed acceptance, modeled bytes and speed),
:mod:`.workloads` (gear distribution of real generation by workload),
:mod:`.report` (table, comparisons and JSON), :mod:`.plots` (figures), and
:mod:`.harness`, whose :func:`~.harness.evaluate` ties them together.
``python -m gearbx_mlx.evaluate`` is its command line.
"""
