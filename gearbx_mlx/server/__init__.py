"""An OpenAI-compatible server on mlx-lm's (``python -m gearbx_mlx.server``, ``gearbx-server``).

:mod:`~gearbx_mlx.server.options` (flags, the request's ``gearbx`` object),
:mod:`~gearbx_mlx.server.provider` (loading, the call into generation),
:mod:`~gearbx_mlx.server.generator` (mlx-lm's generation thread),
:mod:`~gearbx_mlx.server.handler` (mlx-lm's HTTP handler) and
:mod:`~gearbx_mlx.server.app` (``main``).
"""
