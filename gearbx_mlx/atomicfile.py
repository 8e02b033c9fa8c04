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


def write_text(path: "str | os.PathLike", text: str, prefix: str = TMP_PREFIX) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; ``FileNotFoundError`` naming the folder
    if it does not exist. ``prefix`` starts the temporary file's name."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path.name}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def write_json(path: "str | os.PathLike", obj: Any, indent: "int | None" = 1, prefix: str = TMP_PREFIX) -> Path:
    """:func:`write_text` of strict JSON (:func:`gearbx_mlx.jsonsafe.dumps`) and a final newline."""
    return write_text(path, dumps(obj, indent=indent) + "\n", prefix)
