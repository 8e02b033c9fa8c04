"""What the generation summary tells a user: the bytes the gears manage,
one-time quantization kept apart from tokens/s, and telemetry-only runs
reported as such (tiny models, no download)."""

from __future__ import annotations

import importlib
import time

import mlx.nn as nn
import pytest
from conftest import make_tiny_llama, make_tiny_tokenizer
from switch_policy import SwitchAt

import gearbx_mlx
from gearbx_mlx import run_summary
from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.gearbox import Gearbox
from gearbx_mlx.precision import nbytes

cli = importlib.import_module("gearbx_mlx.generate")  # the module, not the package's generate()

PROMPT = "t5 t6 t7"
#: A "large vocabulary" in miniature: the tied 8192 x 64 embedding is most of each step.
BIG_VOCAB, HIDDEN = 8192, 64


def summarise(model, gearbox, n=8, policy=None, vocab=BIG_VOCAB):
    tok = make_tiny_tokenizer(vocab)
    out = list(gearbx_mlx.stream_generate(model, tok, PROMPT, gearbox, policy=policy, max_tokens=n))
    return out[-1].run.summary(out[-1])


def test_summary_shows_the_managed_share_and_when_the_scope_leaves_little():
    model = make_tiny_llama(vocab=BIG_VOCAB, hidden=HIDDEN)
    gb = Gearbox(model, GearboxConfig(scope="attention", static_gear="low", store="separate"))
    s = summarise(model, gb)
    attention = sum(nbytes(m) for m in gb.manager.originals.values())
    total = nbytes(model)  # tied: the whole table is read, as the output projection
    assert s["model_bytes"] == total and s["step_bytes"]["high"] == total
    assert s["managed_share"] == pytest.approx(attention / total)
    low_built = sum(nbytes(m) for m in gb.manager.cache["low"].values())
    assert s["step_bytes"]["low"] == total - attention + low_built
    assert s["managed_share_scope_all"] == pytest.approx(1.0, abs=0.01)  # all but the norms
    text = run_summary.format_summary(s, gb.thresholds)
    assert f"the gears manage {100 * attention / total:.0f}% of the {total / 2**20:.1f} MiB a step of the" in text
    assert "--scope attention" in text and "little to gain from routing: --scope all manages 100%" in text

    gb_all = Gearbox(model, GearboxConfig(scope="all", static_gear="low", store="separate"))
    s_all = summarise(model, gb_all)
    assert s_all["managed_share"] == pytest.approx(s["managed_share_scope_all"])
    assert "little to gain" not in run_summary.format_summary(s_all, gb_all.thresholds)


def test_untied_embedding_counts_one_row_per_step():
    model = make_tiny_llama(vocab=BIG_VOCAB, hidden=HIDDEN, tie=False)
    gb = Gearbox(model, GearboxConfig())
    table = nbytes(model.model.embed_tokens)
    assert gb.manager.loaded_read_bytes == nbytes(model) - table + table // BIG_VOCAB


def test_one_time_quantization_is_kept_out_of_the_rate(monkeypatch):
    """A first entry into a gear mid-generation quantizes (here made slow on
    purpose); the summary gives the rate with and without that time."""
    from gearbx_mlx import precision

    slow = 0.4

    def slow_quantizer(module, bits, group_size):
        time.sleep(slow / 8)  # 8 attention projections in the tiny model
        return precision.mlx_quantizer(module, bits, group_size)

    model = make_tiny_llama(vocab=512, hidden=HIDDEN)
    gb = Gearbox(model, GearboxConfig(kernel="mlx", store="separate"))  # the store that quantizes at first entry
    monkeypatch.setattr(gb.manager, "_quantizer", slow_quantizer)
    s = summarise(model, gb, n=10, policy=SwitchAt(3), vocab=512)
    assert s["tokens_per_gear"]["low"] > 0
    assert s["generation_quantize_seconds"] == pytest.approx(gb.manager.quantize_seconds["low"])
    assert s["generation_quantize_seconds"] >= slow and s["prompt_quantize_seconds"] == 0
    elapsed = s["generation_tokens"] / s["generation_tps"]
    assert s["generation_tps_excluding_quantize"] == pytest.approx(
        s["generation_tokens"] / (elapsed - s["generation_quantize_seconds"]))
    line = next(x for x in run_summary.format_summary(s, gb.thresholds).splitlines() if x.startswith("Generation:"))
    assert f"without {s['generation_quantize_seconds']:.2f} s of one-time quantization" in line


def prequantized_tiny():
    model = make_tiny_llama(vocab=512, hidden=HIDDEN)
    nn.quantize(model, group_size=64, bits=4)
    return model


def test_telemetry_only_reports_the_real_resident_bytes_and_no_swaps():
    model = prequantized_tiny()
    gb = Gearbox(model, GearboxConfig())
    assert gb.manager.telemetry_only and "already quantized" in gb.manager.telemetry_reason
    s = summarise(model, gb, n=10, policy=SwitchAt(2), vocab=512)
    assert s["tokens_per_gear"]["low"] > 0  # gears tracked ...
    assert all(e["entries"] == 0 for e in s["entries"].values())  # ... nothing swapped, no 0 ms swaps
    text = run_summary.format_summary(s, gb.thresholds)
    assert f"Model weights resident: {nbytes(model) / 2**20:.1f} MiB (telemetry only: the model is already" in text
    assert "Shift cost" not in text and "Time quantizing" not in text and "high 0.0 MiB" not in text
    assert "Resolved:" not in text  # no store, kernel or scope ran


def test_one_generated_token_gets_no_rate():
    """mlx-lm's generation rate starts at the first token, which comes with the prompt: one token
    gave thousands of tokens per second."""
    model = make_tiny_llama(vocab=512)
    gb = Gearbox(model, GearboxConfig())
    s = summarise(model, gb, n=1, policy=SwitchAt(2), vocab=512)
    line = next(x for x in run_summary.format_summary(s, gb.thresholds).splitlines() if x.startswith("Generation:"))
    assert line == "Generation: 1 tokens, too few tokens to time (the first one is timed with the prompt)"


def run_cli(monkeypatch, capsys, model, *argv):
    """``gearbx_mlx.generate.main`` on a tiny model (``load`` patched)."""
    tok = make_tiny_tokenizer(512)

    def fake_load(path, config, dtype=None, draft_scope=None, draft_gear=None):
        return model, tok, Gearbox(model, config, draft_scope=draft_scope, draft_gear=draft_gear)

    monkeypatch.setattr(cli, "load", fake_load)
    code = cli.main(["--prompt", PROMPT, "--max-tokens", "6", "--ignore-chat-template", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out


def test_cli_says_at_start_that_the_run_is_telemetry_only(monkeypatch, capsys):
    out = run_cli(monkeypatch, capsys, prequantized_tiny())
    head, _, tail = out.err.partition("=" * 10)
    assert "telemetry only: the model is already quantized" in head  # before any text streams
    assert "Model weights resident" in tail and "(telemetry only" in tail


@pytest.mark.parametrize("argv, coloured", [(["--color"], False), (["--color", "auto"], False),
                                            (["--color", "always"], True), ([], False)])
def test_color_writes_escape_codes_only_to_a_terminal_unless_asked(monkeypatch, capsys, argv, coloured):
    out = run_cli(monkeypatch, capsys, make_tiny_llama(vocab=512, hidden=HIDDEN), *argv)
    assert ("\033[" in out.out) is coloured  # captured stdout is not a terminal
    assert ("Colours:" in out.err) is coloured


def test_color_auto_colours_a_terminal(monkeypatch):
    import io

    from gearbx_mlx.console import use_color

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color("auto", Tty()) and not use_color("auto", io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color("auto", Tty()) and use_color("always", io.StringIO())


def test_scope_all_share_is_the_same_whatever_the_high_gear_reads():
    """With the high gear reading the planes, the loaded modules are replaced by plane views;
    the share ``--scope all`` would manage is taken before that, so it does not shrink."""
    shares = []
    for high in ("original", "planes"):
        model = make_tiny_llama(vocab=BIG_VOCAB, hidden=HIDDEN)
        gb = Gearbox(model, GearboxConfig(scope="attention", static_gear="low", store="nested", high=high))
        shares.append(summarise(model, gb)["managed_share_scope_all"])
    assert shares[0] == shares[1] and shares[0] > 0.99
