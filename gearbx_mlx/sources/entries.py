"""Cache entries that are complete and checked, or absent.

A converted model folder in the cache is an *entry*. It is built in a
temporary folder, given an integrity record (:data:`RECORD`: each file's size
and SHA-256), and renamed into place, so an entry is either whole or not
there. Before an entry is used, :func:`check_entry` compares every recorded
file with the record: a missing file or a different size is damage; a file
whose modification or change time differs from the record is hashed again
(a same-size overwrite changes them), and a different hash is damage. Hashing
everything on every run would cost about a second per 500 MB; the times make
it unnecessary unless something touched the file.

A damaged entry (or one from a version that wrote no record) is rebuilt: the
new folder is renamed over it, the old one moved aside and deleted. When two
processes build the same entry at once, the second to finish finds the
first's entry in place, checks it, and uses it (the rename race). When an
entry cannot be replaced, the error names the folder to delete; when the
cache folder cannot be written at all (read-only, another user's), one error
says so before anything is built, naming the folder, the cause and the fix.
The cache's folders are the package's own: a file, a FIFO or a dangling link
where one belongs is removed with a warning (:func:`make_folder`).

Temporary folders carry :data:`TMP_PREFIX` and a lock file that their builder
holds (``flock``) while it works: the lock dies with the process, even under
SIGKILL, so :func:`clean_stale` removes exactly the temporaries of dead runs.

A single cached file (the nested store's planes) has the same record, of one
file, beside it (:func:`file_record`, :func:`check_file`), and is written
through a temporary file its writer holds locked (:func:`temporary_file`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterator, Optional, Tuple

from ..atomicfile import write_json

try:  # POSIX (macOS, Linux); elsewhere temporaries are judged by age alone
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

#: The integrity record inside an entry.
RECORD = ".gearbx-entry.json"
RECORD_FORMAT = 1
#: Names of temporary files and folders in cache directories.
TMP_PREFIX = ".gearbx-tmp-"
LOCK = ".lock"
#: A temporary without a lock (its builder died before taking it) older than this is stale.
UNLOCKED_STALE_S = 60.0
#: Temporaries named the way earlier versions named them, older than this, are stale.
LEGACY_STALE_S = 24 * 3600.0


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(st: os.stat_result) -> Dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _files(folder: Path) -> Iterator[Path]:
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            yield p


def write_record(folder: Path, source: Optional[Dict[str, Any]] = None) -> Path:
    """Record the size, times and SHA-256 of every file under ``folder``."""
    files = {}
    for p in _files(folder):
        files[p.relative_to(folder).as_posix()] = {**_stamp(p.stat()), "sha256": sha256_file(p)}
    if not files:
        raise ValueError(f"{folder} holds no files: nothing to record")
    record = {"format": RECORD_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "source": source or {}, "files": files}
    _write_json(folder / RECORD, record)
    return folder / RECORD


def _write_json(path: Path, obj: Any) -> None:
    write_json(path, obj, prefix=TMP_PREFIX)


def check_entry(folder: Path) -> Optional[str]:
    """None if ``folder`` is a complete entry whose files match its record; else what is wrong."""
    if not folder.exists():
        return "absent"
    if not folder.is_dir():
        return "not a folder"
    record, reason = _read_record(folder / RECORD)
    return reason or _check_recorded(folder, record, folder / RECORD)


def _read_record(path: Path) -> Tuple[Dict[str, Any], Optional[str]]:
    """``(record, None)``, or ``({}, what is wrong)`` (a FIFO in its place is not opened: it would block)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return {}, f"its integrity record {path.name} is not a regular file"
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, "no integrity record (made by an earlier version, or never finished)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}, f"its integrity record {path.name} is unreadable"
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not files or record.get("format") != RECORD_FORMAT:
        return {}, f"its integrity record {path.name} is malformed"
    return record, None


def _check_recorded(folder: Path, record: Dict[str, Any], record_path: Path) -> Optional[str]:
    """None if every file of ``record`` (relative to ``folder``) matches it; the record's times are
    refreshed where a file was touched but its hash is unchanged."""
    refreshed = False
    for name, want in record["files"].items():
        p = folder / name
        try:
            st = p.stat()
        except OSError:
            return f"{name} is missing"
        if not isinstance(want, dict):
            return f"its integrity record {record_path.name} is malformed"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file"
        if st.st_size != want.get("size"):
            return f"{name} has {st.st_size} bytes, the record says {want.get('size')}"
        if _stamp(st) != {k: want.get(k) for k in ("size", "mtime_ns", "ctime_ns")}:
            # Touched since recorded: only the hash can tell whether it changed.
            if sha256_file(p) != want.get("sha256"):
                return f"{name} was modified (its SHA-256 differs from the record)"
            want.update(_stamp(st))
            refreshed = True
    if refreshed:
        with contextlib.suppress(OSError):  # a read-only cache just hashes again next time
            _write_json(record_path, record)
    return None


def note_once(folder: Path, note: str) -> bool:
    """True the first time ``note`` is noted for the entry ``folder``, False after: the note is kept
    in the entry's record (``"notes"``), so it lasts as long as the entry (a rebuilt entry forgets
    it). A folder that is no good entry (a user's own, read-only, damaged) remembers nothing: True.

    For what should be said once per converted model, not once per run (the warning that the
    source was already quantized).
    """
    if check_entry(folder) is not None:
        return True
    record, reason = _read_record(folder / RECORD)
    if reason is not None:
        return True
    notes = record.get("notes") if isinstance(record.get("notes"), list) else []
    if note in notes:
        return False
    record["notes"] = [*notes, note]
    with contextlib.suppress(OSError):  # cannot remember it: say it again next time
        _write_json(folder / RECORD, record)
    return True


# -- single cached files ----------------------------------------------------------------------
def file_record(path: Path) -> Path:
    """Where the integrity record of the single cached file ``path`` lives: ``.<name>.gearbx-entry.json``
    beside it (the same record as an entry's, of one file)."""
    return path.with_name(f".{path.name}{RECORD}")


def write_file_record(path: Path, sha256: Optional[str] = None, source: Optional[Dict[str, Any]] = None) -> Path:
    """Record the size, times and SHA-256 (``sha256`` if already known) of the file ``path``."""
    entry = {**_stamp(path.stat()), "sha256": sha256 or sha256_file(path)}
    record = {"format": RECORD_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "source": source or {}, "files": {path.name: entry}}
    _write_json(file_record(path), record)
    return file_record(path)


def check_file(path: Path) -> Optional[str]:
    """None if the cached file ``path`` is a regular file that matches its record
    (:func:`file_record`); else what is wrong ("absent" if there is nothing)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "absent"
    except OSError as e:
        return f"it cannot be examined ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    record, reason = _read_record(file_record(path))
    if reason is None and set(record["files"]) != {path.name}:
        reason = f"its integrity record {file_record(path).name} is malformed"
    return reason or _check_recorded(path.parent, record, file_record(path))


@contextlib.contextmanager
def temporary_file(parent: Path, name: str) -> Iterator[Tuple[Path, BinaryIO]]:
    """``(path, open file)``: a temporary file in ``parent`` that its writer holds locked
    (``flock``) while it writes, so :func:`clean_stale` never takes a live one, however
    long it writes, and takes a dead run's once it is :data:`UNLOCKED_STALE_S` old (a
    lock is taken just after the file is made); removed on exit unless renamed away."""
    parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{name}.", dir=parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if fcntl is not None:
                _lock_own(fh.fileno())
            yield Path(tmp), fh
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


# -- temporaries ----------------------------------------------------------------------------
@contextlib.contextmanager
def temporary_dir(parent: Path, name: str, damaged: Optional[str] = None) -> Iterator[Path]:
    """A locked temporary folder in ``parent`` (removed on exit, whatever happens).

    Raises:
        OSError: ``parent`` cannot be made or written (:func:`unwritable`; ``damaged``
            says what the temporary was to replace).
    """
    make_folder(parent, damaged)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}.", dir=parent))
    except OSError as e:
        raise unwritable(parent, e, damaged) from None
    try:
        fd = os.open(tmp / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise unwritable(parent, e, damaged) from None
    try:
        if fcntl is not None:
            _lock_own(fd)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def _lock_own(fd: int) -> None:
    """Lock a temporary this run has just made. Waiting is right: the only other holder can be
    another run's :func:`_owner_alive`, which takes the lock of an unlocked temporary for an
    instant to learn that it is free (a non-blocking lock here failed with EAGAIN when two runs
    met that way)."""
    fcntl.flock(fd, fcntl.LOCK_EX)


def _owner_alive(tmp: Path) -> Optional[bool]:
    """True if the builder of ``tmp`` (a folder, or a file of :func:`temporary_file`) still holds
    its lock; False if a lock is free; None if it has none."""
    lock = tmp / LOCK if tmp.is_dir() else tmp
    try:
        if fcntl is None or not stat.S_ISREG(lock.lstat().st_mode):
            return None  # never open a FIFO or a device: that could block
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # closing releases a lock we took
    return False


def _is_legacy_tmp(p: Path) -> bool:
    """Temporaries of earlier versions: ``.NAME.XXXXXXXX`` folders, ``tmpXXXXXXXX``
    download folders, ``.FILE.XXXXXXXX`` files."""
    n = p.name
    return (n.startswith("tmp") and p.is_dir()) or (n.startswith(".") and not n.startswith(TMP_PREFIX)
                                                     and n != RECORD and len(n.rsplit(".", 1)[-1]) == 8)


def clean_stale(parent: Path, say: Optional[Callable[[str], None]] = None) -> int:
    """Remove temporaries of dead runs in ``parent``; returns how many went."""
    if not parent.is_dir():
        return 0
    now, removed = time.time(), 0
    for p in parent.iterdir():
        try:
            age = now - p.lstat().st_mtime
        except OSError:
            continue
        if p.name.startswith(TMP_PREFIX):
            alive = _owner_alive(p)
            # A folder whose lock is free is a dead run's; a file may be an unlocked one
            # (a record being written), so a free file is stale only once old.
            stale = (alive is False and p.is_dir()) or (not alive and age > UNLOCKED_STALE_S)
        else:
            stale = _is_legacy_tmp(p) and age > LEGACY_STALE_S
        if not stale:
            continue
        remove_path(p)
        if not p.exists():
            removed += 1
            if say:
                say(f"removed {p.name}, left by an interrupted run")
    return removed


# -- building -------------------------------------------------------------------------------------
def install(new: Path, out: Path, say: Optional[Callable[[str], None]] = None) -> Path:
    """Rename the finished folder ``new`` to ``out``.

    If ``out`` exists: a good entry there (another process finished first)
    wins and ``new`` is discarded; a damaged one is moved aside and replaced.

    Raises:
        RuntimeError: ``out`` is damaged and cannot be replaced (names it: delete it).
    """
    for _ in range(3):
        try:
            os.rename(new, out)
            return out
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
        reason = check_entry(out)
        if reason is None:
            if say:
                say(f"another run finished {out.name} first: using its copy")
            shutil.rmtree(new, ignore_errors=True)
            return out
        aside = out.with_name(f"{TMP_PREFIX}{out.name}.damaged.{os.getpid()}.{time.monotonic_ns()}")
        try:
            os.rename(out, aside)
        except FileNotFoundError:
            continue  # someone else moved it: try again
        except OSError as e:
            raise RuntimeError(
                f"the cached {out} is damaged ({reason}) and could not be replaced ({e.strerror}): "
                f"delete {out} and run again"
            ) from None
        remove_path(aside)
    raise RuntimeError(f"could not install {out} (other runs keep replacing it): delete {out} and run again")


def failure_cause(e: BaseException) -> str:
    """What a failed write says went wrong: the OS's reason (``No space left on device``), else
    MLX's message (its writes to a path raise RuntimeError), else the exception's name."""
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def unwritable(folder: Path, e: BaseException, damaged: Optional[str] = None) -> OSError:
    """The one error for a cache folder that cannot be written (read-only, another user's, full):
    it names the folder, the cause (:func:`failure_cause`) and the fix; ``damaged`` (what in it is
    damaged, and why) comes first, since it cannot be replaced."""
    full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    head = f"{damaged} and cannot be replaced: " if damaged else ""
    return OSError(f"{head}the cache folder {folder} cannot be written ({failure_cause(e)}): "
                   f"{'free space there' if full else 'make it writable'}, "
                   "or point GEARBX_CACHE to a writable folder")


def in_the_way(p: Path, folder: bool) -> bool:
    """Something is at ``p`` that is not what the cache keeps there: not a folder (``folder``),
    or not a regular file (a folder, a FIFO, a device, a dangling link)."""
    return os.path.lexists(p) and not (p.is_dir() if folder else p.is_file())


def make_folder(folder: Path, damaged: Optional[str] = None) -> Path:
    """``folder``, a folder of the package's cache, made if absent (its parents too).

    Whatever is in its place (a file, a FIFO, a dangling link) is the cache's own and is
    removed, with a warning, as the planes cache does. A folder above it that is not a
    folder (``$GEARBX_CACHE`` naming a file) is the user's: the error names it.

    Raises:
        OSError: ``folder`` cannot be made (:func:`unwritable`; ``damaged`` as there), or
            what is in its place cannot be removed (names it and the fix).
    """
    if in_the_way(folder, folder=True):
        try:
            os.unlink(folder)  # not a folder: a file, a FIFO or a link goes with unlink (remove_path's way)
        except OSError as e:
            raise OSError(f"{folder} is in the way of the cache (a folder belongs there) and cannot be removed "
                          f"({failure_cause(e)}): remove or rename it, or point GEARBX_CACHE to another folder") from None
        warnings.warn(f"{folder} was in the way of the cache: removed", stacklevel=2)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        above = next((p for p in folder.parents if in_the_way(p, folder=True)), None)
        if above is not None:
            raise NotADirectoryError(f"{above} is not a folder, so the cache cannot keep {folder} in it: "
                                     "remove or rename it, or point GEARBX_CACHE to a folder") from None
        raise unwritable(folder, e, damaged) from None
    return folder


def remove_path(p: Path) -> None:
    """Remove a folder tree, or whatever else is at ``p`` (a file, a link, a FIFO), ignoring errors.
    ``shutil.rmtree`` opens its path first, and opening a FIFO blocks until a writer comes."""
    try:
        st = os.lstat(p)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            os.unlink(p)
        except OSError:
            pass


def build_entry(
    out: Path,
    build: Callable[[Path], Any],
    source: Optional[Dict[str, Any]] = None,
    say: Optional[Callable[[str], None]] = None,
) -> Path:
    """``out`` as a checked entry: as it is if good, else built by ``build(folder)``.

    ``build`` must create ``folder`` (it does not exist yet) and fill it.

    Raises:
        OSError: the cache folder cannot be written: one error, before anything is built,
            that names the folder, the cause, the fix and the damage if ``out`` is damaged.
    """
    clean_stale(out.parent, say)
    reason = check_entry(out)
    if reason is None:
        return out
    damaged = None if reason == "absent" else f"the cached {out} is damaged ({reason})"
    with temporary_dir(out.parent, out.name, damaged) as tmp:  # a cache that cannot be written fails here
        if damaged and say:
            say(f"the cached {out} is not usable ({reason}): building it again")
        folder = tmp / "entry"
        build(folder)
        write_record(folder, source)
        return install(folder, out, say)
