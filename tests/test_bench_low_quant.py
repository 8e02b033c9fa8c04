"""``scripts/bench_low_quant.py``'s paired comparison of the speculative runs (each quantizer's drafts
against round-to-nearest's on the same prompts): counts, the sign test, the bootstrap interval."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_low_quant.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_low_quant")


def _run(name, pairs, tokens=None):
    prompts = [{"accepted": a, "drafted": d, "acceptance_rate": a / d, "tokens": tokens or [i]}
               for i, (a, d) in enumerate(pairs)]
    return {"quantizer": name, "rep": 0, "prompts": prompts}


def test_counts_sign_test_and_aggregate(bench):
    rtn = _run("rtn", [(5, 10), (6, 10), (7, 10), (8, 10)])
    gptq = _run("gptq", [(7, 10), (8, 10), (9, 10), (6, 10)])
    out = bench._paired([rtn, gptq], resamples=2000)["gptq"]
    assert (out["higher"], out["lower"], out["equal"]) == (3, 1, 0)
    assert out["sign_test_p"] == pytest.approx(2 * (math.comb(4, 0) + math.comb(4, 1)) / 16)
    assert out["acceptance_difference"] == pytest.approx(30 / 40 - 26 / 40)
    low, high = out["bootstrap_95"]
    assert low <= out["acceptance_difference"] <= high and low < high
    assert out["same_tokens"] == 4


def test_identical_runs_give_no_difference(bench):
    rtn = _run("rtn", [(5, 10), (6, 9), (7, 12)])
    out = bench._paired([rtn, {**_run("gptq", [(5, 10), (6, 9), (7, 12)]), "quantizer": "gptq"}])["gptq"]
    assert (out["higher"], out["lower"], out["equal"]) == (0, 0, 3)
    assert out["sign_test_p"] == 1.0 and out["bootstrap_95"] == [0.0, 0.0]


def test_a_lone_quantizer_or_other_prompts_are_not_compared(bench):
    assert bench._paired([_run("gptq", [(5, 10)])]) == {}
    assert bench._paired([_run("rtn", [(5, 10)]), _run("gptq", [(5, 10), (6, 10)])]) == {}


def test_paired_flag_adds_the_comparison_to_an_earlier_file(tmp_path):
    path = tmp_path / "result.json"
    runs = [_run("rtn", [(4, 10), (5, 10)]), _run("gptq", [(6, 10), (7, 10)])]
    path.write_text(json.dumps({"speculative": {"runs": runs}}))
    subprocess.run([sys.executable, str(SCRIPT), "--paired", str(path)], check=True, capture_output=True,
                   timeout=120)
    out = json.loads(path.read_text())["speculative"]["paired_vs_rtn"]["gptq"]
    assert out["higher"] == 2 and out["bootstrap_95"][0] > 0
