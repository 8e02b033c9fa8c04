"""Fault injection: the nested store's planes cache under damage, a full disk, a FIFO and SIGKILL.

Promises under test: the planes file carries the converted models' integrity
record and is checked against it before use, so a same-size overwrite is
caught, named in one warning and rebuilt (and the next run reads the healed
file quietly); a full disk while writing it leaves the run going without the
cache, with one warning naming the file and the cause (a real small tmpfs
where one can be mounted, an injected MLX write failure everywhere); a FIFO
at its path never blocks the run; the temporary file of a killed writer is
removed by a later run, never a live writer's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import make_tiny_llama

from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.nested import store
from gearbx_mlx.nested.store import CACHE_FOLDER, sweep_stale
from gearbx_mlx.precision import PrecisionManager
from gearbx_mlx.sources.entries import TMP_PREFIX, UNLOCKED_STALE_S, file_record

ROOT = Path(__file__).resolve().parent.parent
CFG = GearboxConfig(scope="all", store="nested")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    make_tiny_llama().save_weights(str(d / "model.safetensors"))
    return d


def _manager(model_dir: Path) -> tuple:
    """A nested manager of the tiny model cached in ``model_dir``, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = PrecisionManager(make_tiny_llama(), CFG, planes_dir=model_dir)
    return mgr, [str(w.message) for w in caught]


def _same_planes(a: PrecisionManager, b: PrecisionManager) -> bool:
    return all(mx.array_equal(x.weight, y.weight) and mx.array_equal(x.scales, y.scales)
               for p in a.paths for x, y in zip(a.nested[p].planes, b.nested[p].planes))


def _temps(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX))


# -- damage ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_same_size_overwrite_is_caught_named_once_and_healed(model_dir, keep_mtime):
    first, said = _manager(model_dir)
    path = first.planes_file
    assert first.planes_origin == "built" and said == [] and file_record(path).is_file()
    st, size = path.stat(), path.stat().st_size
    n = min(4 << 20, size // 2)
    with open(path, "r+b") as fh:  # the bytes of the middle, overwritten in place
        fh.seek((size - n) // 2)
        fh.write(os.urandom(n))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # only the change time tells
    assert path.stat().st_size == size
    healed, said = _manager(model_dir)
    assert healed.planes_origin == "built" and len(said) == 1, said
    assert str(path) in said[0] and "SHA-256 differs" in said[0]
    assert _same_planes(first, healed)
    again, said = _manager(model_dir)  # the rebuilt file is trusted again, quietly
    assert again.planes_origin == "cache" and said == [] and _same_planes(first, again)


def test_a_planes_file_without_its_record_is_rebuilt(model_dir):
    first, _ = _manager(model_dir)
    file_record(first.planes_file).unlink()
    second, said = _manager(model_dir)
    assert second.planes_origin == "built" and len(said) == 1 and "no integrity record" in said[0]
    assert _manager(model_dir)[0].planes_origin == "cache"


@pytest.mark.parametrize("blocker", ["folder at the file", "file at the folder"])
def test_what_stands_in_the_place_of_the_planes_cache_is_removed_once(model_dir, blocker):
    """A folder where the planes file belongs (or a file where its folder belongs) made every run
    warn and rebuild the planes, and the warning never said to remove it."""
    first, _ = _manager(model_dir)
    path = first.planes_file
    if blocker == "folder at the file":
        file_record(path).unlink()
        path.unlink()
        path.mkdir()
    else:
        import shutil

        shutil.rmtree(path.parent)
        path.parent.write_text("x")
    second, said = _manager(model_dir)
    assert second.planes_origin == "built" and any("was in the way of the planes cache: removed" in w for w in said)
    third, said = _manager(model_dir)
    assert third.planes_origin == "cache" and said == [] and _same_planes(first, third)


# -- a full disk -----------------------------------------------------------------------------------------
@pytest.fixture
def full_planes_folder(model_dir):
    """``model_dir/gearbx_planes`` as a real 16 KiB tmpfs: the planes file cannot fit."""
    folder = model_dir / CACHE_FOLDER
    folder.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip() or proc.returncode}): "
                    "the injected write failure below covers the same path")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def _goes_on_without_the_cache(model_dir: Path, cause: str) -> None:
    mgr, said = _manager(model_dir)
    path = mgr.planes_file
    assert mgr.planes_origin.startswith("built (cache not written"), mgr.planes_origin
    assert len(said) == 1 and str(path) in said[0] and cause in said[0], said
    assert not path.exists() and not file_record(path).exists() and _temps(path.parent) == []
    assert mgr.cache["low"] and mgr.nested  # the gears are built all the same


def test_a_full_disk_leaves_the_run_going_without_the_cache(full_planes_folder):
    _goes_on_without_the_cache(full_planes_folder.parent, "No space left on device")


def test_a_failed_mlx_write_names_the_file_and_the_run_goes_on(model_dir, monkeypatch):
    def fail(file, arrays, metadata=None):  # MLX's own words for a write to a path that fails
        raise RuntimeError("[write] Unable to write 192407 bytes to file.")

    monkeypatch.setattr(store.mx, "save_safetensors", fail)
    _goes_on_without_the_cache(model_dir, "Unable to write 192407 bytes")


# -- a FIFO in its place ---------------------------------------------------------------------------------
def test_a_fifo_at_the_planes_path_does_not_block(model_dir):
    first, _ = _manager(model_dir)
    path = first.planes_file
    path.unlink()
    os.mkfifo(path)
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(result=_manager(model_dir)), daemon=True)
    worker.start()
    worker.join(120)
    if worker.is_alive():  # blocked on the FIFO: give it writers (EOF) until it lets go, then fail
        for _ in range(120):
            with contextlib.suppress(OSError):  # ENXIO: no reader at this instant
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(0.5)
            if not worker.is_alive():
                break
        pytest.fail("the run blocked on a FIFO at the planes path")
    mgr, said = box["result"]
    assert mgr.planes_origin == "built" and "not a regular file" in said[0]
    assert said[1:] == [f"{path} was in the way of the planes cache: removed"], said
    assert path.is_file() and _manager(model_dir)[0].planes_origin == "cache"


# -- a killed writer ---------------------------------------------------------------------------------------
WRITE_AND_HANG = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from conftest import make_tiny_llama
from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.nested import store
from gearbx_mlx.precision import PrecisionManager
def hang(fh, arrays, metadata=None):
    fh.write(b"half a planes file" * 1000)
    fh.flush()
    print("inside", flush=True)
    time.sleep(120)
store.mx.save_safetensors = hang
PrecisionManager(make_tiny_llama(), GearboxConfig(scope="all", store="nested"), planes_dir=Path(sys.argv[1]))
"""


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_a_killed_writers_temporary_is_swept_a_live_ones_never(model_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", WRITE_AND_HANG, str(model_dir), str(ROOT / "tests")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    folder = model_dir / CACHE_FOLDER
    try:
        assert proc.stdout.readline().strip() == "inside"
        (temp,) = [folder / n for n in _temps(folder)]
        _age(temp, 10 * UNLOCKED_STALE_S)  # old, but its writer holds the lock
        assert sweep_stale(folder) == 0 and temp.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert temp.exists()  # what a killed writer leaves
    _age(temp, 0)
    legacy = folder / f".{'0' * 24}.abcd1234.safetensors"  # an earlier version's temporary name
    legacy.write_bytes(b"x")
    _age(legacy, 2 * 24 * 3600)
    mgr, said = _manager(model_dir)  # the next run: its writer sweeps them
    assert mgr.planes_origin == "built" and said == []
    assert temp.exists()  # a minute has not passed: it could be a writer that has not locked yet
    _age(temp, 10 * UNLOCKED_STALE_S)
    assert _manager(model_dir)[0].planes_origin == "cache"  # the reader sweeps too
    assert not temp.exists() and not legacy.exists() and _temps(folder) == []
