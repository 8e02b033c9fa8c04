"""``scripts/pool_gpu_decode.py``: each round's ratio read from a run, and a verdict that accounts for the spread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script


@pytest.fixture(scope="module")
def pool():
    return load_script("pool_gpu_decode")


def run_file(tmp_path: Path, name: str, rounds: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"decode": [{"variant": k, "rounds_tok_per_s": v} for k, v in rounds.items()]}))
    return path


def test_round_ratios_pair_each_round_with_its_baseline(pool, tmp_path):
    path = run_file(tmp_path, "a.json", {"mlx-8": [100.0, 200.0], "nested-mid-grp-blockc": [90.0, 220.0],
                                          "bf16": [50.0, 50.0]})
    assert pool.round_ratios(path, "mid") == pytest.approx([0.9, 1.1])
    assert pool.round_ratios(path, "low") == []  # no MLX 4-bit rounds: nothing to pair
    assert pool.round_ratios(path, "high") == []  # no nested high gear


def test_a_run_of_several_variants_of_a_gear_pools_the_one_named(pool, tmp_path):
    path = run_file(tmp_path, "a.json", {"bf16": [100.0, 100.0], "nested-high-grp-blockc": [90.0, 95.0],
                                          "nested-high-grp-blockc-b6": [92.0, 99.0]})
    assert pool.round_ratios(path, "high") == []  # two candidates and none named: no rounds
    assert pool.round_ratios(path, "high", "nested-high-grp-blockc-b6") == pytest.approx([0.92, 0.99])
    out = tmp_path / "pooled.json"
    pool.main(["--start", f"A={path}", "--variant", "high=nested-high-grp-blockc", "--out", str(out),
               "--resamples", "200"])
    assert json.loads(out.read_text())["gears"]["high"]["pooled"]["median"] == pytest.approx(0.925)
    with pytest.raises(SystemExit):
        pool.main(["--start", f"A={path}", "--variant", "highest=x", "--out", str(out)])


def test_verdict_needs_the_whole_interval_past_the_target(pool):
    steady = [0.95, 0.96, 0.94, 0.97, 0.95, 0.96, 0.95, 0.94]
    assert pool.judge(steady, 0.9, 1000)["verdict"] == "met"
    assert pool.judge([r - 0.2 for r in steady], 0.9, 1000)["verdict"] == "missed"
    noisy = [0.7, 1.1, 0.8, 1.05, 0.85, 1.0, 0.75, 1.2]  # median above 0.9, spread far wider
    j = pool.judge(noisy, 0.9, 1000)
    assert j["median"] > 0.9 and j["verdict"] == "within noise"
    assert j["interval_95"][0] < 0.9 < j["interval_95"][1] and j["rounds_at_target"] == 4


def test_command_pools_the_starts_and_rejects_a_bad_file(pool, tmp_path, capsys):
    a = run_file(tmp_path, "a.json", {"mlx-4": [100.0] * 4, "nested-low": [104.0, 103.0, 105.0, 104.0]})
    b = run_file(tmp_path, "b.json", {"mlx-4": [100.0] * 3, "nested-low": [102.0, 106.0, 103.0]})
    out = tmp_path / "pooled.json"
    pool.main(["--start", f"A={a}", "--start", f"B={b}", "--out", str(out), "--resamples", "500"])
    record = json.loads(out.read_text())
    assert record["gears"]["low"]["pooled"]["rounds"] == 7
    assert record["gears"]["low"]["pooled"]["verdict"] == "met"
    assert set(record["gears"]["low"]["starts"]) == {"A", "B"} and "pooled" not in record["gears"]["mid"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a bench_nested_gpu.py result"):
        pool.main(["--start", f"A={bad}", "--out", str(out)])
