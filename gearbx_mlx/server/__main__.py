"""``python -m gearbx_mlx.server``."""

from .app import entry

entry()
