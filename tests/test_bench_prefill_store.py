"""``scripts/bench_prefill_store.py``: a balanced run order, and each tree's speeds over the first tree's.

A fixed order (every pair: tree A's separate and nested runs, then tree B's) put
tree B's nested run always last in its pair; fresh processes at a fixed place in
the order were measured faster or slower than the others, which looked like a
difference between the trees. The order now swaps the stores every pair and the
trees every second pair."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from script_module import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_prefill_store")


def fake_args(trees: dict, pairs: int = 4) -> argparse.Namespace:
    return argparse.Namespace(pairs=pairs, trees=trees, clock="wall", blas="openblas", max_tokens=4, model=None,
                              extra=None, timeout=1)


def test_every_tree_and_store_takes_every_place_in_the_order(bench, monkeypatch):
    order = []

    def run_once(store, args, tree):
        order.append((str(tree), store))
        return {"store": store, "prompt_tps": 100.0 if store == "separate" else 110.0, "generation_tps": 10.0,
                "gears": "", "prompt_tokens": 57}

    monkeypatch.setattr(bench, "run_once", run_once)
    runs, ratios = bench.measure(fake_args({"a": Path("A"), "b": Path("B")}))
    pairs = [order[i:i + 4] for i in range(0, len(order), 4)]
    places = {run: {p.index(run) for p in pairs} for run in pairs[0]}
    assert all(found == {0, 1, 2, 3} for found in places.values()), places
    assert ratios == {"a": [1.1] * 4, "b": [1.1] * 4}
    assert [r["pair"] for r in runs] == [i for i in range(4) for _ in range(4)]


def test_a_tree_over_the_first_pairs_runs_of_the_same_store(bench):
    runs = [{"pair": i, "tree": t, "store": s, "prompt_tps": p, "generation_tps": g}
            for i in range(3)
            for t, s, p, g in (("a", "separate", 100.0, 10.0), ("a", "nested", 100.0, 20.0),
                               ("b", "separate", 50.0, 10.0), ("b", "nested", 200.0 + i, 20.0))]
    got = bench.against_first(runs, "b", "a", "wall")
    assert got["separate"]["prompt"]["ratios"] == [0.5, 0.5, 0.5]
    assert got["separate"]["prompt"]["verdict"] == "missed"
    assert got["nested"]["prompt"]["ratios"] == pytest.approx([2.0, 2.01, 2.02])
    assert got["nested"]["prompt"]["verdict"] == "met" and got["nested"]["decode"]["ratios"] == [1.0] * 3
    runs[0]["generation_tps"] = None  # mlx-lm printed no decode line: no decode ratios
    assert "decode" not in bench.against_first(runs, "b", "a", "wall")["separate"]
