"""``gearbx_mlx.telemetry.analyze`` against a direct computation, on committed example traces."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from gearbx_mlx import analyze
from gearbx_mlx.telemetry import analyze as analyze_lib
from gearbx_mlx.telemetry.trace import TraceError, read_trace

TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "traces"
FLOAT = TRACES / "sky_float32.jsonl"  # the default model, dequantized to float32, telemetry only
Q4 = TRACES / "sky_q4_1.jsonl"  # the same GGUF kept as MLX 4-bit layers (smollm2-135m-q4)
GEARS = ("low", "mid", "high")


def direct(path: Path) -> dict:
    """The numbers analyze should print, computed here from the raw JSON lines."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    toks = [r for r in recs if r["type"] == "token"]
    gears = [t["gear"] for t in toks]
    ent = np.array([t["entropy"] for t in toks])
    out = {"tokens": len(toks), "shifts": sum(a != b for a, b in zip(gears, gears[1:]))}
    for g in GEARS:
        out[f"tokens.{g}"] = gears.count(g)
        runs = [len(list(grp)) for x, grp in itertools.groupby(gears) if x == g]
        out[f"runs.{g}"] = len(runs)
        if runs:
            out[f"mean_run.{g}"] = float(np.mean(runs))
        sel = ent[[x == g for x in gears]]
        if sel.size:
            out[f"entropy.{g}.p50"] = float(np.quantile(sel, 0.5))
            out[f"entropy.{g}.p90"] = float(np.quantile(sel, 0.9))
        steps = [t["step_seconds"] for t in toks[1:] if t["gear"] == g]  # the first token carries the prompt
        if steps:
            out[f"ms_per_token.{g}"] = 1e3 * float(np.mean(steps))
    for q in (10, 25, 50, 75, 90):
        out[f"entropy.p{q}"] = float(np.quantile(ent, q / 100))
    out["entropy.mean"] = float(ent.mean())
    out["ms_per_token"] = 1e3 * float(np.mean([t["step_seconds"] for t in toks[1:]]))
    return out


def parse_table(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        if line.startswith("note:"):
            continue
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


def test_printed_numbers_match_a_direct_computation(capsys):
    assert analyze.main([str(Q4)]) == 0
    rows = parse_table(capsys.readouterr().out)
    want = direct(Q4)
    assert want["tokens"] == 64 and want["shifts"] > 0
    for name, value in want.items():
        printed = rows[name][0]
        expect = str(value) if isinstance(value, int) else f"{value:.4f}"
        assert printed == expect, name


def test_side_by_side_and_entropy_shift(capsys):
    assert analyze.main([str(FLOAT), str(Q4)]) == 0
    rows = parse_table(capsys.readouterr().out)
    assert rows["metric"] == ["sky_float32", "sky_q4_1"]
    for name, value in direct(FLOAT).items():
        assert rows[name][0] == (str(value) if isinstance(value, int) else f"{value:.4f}"), name
    a = [t["entropy"] for t in read_trace(FLOAT).tokens]
    b = [t["entropy"] for t in read_trace(Q4).tokens]
    # Same GGUF values, so the same greedy text: the whole trace is the common prefix.
    assert rows["vs_first.common_prefix"] == ["-", "64"]
    assert rows["vs_first.entropy_absdiff_mean"][1] == f"{np.mean(np.abs(np.subtract(b, a))):.4f}"


def test_csv_has_the_same_numbers(tmp_path):
    out = tmp_path / "a.csv"
    assert analyze.main([str(FLOAT), str(Q4), "--csv", str(out)]) == 0
    with open(out, newline="") as f:
        rows = {r[0]: r[1:] for r in csv.reader(f)}
    assert rows["metric"] == ["sky_float32", "sky_q4_1"]
    for col, path in enumerate((FLOAT, Q4)):
        for name, value in direct(path).items():
            assert float(rows[name][col]) == pytest.approx(value, rel=1e-12, abs=1e-12), name


def test_remote_style_trace_is_read(tmp_path, capsys):
    """A remote trace: lower-bound entropy, variants, two prompts (two generation starts)."""
    lines = [json.loads(line) for line in Q4.read_text().splitlines()]
    lines[0].update(source="remote", entropy_is_lower_bound=True, top_k=10)
    toks = [r for r in lines if r["type"] == "token"]
    for i, t in enumerate(toks):
        t.update(prompt=int(i >= 32), variant="high", entropy_upper=t["entropy"] + 1)
    path = tmp_path / "remote.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    r = analyze_lib.analyze_trace(path)
    steps = [t["step_seconds"] for i, t in enumerate(toks) if i not in (0, 32)]
    assert r["ms_per_token"] == pytest.approx(1e3 * np.mean(steps))
    assert r["tokens_per_variant"]["high"] == 64
    assert analyze.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "entropy_lower_bound.p50" in out and "lower bound from the top-10" in out


def _edit(line: str, **fields) -> str:
    return json.dumps({**json.loads(line), **fields})


@pytest.mark.parametrize("damage, message", [
    (lambda ls: ls[:-1] + [ls[-1][: len(ls[-1]) // 2]], "truncated"),
    (lambda ls: ls[:3] + ["not json {"] + ls[3:], ":4: not JSON"),
    (lambda ls: [ls[0].replace('"version": 1', '"version": 99')] + ls[1:], ":1: trace version 99"),
    (lambda ls: ls[:2] + ls[3:], ":3: token index 2 where 1 was due"),  # a token record lost
    (lambda ls: ls[:3] + ls[2:], ":4: token index 1 where 2 was due"),  # one repeated
    (lambda ls: ls + ls[-1:], "a second summary"),
    (lambda ls: ls[:-1] + [_edit(ls[-1], generation_tokens=1000)], "the summary counts 1000 generated tokens"),
    (lambda ls: ls[:-1] + [_edit(ls[-1], kv_cache="x")], "field 'kv_cache' must be an object"),
    (lambda ls: [_edit(ls[0], thresholds={"low": "a", "high": 3.0})] + ls[1:], ":1: thresholds.low must be"),
    (lambda ls: ls[:2] + [_edit(ls[2], step_seconds=-1.0)] + ls[3:], ":3: step_seconds must be >= 0"),
])
def test_bad_traces_name_the_line(tmp_path, capsys, damage, message):
    lines = Q4.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(damage(lines)))
    with pytest.raises(TraceError, match=message):
        read_trace(bad)
    assert analyze.main([str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}:") and message in err and "Traceback" not in err


def test_blank_lines_after_the_last_record_are_not_a_truncation(tmp_path):
    """`echo >> trace.jsonl` or an editor leaves blank lines at the end: the trace is whole
    (it was called truncated); a blank line between records is still not JSON."""
    lines = Q4.read_text().splitlines()
    padded = tmp_path / "padded.jsonl"
    padded.write_text("\n".join(lines) + "\n\n  \n")
    got, want = read_trace(padded), read_trace(Q4)
    assert (got.header, got.tokens, got.summary) == (want.header, want.tokens, want.summary)
    inner = tmp_path / "inner.jsonl"
    inner.write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n")
    with pytest.raises(TraceError, match=":4: not JSON"):
        read_trace(inner)


def test_missing_file_and_matplotlib_message(tmp_path, capsys, monkeypatch):
    assert analyze.main([str(tmp_path / "none.jsonl")]) == 1
    assert "trace not found" in capsys.readouterr().err
    assert analyze.main([str(tmp_path)]) == 1
    assert f"error: {tmp_path} is a directory: give a trace file" in capsys.readouterr().err
    assert analyze.main([str(Q4), "--csv", str(tmp_path)]) == 1
    assert f"error: --csv {tmp_path} is a directory: give a file name, e.g." in capsys.readouterr().err
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert analyze.main([str(Q4), "--plots", str(tmp_path)]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("plots, message", [
    ("", "--plots needs a folder name, got an empty one"),  # was ignored: the table, no figure, status 0
    ("/proc/figures", "--plots /proc/figures: cannot create or write the directory"),
    ("FILE", "--plots FILE is a file, not a directory"),
])
def test_a_plots_folder_that_cannot_be_written_is_named_before_the_table(tmp_path, capsys, plots, message):
    """The table was printed first, then a bare ``[Errno ...]`` line without the flag (or nothing at all)."""
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    afile = tmp_path / "file"
    afile.write_text("")
    plots = plots.replace("FILE", str(afile))
    assert analyze.main([str(Q4), "--plots", plots]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and message.replace(
        "FILE", str(afile)) in err, err


def test_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    assert analyze.main([str(FLOAT), str(Q4), "--plots", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert "sky_q4_1_routing.png" in names and "gear_distribution.png" in names
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)


def test_evaluation_report_is_read_per_policy(tmp_path, capsys):
    """``gearbx_mlx.evaluation.harness``'s JSON: one trace per policy, windows as generations."""
    report = {"format": "gearbx-eval", "version": 1, "model": {"vocab_size": 49152},
              "text": {"windows": 2},
              "traces": {"static-high": {"gears": "hhhhhh", "entropy": [1, 2, 3, 1, 2, 3]},
                         "entropy": {"gears": "lmmllh", "entropy": [1.5, 2, 3, 1, 2, 4],
                                     "smoothed": [1.5, 1.75, 2.2, 1, 1.5, 2.3]}}}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(report, indent=2))
    result = analyze_lib.analyze([path])
    a, b = result["traces"]
    assert (a["label"], b["label"]) == ("eval:static-high", "eval:entropy")
    assert b["tokens_per_gear"] == {"low": 3, "mid": 2, "high": 1}
    # "lmm|llh": the window boundary is not a shift, and runs stop there.
    assert b["shifts"] == 2 and b["runs"]["low"] == 2 and b["mean_run"]["low"] == 1.5
    assert result["comparisons"][0]["common_prefix"] == 6  # teacher-forced: the same text
    assert result["comparisons"][0]["entropy_diff_mean"] == pytest.approx(np.mean([0.5, 0, 0, 0, 0, 1]))
    assert analyze.main([str(path)]) == 0 and "eval:entropy" in capsys.readouterr().out


def write_trace(path: Path, gears: str, entropy: list, lag: int = 0, next_gear: bool = False) -> Path:
    names = {"l": "low", "m": "mid", "h": "high"}
    lines = [{"type": "header", "format": "gearbx-trace", "version": 1, "vocab_size": 256, "lag": lag,
              "thresholds": {"low": 1.5, "high": 2.5}}]
    for i, (g, h) in enumerate(zip(gears, entropy)):
        rec = {"type": "token", "index": i, "token": i, "entropy": h, "gear": names[g], "shift": False}
        if next_gear:  # the router's decision, as generation writes it: the gear 1 + lag tokens on
            j = i + 1 + lag
            rec["next_gear"] = names[gears[j]] if j < len(gears) else "high"
        lines.append(rec)
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("field", [True, False])
def test_entropy_per_gear_in_force_and_per_gear_chosen(tmp_path, lag, field):
    """A spike read in the low gear moves the router to high; the high gear then
    sees what follows. Per gear in force the spike counts for low; per gear
    chosen it counts for high. Both are reported, named apart."""
    gears = "hhlllhhh" if lag == 0 else "hhhlllhh"
    entropy = [3.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0]
    r = analyze_lib.analyze_trace(read_trace(write_trace(tmp_path / "t.jsonl", gears, entropy, lag, field)))
    flat = analyze_lib.flat_metrics(r)
    in_force = {g: [h for c, h in zip(gears, entropy) if c == g[0]] for g in GEARS}
    for g in GEARS:
        if in_force[g]:
            assert flat[f"entropy.{g}.mean"] == pytest.approx(np.mean(in_force[g]))
    # The decision after token i governed token i + 1 + lag (the trace's last
    # decisions govern nothing it holds: known from the field only).
    names = {"l": "low", "m": "mid", "h": "high"}
    chosen = [names[gears[i + 1 + lag]] if i + 1 + lag < len(gears) else ("high" if field else None)
              for i in range(len(gears))]
    assert chosen[4] == "high" and gears[4] == "l"  # the second spike: read in low, chose high
    for g in ("low", "high"):
        assert flat[f"entropy.chose_{g}.mean"] == pytest.approx(np.mean([h for c, h in zip(chosen, entropy) if c == g]))
    assert flat["entropy.high.mean"] < flat["entropy.chose_high.mean"]


def test_routing_plot_has_a_key_for_the_gear_colours(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    from matplotlib.colors import to_rgb

    from gearbx_mlx.telemetry.plots import GEAR_COLORS, require_matplotlib, routing_figure

    plt = require_matplotlib()
    trace = read_trace(write_trace(tmp_path / "t.jsonl", "hhlllhhh", [3, 1, 1, 1, 3, 1, 1, 1]))
    fig = routing_figure(plt, trace, "t")
    legend = fig.axes[0].get_legend()
    keys = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}
    assert {"low gear", "high gear"} <= set(keys) and "mid gear" not in keys  # only the gears present
    for g in ("low", "high"):
        assert keys[f"{g} gear"].get_facecolor()[:3] == pytest.approx(to_rgb(GEAR_COLORS[g]))
    plt.close(fig)


def test_a_pipe_given_as_a_trace_is_named_so(tmp_path, capsys):
    import os

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    assert analyze.main([str(fifo)]) == 1
    err = capsys.readouterr().err
    assert "is not a regular file" in err and "not found" not in err and err.count("\n") == 1


def test_a_speculative_traces_gear_changes_are_not_shifts(tmp_path):
    """In speculative decoding both gears stay resident: a token's gear is the pass that chose it
    (the drafter's for an accepted draft), so gear changes swap nothing and count as no shift."""
    path = write_trace(tmp_path / "s.jsonl", "llhlh", [1.0, 1.0, 3.0, 1.0, 3.0])
    lines = path.read_text().splitlines()
    routed = analyze_lib.analyze_trace(read_trace(path))
    header = {**json.loads(lines[0]), "mode": "speculative", "policy": "speculative"}
    path.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    spec = analyze_lib.analyze_trace(read_trace(path))
    assert routed["shifts"] == 3 and spec["shifts"] == 0 and spec["transitions"] == {}
    assert spec["tokens_per_gear"] == routed["tokens_per_gear"] and spec["runs"] == routed["runs"]
