"""Every JSON the package writes is strict JSON: non-finite numbers become null at any depth."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings, strategies as st

from gearbx_mlx.calibration import Calibration
from gearbx_mlx.evaluation import report
from gearbx_mlx.jsonsafe import clean, dumps
from gearbx_mlx.telemetry.trace import TraceWriter, read_trace


def strict_loads(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as strict readers do."""
    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _expected(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _expected(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_expected(v) for v in x]
    return x


scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5))
nested = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(nested)
def test_dumps_is_strict_json_and_keeps_every_finite_value(obj):
    assert strict_loads(dumps(obj)) == _expected(obj)
    assert clean(obj) == _expected(obj)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(["thresholds", "memory", "entries", "x"]), nested, max_size=4))
def test_trace_header_and_summary_objects_are_strict_json(tmp_path_factory, fields):
    path = tmp_path_factory.mktemp("t") / "t.jsonl"
    with TraceWriter(path) as w:
        w.header(model="m", thresholds={"low": float("nan"), "high": 3.0, "history": [1.0, float("inf")]},
                 extra=fields)
        w.token(index=0, entropy=1.0, gear="low", shift=False)
        w.summary(memory={"peak": float("-inf"), "per_gear": {"low": float("nan")}}, entries=fields)
    lines = [strict_loads(line) for line in path.read_text().rstrip("\n").split("\n")]  # JSON Lines: "\n" only
    assert lines[0]["thresholds"] == {"low": None, "high": 3.0, "history": [1.0, None]}
    assert lines[-1]["memory"] == {"peak": None, "per_gear": {"low": None}}
    assert lines[-1]["entries"] == _expected(fields)
    read_trace(path)


def test_results_and_calibration_files_are_strict_json(tmp_path):
    out = report.write_json({"policies": [{"speed": {"tokens_per_s": float("nan")}}], "x": (float("inf"),)},
                            tmp_path / "r.json")
    assert strict_loads(out.read_text()) == {"policies": [{"speed": {"tokens_per_s": None}}], "x": [None]}
    cal = Calibration(low=1.0, high=2.0, strategy="median", n_samples=3, vocab_size=256,
                      extra={"median_entropy": float("nan"), "per_prompt": [1.0, float("inf")]})
    path = cal.save(tmp_path / "cal.json")
    assert strict_loads(path.read_text())["extra"] == {"median_entropy": None, "per_prompt": [1.0, None]}
    assert Calibration.load(path).extra["per_prompt"] == [1.0, None]
