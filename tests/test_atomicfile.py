"""The one atomic writer: whole file or the old one, no temporary left behind."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import threading
from pathlib import Path

import pytest

from gearbx_mlx import atomicfile
from gearbx_mlx.calibration import Calibration
from gearbx_mlx.evaluation.report import write_json as write_results


def test_writes_strict_json(tmp_path):
    p = atomicfile.write_json(tmp_path / "r.json", {"a": [1.0, math.nan, {"b": math.inf}]})
    assert json.loads(p.read_text()) == {"a": [1.0, None, {"b": None}]}
    assert os.listdir(tmp_path) == ["r.json"]


def test_missing_folder_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomicfile.write_text(tmp_path / "nope" / "x.txt", "x")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "x.txt"
    target.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):  # a real failure inside the write
        atomicfile.write_text(target, "new \ud800")
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["x.txt"]


def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "c.json"
    target.write_text('{"old": true}\n')
    real = os.fdopen

    class Full(io.TextIOWrapper):
        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")

    def fdopen(fd, mode="r", **kw):
        fh = real(fd, mode.replace("w", "wb") if "b" not in mode else mode)
        return Full(fh, encoding="utf-8")

    monkeypatch.setattr(atomicfile.os, "fdopen", fdopen)
    with pytest.raises(OSError, match="No space"):
        atomicfile.write_json(target, {"new": True})
    assert json.loads(target.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["c.json"]


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    target = tmp_path / "r.json"
    payloads = [{"writer": i, "data": list(range(20000))} for i in range(6)]
    threads = [threading.Thread(target=atomicfile.write_json, args=(target, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(target.read_text()) in payloads
    assert os.listdir(tmp_path) == ["r.json"]


def test_package_writers_go_through_it(tmp_path, monkeypatch):
    """The calibration and the evaluation results are written by the one writer."""
    seen = []
    real = atomicfile.write_text

    def spy(path, text, prefix=atomicfile.TMP_PREFIX):
        seen.append(os.fspath(path))
        return real(path, text, prefix)

    monkeypatch.setattr(atomicfile, "write_text", spy)
    Calibration(low=1.0, high=2.0, strategy="median", n_samples=3, vocab_size=10).save(tmp_path / "cal.json")
    write_results({"rows": []}, tmp_path / "eval.json")
    assert [os.path.basename(p) for p in seen] == ["cal.json", "eval.json"]


@pytest.mark.parametrize("case", ["missing folder", "directory", "pseudo-filesystem", "full disk"])
def test_check_target_refuses_a_path_no_file_can_be_written_to(tmp_path, monkeypatch, case):
    """Each way a target can refuse a file is one error naming the flag and the path, and no
    temporary file is left where the check could create one."""
    path = {"missing folder": tmp_path / "no" / "t.jsonl", "directory": tmp_path,
            "pseudo-filesystem": "/proc/t.jsonl", "full disk": tmp_path / "t.jsonl"}[case]
    if case == "pseudo-filesystem" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    if case == "full disk":
        def full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(atomicfile.tempfile, "mkstemp", full)
    with pytest.raises(OSError) as info:
        atomicfile.check_target(path, "--trace", example="t.jsonl")
    message = str(info.value)
    assert message.startswith(f"--trace {path}") and "\n" not in message
    assert {"missing folder": "does not exist", "directory": f"e.g. {tmp_path / 't.jsonl'}",
            "pseudo-filesystem": "cannot write in /proc", "full disk": "No space left"}[case] in message
    assert os.listdir(tmp_path) == []


def test_check_target_leaves_a_writable_target_untouched(tmp_path):
    old = tmp_path / "t.jsonl"
    old.write_text("kept")
    assert atomicfile.check_target(old, "--trace") == old
    assert old.read_text() == "kept" and os.listdir(tmp_path) == ["t.jsonl"]
    new = tmp_path / "new.json"
    assert atomicfile.check_target(new, "--out") == new and not new.exists()


def test_a_device_or_pipe_is_refused_and_left_as_it_was(tmp_path):
    """An atomic write renames a new file over its path: over a device or a named pipe that would
    replace the device (``--trace /dev/full`` as root did) or the pipe with a plain file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/null")):
        with pytest.raises(ValueError, match="not a regular file"):
            atomicfile.check_target(path, "--trace")
        with pytest.raises(ValueError, match="not a regular file"):
            atomicfile.write_text(path, "x")
        assert not path.is_file() and path.exists()


def test_a_symbolic_link_keeps_pointing_at_the_file_written(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert atomicfile.check_target(link, "--out") == target
    atomicfile.write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}


def test_an_empty_file_name_is_refused():
    for name in ("", "  "):
        with pytest.raises(ValueError, match="needs a file name"):
            atomicfile.check_target(name, "--trace")


def test_a_written_file_gets_the_old_files_mode_or_a_new_files(tmp_path):
    """mkstemp's private 0600 file used to become the result: a 0644 file turned 0600."""
    old = os.umask(0o022)
    try:
        new = atomicfile.write_text(tmp_path / "new.json", "x")
        assert new.stat().st_mode & 0o777 == 0o644
        kept = tmp_path / "kept.json"
        kept.write_text("old")
        kept.chmod(0o640)
        atomicfile.write_text(kept, "x")
        assert kept.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)
