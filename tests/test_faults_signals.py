"""Fault injection: Ctrl-C (SIGINT) at every stage of a run.

The promise: Ctrl-C at any point after the trace file is named leaves a trace
that ``read_trace`` accepts, whose summary says ``"interrupted": true`` (and
``stage``, where it stopped, when no token came); the command prints one line
and exits 130, never a traceback. In-process tests raise KeyboardInterrupt
(what Python's SIGINT handler does) at each stage deterministically; two
subprocess tests send a real SIGINT, while the model loads (blocked on a
FIFO) and while it decodes.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_models import tiny_model_folder

from gearbx_mlx import analyze
from gearbx_mlx.remote import cli as remote_cli, session as remote_lib
from gearbx_mlx.telemetry.trace import TraceWriter, read_trace

generate = importlib.import_module("gearbx_mlx.generate")  # the module (the package exports a function of that name)

#: Wall seconds a subprocess may take to start (imports) on a loaded machine.
START_S = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("signals"))


def run_generate(capsys, tiny: Path, trace: Path, *extra: str) -> tuple:
    code = generate.main(["--model", str(tiny), "--prompt", "Hello the", "--max-tokens", "12",
                          "--trace", str(trace), *extra])
    err = capsys.readouterr().err
    return code, err


def assert_interrupted_trace(trace: Path, stage=None, tokens=0):
    t = read_trace(trace)
    assert t.summary is not None and t.summary["interrupted"] is True
    assert len(t.tokens) == tokens == t.summary["generation_tokens"]
    if stage is not None:
        assert t.summary["stage"] == stage
    return t


# -- each stage, in process --------------------------------------------------------------------
def _raise(*_a, **_k):
    raise KeyboardInterrupt


def test_ctrl_c_while_loading(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load", _raise)
    code, err = run_generate(capsys, tiny, tmp_path / "t.jsonl")
    assert code == 130 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["interrupted while loading the model"]
    t = assert_interrupted_trace(tmp_path / "t.jsonl", stage="loading")
    assert t.header["model"] == str(tiny) and "vocab_size" not in t.header  # the early header


def test_ctrl_c_while_calibrating(tiny, tmp_path, capsys, monkeypatch):
    from gearbx_mlx.gearbox import Gearbox

    monkeypatch.setattr(Gearbox, "calibrate", _raise)
    code, err = run_generate(capsys, tiny, tmp_path / "t.jsonl", "--calibrate")
    assert code == 130 and "Traceback" not in err and "interrupted while calibrating" in err
    assert_interrupted_trace(tmp_path / "t.jsonl", stage="calibrating")


def test_ctrl_c_in_the_prefill(tiny, tmp_path, capsys, monkeypatch):
    real = generate.prepare

    def prepare_then_ctrl_c(*a, **k):
        run = real(*a, **k)
        run.tokens = lambda: (_raise() for _ in [0])  # the prefill's first evaluation raises
        return run

    monkeypatch.setattr(generate, "prepare", prepare_then_ctrl_c)
    code, err = run_generate(capsys, tiny, tmp_path / "t.jsonl")
    assert code == 130 and "Traceback" not in err
    t = assert_interrupted_trace(tmp_path / "t.jsonl", stage="prefill")
    assert t.header["vocab_size"] == 266 and t.header["thresholds"]["source"] == "default-scaled"


def test_ctrl_c_while_the_drafter_is_timed(tiny, tmp_path, capsys, monkeypatch):
    """``--speculative``: the decision times the drafter on the prompt before anything streams;
    an interrupt there is said and traced as such (it was called preparing the prompt)."""
    monkeypatch.setattr(generate, "prepare", _raise)
    code, err = run_generate(capsys, tiny, tmp_path / "t.jsonl", "--speculative")
    assert code == 130 and "Traceback" not in err and "interrupted while timing the drafter" in err
    assert_interrupted_trace(tmp_path / "t.jsonl", stage="timing the drafter")


def test_ctrl_c_while_decoding(tiny, tmp_path, capsys, monkeypatch):
    real = generate.prepare

    def three_then_ctrl_c(*a, **k):
        run = real(*a, **k)
        tokens = run.tokens

        def stream():
            for i, r in enumerate(tokens()):
                if i == 3:
                    raise KeyboardInterrupt
                yield r

        run.tokens = stream
        return run

    monkeypatch.setattr(generate, "prepare", three_then_ctrl_c)
    code, err = run_generate(capsys, tiny, tmp_path / "t.jsonl")
    assert code == 130 and "Traceback" not in err and "Interrupted." in err
    t = assert_interrupted_trace(tmp_path / "t.jsonl", tokens=3)
    assert t.header["prompt_tokens"] > 0 and t.header["initial_gear"] in ("low", "mid", "high")


def test_an_interrupted_trace_can_be_analyzed(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load", _raise)
    run_generate(capsys, tiny, tmp_path / "t.jsonl")
    assert analyze.main([str(tmp_path / "t.jsonl")]) == 0
    assert "did not finish" in capsys.readouterr().out


def test_an_error_after_the_header_is_in_the_trace(tiny, tmp_path, capsys):
    code, err = run_generate(capsys, tiny, tmp_path / "t.jsonl", "--thresholds", "1", "20")
    assert code == 1 and "above log2(266)" in err and "Traceback" not in err
    t = read_trace(tmp_path / "t.jsonl")
    assert t.summary["interrupted"] is False and "above log2(266)" in t.summary["error"]


def test_the_trace_file_never_exists_without_its_header(tmp_path, monkeypatch):
    """The header goes into a temporary file renamed over the trace: a failure
    while writing it leaves the previous file (or none), never a torn one."""
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path)
    assert not path.exists()  # nothing until the first record
    w.header(model="m")
    first = path.read_text()
    w.header(vocab_size=10)  # rewritten before the first token, with both fields
    t = read_trace(path)
    assert t.header["model"] == "m" and t.header["vocab_size"] == 10 and first != path.read_text()

    def torn(*_a):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", torn)
    with pytest.raises(KeyboardInterrupt):
        w.header(model="x")
    monkeypatch.undo()
    assert read_trace(path).header["model"] == "m"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # no temporary left
    w.token(index=0, entropy=1.0, gear="low", shift=False)
    with pytest.raises(ValueError, match="before the first token"):
        w.header(model="late")
    w.summary(interrupted=True)
    w.close()
    assert read_trace(path).summary["interrupted"] is True

    w2 = TraceWriter(tmp_path / "s.jsonl")  # a summary with no header gets a minimal one
    w2.summary(interrupted=True)
    w2.close()
    assert read_trace(tmp_path / "s.jsonl").tokens == []


def test_ctrl_c_in_the_remote_client(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(remote_lib.RemoteSession, "ask", _raise)
    trace = tmp_path / "t.jsonl"
    code = remote_cli.main(["--variant", "http://127.0.0.1:9", "--vocab-size", "100", "-p", "hi",
                            "--trace", str(trace)])
    assert code == 130 and "Traceback" not in capsys.readouterr().err
    assert read_trace(trace).summary["interrupted"] is True


# -- real signals, in a subprocess -------------------------------------------------------------------
def _spawn(tmp_path: Path, model: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "gearbx_mlx.generate", "--model", str(model), "--prompt", "Hello the",
         "--trace", str(tmp_path / "t.jsonl"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _wait_for(cond, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the condition never came")
        time.sleep(0.05)


def _interrupt(proc: subprocess.Popen, sig: int = signal.SIGINT) -> tuple:
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err


def test_sigint_while_loading_real_signal(tiny, tmp_path):
    """tokenizer.json is a FIFO nobody writes: loading blocks there until SIGINT."""
    import shutil

    model = tmp_path / "blocked"
    shutil.copytree(tiny, model)
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")
    proc = _spawn(tmp_path, model)
    _wait_for(lambda: (tmp_path / "t.jsonl").exists(), proc, START_S)
    time.sleep(1.0)  # well inside the load now (it cannot pass the FIFO)
    code, err = _interrupt(proc)
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted while loading the model" in err
    assert_interrupted_trace(tmp_path / "t.jsonl", stage="loading")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_while_decoding_real_signal(tiny, tmp_path, sig):
    """Ctrl-C, and SIGTERM (``kill``, ``timeout``) alike: a clean stop and a summarized trace."""
    proc = _spawn(tmp_path, tiny, "--max-tokens", "100000", "--ignore-chat-template")

    def tokens() -> int:
        p = tmp_path / "t.jsonl"
        return p.read_text().count('"type": "token"') if p.exists() else 0

    _wait_for(lambda: tokens() >= 3, proc, START_S)
    code, err = _interrupt(proc, sig)
    assert code == 130 and "Traceback" not in err, err
    t = read_trace(tmp_path / "t.jsonl")
    assert t.summary["interrupted"] is True and len(t.tokens) == t.summary["generation_tokens"] >= 3


@pytest.mark.slow
def test_sigint_during_a_long_prefill_real_signal(tmp_path):
    """A real SIGINT a second into the prefill of a ~1,500-token prompt on the default model.

    The prompt is fed in chunks (``PREFILL_STEP_SIZE``) and Python handles the
    signal between two MLX evaluations, so it lands within one chunk: exit 130,
    one line, a trace whose summary says interrupted in the prefill, no token.
    """
    from gearbx_mlx.sources.models import resolve_model

    model = Path(resolve_model(None))
    prompt = "The quick brown fox jumps over the lazy dog. " * 150
    proc = _spawn(tmp_path, model, "--prompt", prompt, "--max-tokens", "64", "--store", "separate")
    trace = tmp_path / "t.jsonl"
    # The run record's header ("mode") is written just before the prefill starts.
    _wait_for(lambda: trace.exists() and '"mode": "routed"' in trace.read_text(), proc, START_S)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=300)  # a hang guard, not a timing check
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "interrupted" in err
    assert_interrupted_trace(trace, stage="prefill")


def _mlx_mapped(pid: int) -> bool:
    """True once the process has begun loading MLX: the package's imports are under way."""
    try:
        return "mlx" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps to see the imports start")
@pytest.mark.parametrize("after_s", [0.0, 0.3, 0.8])
def test_sigint_during_start_up_real_signal(tiny, tmp_path, after_s):
    """A real SIGINT while ``python -m gearbx_mlx.generate`` still imports the package
    (MLX, mlx-lm, transformers): one line, exit 130, no traceback. Sent as soon as MLX
    starts loading (surely inside the imports: the line is then exactly "interrupted"),
    and a little later (inside the imports on most machines; past them, the command's
    own handling answers, by the same promise)."""
    proc = _spawn(tmp_path, tiny)
    _wait_for(lambda: _mlx_mapped(proc.pid), proc, START_S)
    time.sleep(after_s)
    code, err = _interrupt(proc)
    assert code == 130 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err, err
    if after_s == 0.0:
        assert err.strip() == "interrupted", err


def test_start_up_guard_applies_to_the_commands_only():
    from gearbx_mlx import launch

    assert launch.command_of("-m", ["python", "-m", "gearbx_mlx.generate", "-p", "hi"]) == "gearbx_mlx.generate"
    assert launch.command_of("-m", ["python", "-X", "dev", "-mgearbx_mlx.server"]) == "gearbx_mlx.server"
    assert launch.command_of("-m", ["python", "-m", "pytest"]) is None
    assert launch.command_of("-m", ["python", "-m", "gearbx_mlx.bindings.build"]) is None
    assert launch.command_of("/venv/bin/gearbx-bench", ["/venv/bin/python", "/venv/bin/gearbx-bench"]) == "gearbx-bench"
    assert launch.command_of("-c", ["python", "-c", "import gearbx_mlx"]) is None
    assert launch.command_of("/x/ipython", ["python", "/x/ipython"]) is None
    assert not launch.guard_start_up()  # a test run is no command: importing the package changed nothing
    assert signal.getsignal(signal.SIGINT) is not None and signal.getsignal(signal.SIGINT).__module__ != launch.__name__


def test_start_up_guard_knows_every_console_script():
    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    from gearbx_mlx import launch

    assert set(launch.COMMAND_SCRIPTS) == set(scripts)
    for target in scripts.values():  # each console script's module is a command module or inside one
        module = target.split(":")[0]
        assert any(module == m or module.startswith(m + ".") for m in launch.COMMAND_MODULES), module


def test_sigint_is_held_back_even_when_another_thread_takes_it():
    """A SIGINT inside sigint_deferred() (a token traced and counted together) is delivered
    after it, whichever thread of the process the kernel hands it to: MLX's stream, the BLAS
    and the C kernels' workers run with it unblocked, and Python raises KeyboardInterrupt in
    the main thread wherever that thread is."""
    import threading

    from gearbx_mlx.telemetry.trace import sigint_deferred

    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()
    inside = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with sigint_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(50):  # instruction boundaries, where a pending handler would run
                    time.sleep(0.001)
                inside.append("done")
    finally:
        stop.set()
        helper.join()
    assert inside == ["done"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
