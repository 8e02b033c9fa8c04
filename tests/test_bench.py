"""``python -m gearbx_mlx.bench``: one run on tiny models (seconds), its JSON, ``--compare``.

The numbers of a tiny model mean nothing; these tests check that every
section runs through the package's own functions, that the JSON holds what
docs/BENCHMARKS.md promises and round-trips through ``--compare``, and that
bad input fails with one clear message. One slow test runs ``--quick`` on
the real default model within the time the README promises.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from fault_models import tiny_model_folder

from gearbx_mlx import bench
from gearbx_mlx.evaluation import bench as bench_mod, bench_checks, bench_report, bench_subject, machine
from gearbx_mlx.evaluation.bench import AUTO_FLOOR, QUICK, BenchSettings

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("bench_models"))


def run(argv, capsys):
    rc = bench.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


#: The tests of quick_result run in one pytest-xdist worker: its bench run is made once.
ONE_WORKER = pytest.mark.xdist_group("bench-quick-result")


@pytest.fixture(scope="session")  # made once per worker, whatever runs in between
def quick_result(model_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "a.json"
    # --quick runs the packed kernels alone; both kernels here, so that every section runs.
    assert bench.main(["--model", str(model_folder), "--quick", "--kernels", "mlx", "packed", "--quiet",
                       "--out", str(out)]) == 0
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
    # Each verdict is judged against the spread of the plain runs, which the JSON records.
    plain_runs = r["rows"][0]["runs_tokens_per_s"]
    assert r["plain_noise"] == bench_checks.plain_noise(plain_runs) and len(r["plain_noise"]["ratios"]) == len(
        plain_runs) - 1
    for c, row in zip(r["checks"], auto):
        assert c["floor"] == AUTO_FLOOR and c == bench_checks.auto_check(row, r["plain_noise"])
        assert (c["verdict"] == bench_checks.PLAIN) == (row["choice"] == "plain")
    mem = r["memory"]
    assert set(mem["stores"]) == {"mlx", "packed", "nested"} and mem["stores"]["packed"]["resident_total"] > 0
    assert mem["weights_bytes"] == r["model"]["weight_bytes"] > 0 and mem["process_peak_rss_bytes"] > 0
    hw, sw, bw = (r["machine"][k] for k in ("hardware", "software", "bandwidth"))
    assert hw["cpu_count"] >= 1 and sw["mlx"] and bw["read_gb_s"] > 0
    assert sw["blas"]["name"] in ("openblas", "mkl", "flexiblas", "accelerate", "reference", "unknown")
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
        if row.get("policy") == "speculative-auto":  # a decision A did not make, whatever A's was
            row["label"] = row["key"] + (": gated k=4" if row["label"].endswith(": gated k=3") else ": gated k=3")
    b = tmp_path / "b.json"
    b.write_text(json.dumps(other))
    rc, out, _ = run(["--compare", str(path), str(b)], capsys)
    assert rc == 0
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert lines["plain decoding (mlx-lm)"].split()[-1] == "2.00"
    assert "only in B" in out and "a tok/s" in out and "b/a" in out
    auto = [row for row in r["rows"] if row.get("policy") == "speculative-auto"]
    for row in auto:
        b_decision = "gated k=4" if row["label"].endswith(": gated k=3") else "gated k=3"
        line = next(line for line in out.splitlines() if line.startswith(row["key"] + " ("))
        assert f"/ {b_decision})" in line and line.split()[-1] == "2.00"


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


@pytest.mark.parametrize("row, plain, verdict, passed", [
    # The decision was plain decoding: mlx-lm's own loop, not judged against itself.
    ({"choice": "plain", "x_plain": 0.70}, [1.0, 1.01], bench_checks.PLAIN, None),
    # Below the floor, but plain runs of identical code differed by 1.22x and 1 / 0.78x one after another.
    ({"choice": "fixed", "x_plain": 0.81}, [1.0, 1.22, 0.95, 0.741], bench_checks.WITHIN_NOISE, None),
    ({"choice": "gated", "x_plain": 0.93}, [1.0, 0.9, 1.0], bench_checks.WITHIN_NOISE, None),
    # Below the floor by more than identical runs ever differed: a failure.
    ({"choice": "fixed", "x_plain": 0.60}, [1.0, 1.05, 0.98, 1.0], bench_checks.FAILED, False),
    ({"choice": "fixed", "x_plain": 0.97}, [1.0, 1.3, 0.7], bench_checks.OK, True),
    # One plain run: no spread measured, so a shortfall cannot be told from noise.
    ({"choice": "fixed", "x_plain": 0.5}, [1.0], bench_checks.WITHIN_NOISE, None),
])
def test_a_verdict_is_judged_against_the_plain_runs_spread(row, plain, verdict, passed):
    noise = bench_checks.plain_noise([10 * x for x in plain])
    check = bench_checks.auto_check({"label": "speculative auto", "paired_x_plain": [row["x_plain"]], **row}, noise)
    assert check["verdict"] == verdict and check["passed"] is passed
    assert bench_checks.describe_check(check).endswith("-> " + verdict)


def test_the_table_prints_each_verdict_and_old_files_still_read(quick_result):
    _, r = quick_result
    r = json.loads(json.dumps(r))
    auto = next(row for row in r["rows"] if row.get("policy") == "speculative-auto")
    r["plain_noise"] = bench_checks.plain_noise([10.0, 12.2, 10.0])
    r["checks"] = [bench_checks.auto_check({**auto, "choice": "fixed", "x_plain": 0.81}, r["plain_noise"]),
                   bench_checks.auto_check({**auto, "choice": "plain", "x_plain": 0.70}, r["plain_noise"])]
    text = bench_report.format_result(r)
    assert "0.81 (plain vs plain: 0.82-1.22x) -> within noise" in text
    assert "0.70 (plain vs plain: 0.82-1.22x) -> n/a: decoded plainly" in text and "FAILED" not in text
    # A file of the first format: checks with "passed" only.
    r["format_version"] = 1
    r["checks"] = [{"name": "x", "value": 0.5, "floor": 0.95, "passed": False}]
    del r["plain_noise"]
    bench_report.check_result(r)
    assert "x: 0.50 -> FAILED" in bench_report.format_result(r)


def test_the_json_names_the_blas_in_use():
    assert machine.blas_kind("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so") == "openblas"
    assert machine.blas_kind("/venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0") == "reference"
    assert machine.blas_kind("/opt/intel/lib/libmkl_rt.so.2") == "mkl" and machine.blas_kind(None) == "unknown"
    assert not machine.BLAS_FILES.search("/venv/numpy.libs/libscipy_openblas64_-ff651d7f.so")  # numpy's own
    info = machine.blas()
    assert info["name"] in ("openblas", "mkl", "flexiblas", "accelerate", "reference", "unknown")
    assert machine.software()["blas"]["name"] == info["name"]


@pytest.mark.skipif(not (Path("/proc/self/maps").exists() and Path(OPENBLAS).exists()),
                    reason="needs Linux and Debian's OpenBLAS")
def test_a_preloaded_openblas_is_told_from_the_bundled_reference_blas():
    code = ("import mlx.core as mx; from gearbx_mlx.evaluation import machine; "
            "mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8))); print(machine.blas()['name'])")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    names = [subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                            check=True).stdout.strip() for extra in ({}, {"LD_PRELOAD": OPENBLAS})]
    assert names[1] == "openblas" and names[0] != "openblas", names


@pytest.mark.parametrize("argv, message", [
    (["--budget", "nan"], "--budget must be a finite number"),
    (["--budget", "inf"], "--budget must be a finite number"),
    (["--max-draft", "0"], "--max-draft must be from 1 to 64"),
    (["--max-draft", str(10**20)], "--max-draft must be from 1 to 64"),
    (["--ks", "4", "65"], "--ks must be block lengths from 1 to 64"),
    (["--out", "."], "is a directory"),
    (["--tokens", str(10**20)], "--tokens must be from 4 to 1,000,000"),
    (["--rounds", str(10**20)], "--rounds must be from 1 to 1,000"),
    (["--budget", "30", "--no-budget"], "give --budget or --no-budget, not both"),  # --budget was ignored
])
def test_every_flag_is_checked_before_anything_slow(argv, message, capsys, monkeypatch):
    def slow(*_a, **_k):
        raise AssertionError("the model loaded before the flags were checked")

    monkeypatch.setattr(bench, "load_subject", slow)
    monkeypatch.setattr(bench, "run_bench", slow)
    rc, _, err = run(["--quick", "--quiet"] + argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("edit, field", [
    (lambda r: r["rows"][1].update(tokens_per_s=None), '"rows[1].tokens_per_s" is null'),
    (lambda r: r["rows"][0].update(x_plain="1.0"), '"rows[0].x_plain" is a string'),
    (lambda r: r.update(speculative=[1, 2]), '"speculative" is a list'),
    (lambda r: r.update(checks={}), '"checks" is an object'),
    (lambda r: r["speculative"]["costs"].update(v=None), '"speculative.costs"'),
    (lambda r: r["rows"][1].update(tokens_per_s=-3.0), '"rows[1].tokens_per_s" is -3.0, not a number above 0'),
    (lambda r: r["rows"][2].update(x_plain=0), '"rows[2].x_plain" is 0'),
    (lambda r: r.update(plain_tokens_per_s=float("nan")), '"plain_tokens_per_s" is nan'),
    (lambda r: r["machine"].update(hardware="an H100"), '"machine.hardware" is a string'),
    (lambda r: r["machine"].update(bandwidth={"read_gb_s": "fast"}), '"machine.bandwidth.read_gb_s" is a string'),
    (lambda r: r["machine"]["hardware"].update(nvidia=["H100"]), '"machine.hardware.nvidia"'),
])
def test_compare_names_the_file_and_the_field_of_a_damaged_result(quick_result, tmp_path, capsys, edit, field):
    damaged = json.loads(quick_result[0].read_text())
    edit(damaged)
    bad = tmp_path / "damaged.json"
    bad.write_text(json.dumps(damaged))
    rc, _, err = run(["--compare", str(quick_result[0]), str(bad)], capsys)
    assert rc == 2 and err.count("\n") == 1 and str(bad) in err and field in err, err


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

    until = bench_subject._until
    assert until(stream(1.0, 40), cap=5.0) == bench_mod.MIN_RUN_TOKENS  # 8 s > 5 s, but 8 tokens
    assert until(stream(0.1, 400), cap=5.0) == 51  # past 5 s after 51 tokens
    assert until(stream(0.1, 30), cap=5.0) == 30 and until(stream(9.0, 30), None) == 30
    now[0] = 100.0
    clock = bench_mod.Clock(100.0, 120.0, runs=10)
    assert clock.cap() == pytest.approx(12.0)
    now[0] = 210.0  # 10 s left for 9 runs: each gets the floor
    assert clock.cap() == bench_mod.MIN_RUN_SECONDS and bench_mod.Clock(0.0, None, 3).cap() is None


def test_warm_up_runs_every_row_once_untimed_before_the_rounds(tmp_path, capsys, monkeypatch):
    """With --warmup every row (the automatic ones too) decodes WARMUP_TOKENS tokens before the first
    timed run, and those runs are in no row's numbers; without it, none. The default asks the device."""
    calls = []
    real = bench_mod.run_speculative

    def spy(subject, gearbox, draft, config, n, plan=None, cap=None):
        calls.append(n)
        return real(subject, gearbox, draft, config, n, plan=plan, cap=cap)

    monkeypatch.setattr(bench_mod, "run_speculative", spy)
    out = tmp_path / "warm.json"
    base = ["--shape", "tiny", "--quick", "--kernels", "packed", "--no-nested", "--no-budget", "--out", str(out)]
    rc, text, err = run(base + ["--warmup"], capsys)
    r = json.loads(out.read_text())
    spec_rows = [row for row in r["rows"] if row["section"] == "speculative"]
    assert rc == 0 and r["warmup"]["tokens"] == bench_mod.WARMUP_TOKENS
    assert r["warmup"]["rows"] == len(r["rows"]) and "[warm-up 1/" in err
    assert "untimed" in text.splitlines()[1]  # the header says so
    # the first len(spec_rows) speculative runs are the warm-ups, of WARMUP_TOKENS tokens each
    assert calls[:len(spec_rows)] == [bench_mod.WARMUP_TOKENS] * len(spec_rows)
    assert all(n == QUICK.tokens for n in calls[len(spec_rows):])
    assert all(row["decode_tokens"] == QUICK.tokens for row in r["rows"])  # the warm-ups counted nowhere
    calls.clear()
    cold = tmp_path / "cold.json"
    rc, text, _ = run(base[:-1] + [str(cold), "--no-warmup"], capsys)
    assert rc == 0 and json.loads(cold.read_text())["warmup"] is None and bench_mod.WARMUP_TOKENS not in calls
    assert "untimed" not in text
    rc, text, _ = run(["--compare", str(cold), str(out)], capsys)  # the side by side says which one warmed up
    assert rc == 0 and ["untimed" in line for line in text.splitlines()[:2]] == [False, True]
    assert not BenchSettings().warms_up()  # the CPU here
    assert BenchSettings(warmup=True).warms_up() and not BenchSettings(warmup=False).warms_up()


def test_a_spent_budget_skips_the_later_rounds_not_the_decision(tmp_path, capsys):
    out = tmp_path / "short.json"
    rc, _, err = run(["--shape", "tiny", "--quick", "--rounds", "3", "--budget", "0.5", "--kernels", "packed",
                      "--no-nested", "--out", str(out)], capsys)
    r = json.loads(out.read_text())
    assert rc == 0 and r["rounds_run"] == 1 and "leaves no room for repeat" in err
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
        assert c["value"] > 0 and c["verdict"] in (bench_checks.OK, bench_checks.WITHIN_NOISE, bench_checks.FAILED,
                                                   bench_checks.PLAIN), c


@ONE_WORKER
def test_a_run_with_one_plain_run_says_its_ratios_are_not_told_from_noise(quick_result):
    _, r = quick_result
    once = {**r, "plain_noise": {"ratios": [], "low": None, "high": None}}
    assert "Plain decoding ran once" in bench_report.format_result(once)
    twice = {**r, "plain_noise": {"ratios": [1.1], "low": 1 / 1.1, "high": 1.1}}
    text = bench_report.format_result(twice)
    assert "Plain decoding ran once" not in text and "against itself" in text
