"""``python -m gearbx_mlx.server``."""

import sys

from .app import main

sys.exit(main())
