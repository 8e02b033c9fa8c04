"""``python -m gearbx_mlx.generate`` end to end on the default model."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from gearbx_mlx.chat import apply_chat_template
from gearbx_mlx.telemetry.trace import read_trace

PROMPT = "List three colours of the rainbow."


def cli(*args: str, stdin: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gearbx_mlx.generate", *args],
        capture_output=True, text=True, input=stdin, timeout=timeout,
    )


@pytest.mark.slow
def test_cli_streams_summarises_and_writes_a_valid_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    p = cli("--prompt", PROMPT, "--max-tokens", "12", "--thresholds", "2.0", "4.0", "--trace", str(trace))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
    for key in ("Prompt:", "Generation:", "Peak memory:", "Gears:", "Entropy:", "Time quantizing:"):
        assert key in p.stderr
    t = read_trace(trace)
    assert t.header["vocab_size"] == 49152 and t.header["thresholds"]["source"] == "manual"
    assert len(t.tokens) == t.summary["generation_tokens"] > 0
    assert [r["index"] for r in t.tokens] == list(range(len(t.tokens)))
    vmax = math.log2(49152)
    assert all(0 <= r["entropy"] <= vmax for r in t.tokens)
    gears = [r["gear"] for r in t.tokens]
    assert set(gears) <= {"low", "mid", "high"}
    flags = [r["shift"] for r in t.tokens]
    assert flags == [False] + [a != b for a, b in zip(gears, gears[1:])]
    counts = {g: gears.count(g) for g in ("low", "mid", "high")}
    assert t.summary["tokens_per_gear"] == counts
    assert "".join(r["text"] for r in t.tokens).strip() in p.stdout


@pytest.mark.slow
def test_static_high_matches_plain_mlx_lm(default_model):
    from mlx_lm import generate as mlx_generate

    model, tok, _ = default_model
    prompt = apply_chat_template(tok, PROMPT)
    want = mlx_generate(model, tok, prompt, max_tokens=10)
    p = cli("--prompt", PROMPT, "--max-tokens", "10", "--static-gear", "high", "--quiet")
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == want


#: Bad command lines and the one error line each gets.
BAD_INPUT = [
    (("--no-such-flag",), "unrecognized arguments"),
    (("--model", "/nonexistent/model", "--prompt", "hi"), "model path not found"),
    (("--prompt", "hi", "--trace", "/nonexistent/dir/t.jsonl"), "directory /nonexistent/dir does not exist"),
    (("--prompt", "hi", "--trace", "/proc/t.jsonl"), "--trace /proc/t.jsonl: cannot write in /proc"),
    (("--prompt", "hi", "--thresholds", "3", "1"), "wrong order"),
    (("--prompt", "hi", "--thresholds", "-1", "2"), "--thresholds are entropies in bits, >= 0"),
    (("--prompt", "hi", "--trace", ""), "--trace needs a file name"),
    (("--prompt", "hi", "--trace", "/dev/null"), "--trace /dev/null is not a regular file"),
    (("--prompt", "   "), "prompt is empty"),
    (("--prompt", "hi", "--calibration", "/nonexistent/cal.json"), "calibration file not found"),
    (("--prompt", "hi", "--max-kv-size", "8", "--kv-bits", "4"), "cannot be combined with --kv-bits"),
    (("--prompt", "hi", "--speculative", "--static-gear", "low"), "its output is the high gear's"),
    (("--prompt", "hi", "--speculative", "--telemetry-only"), "telemetry-only swaps nothing"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_gives_one_clear_error(args, message, capsys):
    """Each case through the command's ``main``, which ``python -m gearbx_mlx.generate`` runs (a
    process each cost 1.3-2.6 s of imports): a failing status and one error line, no traceback."""
    from gearbx_mlx.generate import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own error exit
        code = e.code
    assert code not in (0, None)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, message", BAD_INPUT[:2], ids=["argparse", "after-the-flags"])
def test_bad_input_gives_one_clear_error_from_the_process(args, message):
    """The command as a process: argparse's exit and an error raised once the flags were read
    each end it with a failing status and the error line, no traceback."""
    p = cli(*args, timeout=120)
    assert p.returncode != 0
    assert message in p.stderr
    assert "Traceback" not in p.stderr


def test_prompt_from_stdin_empty():
    p = cli("--prompt", "-", stdin="", timeout=120)
    assert p.returncode != 0 and "prompt is empty" in p.stderr


def test_the_library_generate_survives_importing_the_command_module():
    """``import gearbx_mlx.generate`` binds the package's ``generate`` to the command's module
    (Python does so for every submodule): calling it still runs the library function."""
    import importlib

    from conftest import make_tiny_llama, make_tiny_tokenizer

    import gearbx_mlx
    from gearbx_mlx.pipeline import generate as library_generate

    importlib.import_module("gearbx_mlx.generate")
    model, tok = make_tiny_llama(), make_tiny_tokenizer()
    prompt = "t5 t6 t7"
    want = library_generate(model, tok, prompt, max_tokens=5)
    assert gearbx_mlx.generate(model, tok, prompt, max_tokens=5) == want and want


@pytest.mark.slow
def test_the_command_takes_the_loaded_model_out_of_the_collectors_scans(monkeypatch):
    """Once the model is loaded and before the prompt's first forward pass, the command
    freezes what is alive: a full collection would otherwise walk the model's Python objects
    again, wherever the collector happens to start one (in the prompt's time, say)."""
    import gc
    import importlib

    command = importlib.import_module("gearbx_mlx.generate")
    seen = {}

    def run_loaded(args, model, tokenizer, gearbox, templated, writer=None):
        seen["frozen"] = gc.get_freeze_count()
        return 0

    monkeypatch.setattr(command, "run_loaded", run_loaded)
    gc.unfreeze()
    try:
        assert command.run(command.build_parser().parse_args(["--prompt", PROMPT, "--max-tokens", "1"])) == 0
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 10_000  # the model's modules, the tokenizer, the gearbox


def test_quiet_prints_the_text_only_with_speculative_decoding_too():
    """``--quiet``: no progress lines (the drafter's timing and decision were printed anyway)."""
    # a block cap of 1: the decision still times the gears (and would say so), on 3 calls a round, not 6
    p = cli("--prompt", "hi", "--max-tokens", "3", "--speculative", "--max-draft", "1", "--quiet", timeout=300)
    assert p.returncode == 0, p.stderr
    notes = [line for line in p.stderr.splitlines() if line.startswith("[gearbx]") and "warning" not in line]
    assert not notes, p.stderr
    assert p.stdout.strip()


def test_a_prompt_that_can_run_past_the_models_context_is_warned_of(tmp_path):
    """mlx-lm runs positions past ``max_position_embeddings`` without a word (the server refuses
    them); the command says so once, before the text, and still generates."""
    import json

    from fault_models import tiny_model_folder

    from gearbx_mlx.generation import past_context

    folder = tiny_model_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_position_embeddings"] = 12
    (folder / "config.json").write_text(json.dumps(cfg))
    p = cli("--model", str(folder), "--prompt", "t2 t3 t4", "--max-tokens", "16", "--ignore-chat-template")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("can run past the model's context of 12 tokens") == 1, p.stderr
    assert p.stderr.index("context of 12") < p.stderr.index("==========")
    fits = cli("--model", str(folder), "--prompt", "t2 t3 t4", "--max-tokens", "4", "--ignore-chat-template")
    assert fits.returncode == 0 and "context of" not in fits.stderr, fits.stderr

    class Args:
        max_position_embeddings = 100

    class Model:
        args = Args()

    assert past_context(Model(), 90, 10) is None
    assert "and up to 11 new tokens can run past" in past_context(Model(), 90, 11)
    assert "and new tokens without a limit can run past" in past_context(Model(), 90, -1)
    assert "fills the model's context of 100" in past_context(Model(), 100, 1)
    assert past_context(object(), 10**6, -1) is None  # no context in the config: nothing said


@pytest.mark.parametrize("errno_name", ["EPIPE", "ENOSPC"])
def test_stdout_failing_mid_stream_leaves_a_valid_trace_of_what_was_generated(monkeypatch, tmp_path, errno_name):
    """A closed pipe (``| head``) or a full disk on stdout ends the run with its error, and the
    trace's summary counts the tokens streamed before it (it said 0, so ``analyze`` refused it)."""
    import errno
    import io

    from conftest import make_tiny_llama, make_tiny_tokenizer

    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.generate import build_parser, run_loaded

    class FailingOut(io.StringIO):
        def write(self, s):
            if self.getvalue().count("t") >= 3 and s:  # three tokens' text, then the fault
                raise OSError(getattr(errno, errno_name), "injected")
            return super().write(s)

    model, tok = make_tiny_llama(), make_tiny_tokenizer()
    trace = tmp_path / "t.jsonl"
    args = build_parser().parse_args(["--max-tokens", "12", "--trace", str(trace), "--quiet"])
    monkeypatch.setattr(sys, "stdout", FailingOut())
    with pytest.raises(OSError, match="injected"):
        run_loaded(args, model, tok, Gearbox(model), "t5 t6 t7")
    t = read_trace(trace)
    assert len(t.tokens) >= 3 and t.summary["generation_tokens"] == len(t.tokens)
    assert "injected" in t.summary["error"]


def test_the_trace_never_replaces_an_input_or_a_file_that_is_not_a_trace(tmp_path, capsys):
    """``--trace`` naming the ``--calibration`` file, or an existing file that is no trace, is one
    error before anything runs, the file untouched; an earlier trace may be replaced."""
    from gearbx_mlx.generate import build_parser, check_not_overwritten, main

    cal, notes, old = tmp_path / "c.json", tmp_path / "notes.txt", tmp_path / "old.jsonl"
    cal.write_text('{"kept": true}')
    notes.write_text("my notes\n")
    old.write_text('{"type": "header", "format": "gearbx-trace", "version": 1}\n')
    for argv, words in ((["--calibration", str(cal), "--trace", str(cal)], "name the same file"),
                        (["--trace", str(notes)], "is not a gearbx trace")):
        before = {p: p.read_text() for p in (cal, notes)}
        assert main(["--prompt", "hi", *argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
        assert {p: p.read_text() for p in (cal, notes)} == before
    check_not_overwritten(build_parser().parse_args(["--trace", str(old)]))  # no error
