"""Files the package writes appear whole or not at all.

One writer for every small text or JSON file the package keeps (calibrations,
evaluation results, integrity records, hash side files, trace headers aside):
the text goes to a temporary file of a unique name in the target's folder,
which is renamed over the target. A reader sees the old file or the new one,
never half of one; two processes writing one path leave one whole file; a
failed write (a full disk, an interrupt) removes its temporary file and leaves
the old file as it was.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from .jsonsafe import dumps

#: The prefix of a temporary file unless the caller names another (a dot: hidden).
TMP_PREFIX = "."


def resolved_target(path: "str | os.PathLike") -> Path:
    """Where a write to ``path`` lands: a symbolic link's target (the file is replaced there and
    the link kept), any other path as given."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _refuse_special(path: Path, what: str) -> None:
    """A device, pipe or socket is never replaced by a file (an atomic write renames over its path)."""
    if path.exists() and not path.is_file() and not path.is_dir():
        raise ValueError(f"{what} {path} is not a regular file (a device, pipe or socket): give a file name")


def check_target(path: "str | os.PathLike", what: str, example: str = "") -> Path:
    """Where to write ``path`` (user-expanded; a symbolic link's target) if a file can be written
    there, else one clear error naming ``what`` (a flag such as ``"--trace"``): an empty name
    (``ValueError``), its folder missing (``FileNotFoundError``), the path a directory
    (``IsADirectoryError``; ``example`` names a file to give instead), a device, pipe or socket
    (``ValueError``), an existing file that is read-only, or the folder refusing a new file
    (``PermissionError`` or another ``OSError``: read-only, full, a pseudo-filesystem). Checked
    by creating and removing a temporary file there, before anything slow runs."""
    if not str(path).strip():
        raise ValueError(f"{what} needs a file name, got an empty one")
    path = resolved_target(Path(path).expanduser())
    _refuse_special(path, what)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{what} {path}: directory {path.parent} does not exist (create it first)")
    if path.is_dir():
        hint = f", e.g. {path / example}" if example else ""
        raise IsADirectoryError(f"{what} {path} is a directory: give a file name{hint}")
    if path.exists() and not os.access(path, os.W_OK):
        raise PermissionError(f"{what} {path} is not writable")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise type(e)(f"{what} {path}: cannot write in {path.parent} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)
    return path


def check_directory(path: "str | os.PathLike", what: str) -> Path:
    """The folder ``path`` (user-expanded), created with its parents where missing, if files can
    be written in it; else one clear error naming ``what`` (a flag such as ``"--plots"``): an
    empty name or a path that is not a folder (``ValueError``), a folder that cannot be created
    or written (``OSError``: read-only, a pseudo-filesystem). Checked by creating and removing a
    temporary file there, before anything slow runs."""
    if not str(path).strip():
        raise ValueError(f"{what} needs a folder name, got an empty one")
    d = Path(path).expanduser()
    if d.exists() and not d.is_dir():
        raise ValueError(f"{what} {path} is a file, not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}check.", suffix=".tmp", dir=d)
    except OSError as e:
        raise type(e)(f"{what} {path}: cannot create or write the directory ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)
    return d


def write_text(path: "str | os.PathLike", text: str, prefix: str = TMP_PREFIX) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; ``FileNotFoundError`` naming the folder
    if it does not exist. ``prefix`` starts the temporary file's name. A symbolic link's target
    is written (the link kept); a device, pipe or socket is refused (``ValueError``)."""
    path = resolved_target(path)
    _refuse_special(path, "file")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path.name}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            # mkstemp's file is private (0600): give the result the old file's mode, or a new
            # file's as open() would make it (0666 less the umask)
            os.fchmod(fh.fileno(), _mode_for(path))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        mask = os.umask(0o022)  # read it back: os.umask sets and returns
        os.umask(mask)
        return 0o666 & ~mask


def write_json(path: "str | os.PathLike", obj: Any, indent: "int | None" = 1, prefix: str = TMP_PREFIX) -> Path:
    """:func:`write_text` of strict JSON (:func:`gearbx_mlx.jsonsafe.dumps`) and a final newline."""
    return write_text(path, dumps(obj, indent=indent) + "\n", prefix)
