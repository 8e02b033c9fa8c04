"""``python -m gearbx_mlx.generate`` end to end on the default model."""

from __future__ import annotations

import json
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
    p = cli("--prompt", PROMPT, "--max-tokens", "24", "--thresholds", "2.0", "4.0", "--trace", str(trace))
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
    want = mlx_generate(model, tok, prompt, max_tokens=20)
    p = cli("--prompt", PROMPT, "--max-tokens", "20", "--static-gear", "high", "--quiet")
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == want


@pytest.mark.slow
def test_telemetry_only_on_a_prequantized_model(tmp_path, default_model):
    import mlx.nn as nn
    from mlx_lm.utils import save_config, save_model

    from gearbx_mlx.sources.models import default_model_path

    src = default_model_path()
    model, tok, _ = default_model
    from mlx_lm import load as mlx_load

    qmodel, _ = mlx_load(str(src))
    nn.quantize(qmodel, group_size=64, bits=4)
    out = tmp_path / "q4"
    out.mkdir()
    save_model(out, qmodel)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 4}
    save_config(cfg, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / f).write_text((src / f).read_text())
    trace = tmp_path / "q.jsonl"
    p = cli("--model", str(out), "--prompt", PROMPT, "--max-tokens", "16", "--thresholds", "2.0", "4.0",
            "--trace", str(trace))
    assert p.returncode == 0, p.stderr
    t = read_trace(trace)
    assert t.header["telemetry_only"] is True and t.header["managed_modules"] == 0
    assert t.summary["quantize_seconds"] == 0 and t.summary["telemetry_only"] is True
    assert "telemetry only" in p.stderr
    assert len({r["gear"] for r in t.tokens}) >= 1


@pytest.mark.parametrize(
    "args, message",
    [
        (("--no-such-flag",), "unrecognized arguments"),
        (("--model", "/nonexistent/model", "--prompt", "hi"), "model path not found"),
        (("--prompt", "hi", "--trace", "/nonexistent/dir/t.jsonl"), "trace directory does not exist"),
        (("--prompt", "hi", "--thresholds", "3", "1"), "wrong order"),
        (("--prompt", "   "), "prompt is empty"),
        (("--prompt", "hi", "--calibration", "/nonexistent/cal.json"), "calibration file not found"),
    ],
)
def test_bad_input_gives_one_clear_error(args, message):
    p = cli(*args, timeout=120)
    assert p.returncode != 0
    assert message in p.stderr
    assert "Traceback" not in p.stderr


def test_prompt_from_stdin_empty():
    p = cli("--prompt", "-", stdin="", timeout=120)
    assert p.returncode != 0 and "prompt is empty" in p.stderr
