"""``python -m gearbx_mlx.bench``: one run on tiny models (seconds), its JSON, ``--compare``.

The numbers of a tiny model mean nothing; these tests check that every
section runs through the package's own functions, that the JSON holds what
docs/BENCHMARKS.md promises and round-trips through ``--compare``, and that
bad input fails with one clear message. One slow test runs ``--quick`` on
the real default model within the time the README promises.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
from fault_models import tiny_model_folder

from gearbx_mlx import bench
from gearbx_mlx.evaluation import bench as bench_mod, bench_report, machine
from gearbx_mlx.evaluation.bench import AUTO_FLOOR, QUICK, BenchSettings


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("bench_models"))


def run(argv, capsys):
    rc = bench.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


#: The tests of quick_result run in one pytest-xdist worker: its bench run is made once.
ONE_WORKER = pytest.mark.xdist_group("bench-quick-result")


@pytest.fixture(scope="module")
def quick_result(model_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "a.json"
    assert bench.main(["--model", str(model_folder), "--quick", "--quiet", "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


@ONE_WORKER
def test_quick_run_covers_every_section(quick_result):
    _, r = quick_result
    bench_report.check_result(r)
    labels = [row["label"] for row in r["rows"]]
    assert labels[0] == "plain decoding (mlx-lm)" and r["rows"][0]["x_plain"] == pytest.approx(1.0)
    for want in ("high (gearbox)", "mid, mlx", "low, mlx", "mid, packed", "low, packed", "mid, nested store",
                 "low, nested store", "dynamic, mlx", "dynamic, packed", "dynamic, packed, nested store",
                 "speculative, fixed k=4"):
        assert want in labels, labels
    stores = {row["label"]: row.get("store") for row in r["rows"]}
    assert stores["mid, packed"] == "separate" and stores["low, nested store"] == "nested"
    auto = [row for row in r["rows"] if row.get("policy") == "speculative-auto"]
    assert [row["label"].split(":")[0] for row in auto] == ["speculative auto", "speculative auto, calibrated"]
    assert r["speculative"]["calibration"]["source"] == "continuation"
    pairs = QUICK.rounds + 1
    for row in r["rows"]:
        # plain decoding: at the start and the end of each round, then around each of the decision's pairs
        runs = 2 * QUICK.rounds + pairs + 1 if row["section"] == "plain" else pairs if row in auto else QUICK.rounds
        assert row["tokens_per_s"] > 0 and len(row["runs_tokens_per_s"]) == runs, row["label"]
        assert row["decode_tokens"] >= QUICK.tokens - 1 and len(row["runs_decode_tokens"]) == runs
    for row in auto:  # x plain of an automatic row: the median of its runs over the plain runs beside them
        assert len(row["paired_x_plain"]) == pairs
        assert row["x_plain"] == pytest.approx(statistics.median(row["paired_x_plain"]))
    static = {row["label"]: row for row in r["rows"] if row["section"] == "static"}
    assert static["low, packed"]["gears"]["low"] >= QUICK.tokens and static["mid, mlx"]["gears"]["mid"] >= QUICK.tokens
    assert static["mid, nested store"]["gears"]["high"] == 1  # the prompt's pass in the high gear, then mid
    sp = r["speculative"]
    assert sp["store"] == "nested" and sp["kernel"] == "packed"  # the default store's drafter, as generate's
    assert sp["costs"]["c"] > 0 and len(sp["costs"]["v"]) == QUICK.max_draft + 1 and sp["costs"]["v"][0] == 1.0
    assert len(sp["costs"]["verify_ms"]) == QUICK.max_draft and 0 <= sp["alpha"]["continuation"] <= 1
    assert sp["plans"]["prompt"]["choice"] in ("plain", "fixed", "gated")
    assert [c["value"] for c in r["checks"]] == [row["x_plain"] for row in auto]
    assert all(c["floor"] == AUTO_FLOOR and c["passed"] == (c["value"] >= AUTO_FLOOR) for c in r["checks"])
    mem = r["memory"]
    assert set(mem["stores"]) == {"mlx", "packed", "nested"} and mem["stores"]["packed"]["resident_total"] > 0
    assert mem["weights_bytes"] == r["model"]["weight_bytes"] > 0 and mem["process_peak_rss_bytes"] > 0
    hw, sw, bw = (r["machine"][k] for k in ("hardware", "software", "bandwidth"))
    assert hw["cpu_count"] >= 1 and sw["mlx"] and bw["read_gb_s"] > 0
    assert r["settings"]["tokens"] == QUICK.tokens and r["command"].startswith("python -m gearbx_mlx.bench")
    assert r["rounds_run"] == QUICK.rounds


@ONE_WORKER
def test_the_table_and_compare_read_the_json_back(quick_result, capsys, tmp_path):
    path, r = quick_result
    text = bench_report.format_result(r)
    assert "plain decoding (mlx-lm)" in text and "x plain" in text and "Speculative (" in text
    other = json.loads(path.read_text())
    for row in other["rows"]:
        row["tokens_per_s"] *= 2  # a machine twice as fast
    other["rows"].append({**other["rows"][1], "label": "only in B"})
    for row in other["rows"]:  # B decided otherwise: its automatic rows still face A's
        if row.get("policy") == "speculative-auto":
            row["label"] = row["key"] + ": gated k=3"
    b = tmp_path / "b.json"
    b.write_text(json.dumps(other))
    rc, out, _ = run(["--compare", str(path), str(b)], capsys)
    assert rc == 0
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert lines["plain decoding (mlx-lm)"].split()[-1] == "2.00"
    assert "only in B" in out and "a tok/s" in out and "b/a" in out
    auto = [row for row in r["rows"] if row.get("policy") == "speculative-auto"]
    for row in auto:
        line = next(line for line in out.splitlines() if line.startswith(row["key"] + " ("))
        assert "/ gated k=3)" in line and line.split()[-1] == "2.00"


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    ('{"kind": "other"}', "not a gearbx bench result"),
    ('{"kind": "gearbx-bench", "format_version": 99}', "reads up to"),
    ('{"kind": "gearbx-bench", "format_version": 1, "rows": []}', "lacks"),
])
@ONE_WORKER
def test_compare_refuses_what_is_not_a_bench_result(tmp_path, capsys, quick_result, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    rc, _, err = run(["--compare", str(quick_result[0]), str(bad)], capsys)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_bad_flags_fail_before_loading(tmp_path, capsys):
    rc, _, err = run(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")], capsys)
    assert rc == 2 and "not found" in err
    rc, _, err = run(["--shape", "tiny", "--model", "x", "--quiet"], capsys)
    assert rc == 2 and "not both" in err
    rc, _, err = run(["--shape", "tiny", "--tokens", "1", "--quiet"], capsys)
    assert rc == 2 and "--tokens" in err
    rc, _, err = run(["--shape", "tiny", "--out", str(tmp_path / "no" / "x.json")], capsys)
    assert rc == 2 and "does not exist" in err


def test_flags_override_the_quick_settings():
    args = bench.build_parser().parse_args(["--quick", "--tokens", "8", "--ks", "1", "3", "--no-nested"])
    s = bench.settings_from(args)
    assert s.tokens == 8 and s.ks == (1, 3) and s.rounds == QUICK.rounds and not s.nested
    assert s.budget_s == QUICK.budget_s
    assert bench.settings_from(bench.build_parser().parse_args(["--budget", "30"])).budget_s == 30
    assert bench.settings_from(bench.build_parser().parse_args(["--no-budget"])).budget_s is None
    with pytest.raises(ValueError, match="--budget"):
        bench.settings_from(bench.build_parser().parse_args(["--budget", "0"]))
    assert bench.settings_from(bench.build_parser().parse_args([])) == BenchSettings()


def test_a_run_stops_at_its_share_of_the_budget(monkeypatch):
    """A slow run stops once its share is spent (after MIN_RUN_TOKENS), a fast one decodes every token,
    and the shares spread what is left of the budget over the runs left."""
    now = [0.0]
    monkeypatch.setattr(bench_mod.time, "perf_counter", lambda: now[0])

    def stream(seconds_per_token, n):
        for i in range(n):
            now[0] += seconds_per_token
            yield i + 1

    assert bench_mod._until(stream(1.0, 40), cap=5.0) == bench_mod.MIN_RUN_TOKENS  # 8 s > 5 s, but 8 tokens
    assert bench_mod._until(stream(0.1, 400), cap=5.0) == 51  # past 5 s after 51 tokens
    assert bench_mod._until(stream(0.1, 30), cap=5.0) == 30 and bench_mod._until(stream(9.0, 30), None) == 30
    now[0] = 100.0
    clock = bench_mod.Clock(100.0, 120.0, runs=10)
    assert clock.cap() == pytest.approx(12.0)
    now[0] = 210.0  # 10 s left for 9 runs: each gets the floor
    assert clock.cap() == bench_mod.MIN_RUN_SECONDS and bench_mod.Clock(0.0, None, 3).cap() is None


def test_a_spent_budget_skips_the_later_rounds_not_the_decision(tmp_path, capsys):
    out = tmp_path / "short.json"
    rc, _, err = run(["--shape", "tiny", "--quick", "--rounds", "3", "--budget", "0.5", "--kernels", "packed",
                      "--no-nested", "--out", str(out)], capsys)
    r = json.loads(out.read_text())
    assert rc == 0 and r["rounds_run"] == 1 and "leaves no room for round" in err
    auto = [row for row in r["rows"] if row.get("policy") == "speculative-auto"]
    assert auto and all(len(row["paired_x_plain"]) == 4 for row in auto) and r["checks"]
    assert all(len(row["runs_tokens_per_s"]) == 1 for row in r["rows"] if row["section"] in ("static", "dynamic"))


def test_a_random_weight_shape_runs_without_a_tokenizer(tmp_path, capsys):
    out = tmp_path / "shape.json"
    rc, text, _ = run(["--shape", "tiny", "--quick", "--quiet", "--kernels", "packed", "--out", str(out)], capsys)
    r = json.loads(out.read_text())
    assert rc == 0 and r["model"]["source"] == "random" and "tiny (random weights)" in text
    assert r["model"]["dtype"] == "bfloat16" and "mid, packed" in [row["label"] for row in r["rows"]]
    assert "mid, mlx" not in [row["label"] for row in r["rows"]]


def test_machine_reads_the_os():
    hw = machine.hardware()
    assert hw["cpu_count"] >= 1 and hw["os"]
    assert hw.get("memory_bytes") is None or hw["memory_bytes"] > 2**26
    bw = machine.bandwidth(mib=16, reps=1)
    assert bw["read_gb_s"] > 0 and bw["copy_gb_s"] > 0 and bw["array_mib"] == 16
    lines = machine.describe(hw, machine.software())
    assert lines[0].startswith("Machine:") and any("MLX" in line for line in lines)


@pytest.mark.slow
def test_quick_bench_on_the_default_model(tmp_path):
    """README.md's first-run bench, short, as a command (CI runs it here)."""
    out = tmp_path / "default.json"
    p = subprocess.run([sys.executable, "-m", "gearbx_mlx.bench", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["model"]["vocab_size"] == 49152 and r["checks"]
    # Each verdict is its measured ratio against its floor. Whether it passes
    # depends on the machine's load, so it is reported, never asserted here.
    for c in r["checks"]:
        assert c["value"] > 0 and c["passed"] == (c["value"] >= c["floor"]), c
