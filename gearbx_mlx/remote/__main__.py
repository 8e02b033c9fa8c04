"""``python -m gearbx_mlx.remote``: see :mod:`gearbx_mlx.remote.cli`."""

import sys

from .cli import main

sys.exit(main())
