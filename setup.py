"""Build hook for the optional C CPU kernels; all metadata is in pyproject.toml.

``cffi_modules`` builds ``gearbx_mlx.bindings._gearbx_cpu`` from ``gearbx_mlx/bindings/csrc/``
and the format header ``metal_kernels/gearbx_format.h`` (API mode, see
``gearbx_mlx/bindings/build.py`` for the per-platform flags). The extension is
optional: if it cannot be compiled, installation still succeeds with a
warning, ``gearbx_mlx.bindings.cpu.available()`` is False and packed layers run on MLX.
Set ``GEARBX_NO_CPU_EXT=1`` to skip it.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed C build into a warning."""

    failed = False

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001  (compiler missing, bad flags, ...)
            if not self.failed:  # else: only the in-place copy of what failed
                self._skip(e)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            self.failed = True
            self._skip(e)

    @staticmethod
    def _skip(e: Exception) -> None:
        print(
            f"WARNING: gearbx_mlx C CPU kernels not built ({type(e).__name__}: {e}); "
            "installing without them (pure-MLX fallback).",
            file=sys.stderr,
        )


if os.environ.get("GEARBX_NO_CPU_EXT"):
    setup()
else:
    setup(cffi_modules=["gearbx_mlx/bindings/build.py:make_ffibuilder"], cmdclass={"build_ext": OptionalBuildExt})
