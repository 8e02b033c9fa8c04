"""The evaluation harness's promises, on a tiny random model (fast).

* many steps per forward pass compute what one step per pass computes
  (the same gears, the same numbers), with or without a trimmable cache;
* the random baseline spends exactly the entropy policy's bytes;
* a verdict comes from a paired test over positions and prints digits;
* text in any encoding, and the tokenizer's BOS said as it is;
* numpy metrics equal their MLX reference.
"""

from __future__ import annotations

import json
import math
import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_llama
from hypothesis import given, settings, strategies as st

from gearbx_mlx.config import GEARS, GearboxConfig
from gearbx_mlx.entropy import entropy_bits
from gearbx_mlx.evaluate import main
from gearbx_mlx.evaluation import chunked, metrics, report, significance
from gearbx_mlx.evaluation.chunked import ChunkSettings
from gearbx_mlx.evaluation.harness import evaluate
from gearbx_mlx.evaluation.specs import CHAR_GEAR, GEAR_CHAR, ModelLayout, PolicySpec, base_specs, matched_specs
from gearbx_mlx.evaluation.teacher import COLD_START, teacher_forced
from gearbx_mlx.evaluation.text import decode, read_text, text_tokens, tokenization_note
from gearbx_mlx.evaluation.variants import (
    NESTED_HIGH,
    NESTED_MID,
    ORIGINAL,
    VariantModel,
    variant_weight,
    variant_weights,
)
from gearbx_mlx.policies import ReplayPolicy

VOCAB = 256
#: Thresholds in the tiny model's bits: its entropies spread over 2.6-7.1 bits, so rows shift often.
SPREAD = {"a": (4.7, 6.6), "b": (5.5, 6.2)}
#: The chunked and the one-step passes multiply in other shapes: with the reference BLAS they agree to
#: the bit on this model, with OpenBLAS to 1e-6 relative (entropies, NLL) and, for the KL of two close
#: float32 distributions, to 1e-7 nats absolute.
CHUNKED_RTOL = 1e-5
CHUNKED_KL_ATOL = 1e-6
#: The metrics in float32 against the same formulas in float64, absolute: numpy's (measured: below
#: 1e-7), and MLX's, whose log-sum-exp rounds log p of a near-certain token coarser (measured: 6e-6
#: on a nearly one-hot row; 3e-7 relative elsewhere).
NUMPY_FLOAT64_ATOL = 1e-6
MLX_FLOAT64_ATOL = 2e-5
METRICS_RTOL = 1e-4


@pytest.fixture(scope="module")
def spread_model():
    """A tiny llama whose next-token entropies spread across the thresholds."""
    model = make_tiny_llama(seed=1)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.2
    mx.eval(model.parameters())
    return model


def _windows(n_windows: int, length: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n_windows)]


class ByteTokenizer:
    """A tokenizer of bytes (ids 0-255) that may add a BOS and an EOS, as HF tokenizers do."""

    def __init__(self, bos=None, eos=None):
        self.bos_token_id, self.eos_token_id = bos, eos
        self.eos_token_ids = {eos} if eos is not None else set()
        self.calls = 0

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        ids = [b for b in text.encode("utf-8")]
        if add_special_tokens:
            ids = ([self.bos_token_id] if self.bos_token_id is not None else []) + ids
            ids += [self.eos_token_id] if self.eos_token_id is not None else []
        return ids

    def convert_ids_to_tokens(self, ids):
        return ["<bos>" if i == self.bos_token_id else "<eos>" if i == self.eos_token_id else chr(i) for i in ids]


# -- many steps per pass = one step per pass --------------------------------------------


def _oracle(model, layout, config, spec, tokens):
    """The plain decode loop, written out: one token per pass, the policy after every step."""
    from mlx_lm.models.cache import make_prompt_cache

    from gearbx_mlx.entropy import EntropyMonitor

    tables = {g: layout.keys(spec, g) for g in GEARS}
    policy, monitor = spec.make_policy(0), EntropyMonitor(VOCAB, config, thresholds=spec.thresholds)
    monitor.reset(COLD_START)
    gear, gears, ent = policy.initial(COLD_START), [], []
    cache = make_prompt_cache(model)
    with VariantModel(model, layout.bits_per_path([spec]), config.group_size) as vm:
        for t in range(len(tokens) - 1):
            vm.set_keys({p: (k,) for p, k in zip(layout.paths, tables[gear])})
            logits = model(mx.array([[tokens[t]]]), cache=cache)[0, -1]
            h = entropy_bits(logits).item()
            gears.append(GEAR_CHAR[gear])
            ent.append(h)
            gear = policy.next_gear(t, monitor.push(h))
    return gears, ent


def test_chunked_passes_equal_one_step_per_pass(spread_model):
    config = GearboxConfig()
    layout = ModelLayout.of(spread_model, config, VOCAB)
    windows = _windows(2, 90)
    specs = base_specs(SPREAD)
    fast = teacher_forced(spread_model, windows, specs, layout, config, VOCAB)
    slow = teacher_forced(spread_model, windows, specs, layout, config, VOCAB, chunks=ChunkSettings(stepwise=True))
    # Passes cut short by the size limit (7 positions), the reference's too.
    short = teacher_forced(spread_model, windows, specs, layout, config, VOCAB, max_positions=7)
    assert sum(r.shifts for r in fast if r.spec.kind == "entropy") > 40  # the rows do route
    for a, b in [*zip(fast, slow), *zip(short, slow)]:
        assert a.gears == b.gears, a.spec.name
        for field in ("kl", "entropy", "smoothed"):
            np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=CHUNKED_RTOL, atol=CHUNKED_KL_ATOL)
        assert a.perplexity == pytest.approx(b.perplexity, rel=CHUNKED_RTOL)
        assert a.hits == b.hits and a.bytes_per_token == b.bytes_per_token
    # And both equal the loop written out, for an entropy row of each scope.
    for spec in (specs[4], specs[9]):
        gears, ent = _oracle(spread_model, layout, config, spec, windows[0])
        row = next(r for r in fast if r.spec == spec)
        steps = len(windows[0]) - 1
        assert row.gears[:steps] == gears
        np.testing.assert_allclose(row.entropy[:steps], ent, rtol=CHUNKED_RTOL, atol=1e-6)


def test_static_rows_take_one_pass_per_window_and_copy_the_high_prefix(spread_model):
    config = GearboxConfig()
    layout = ModelLayout.of(spread_model, config, VOCAB)
    windows = _windows(3, 40)
    ref = PolicySpec("static-high", "static", "all", "high")
    low = PolicySpec("static-low/all", "static", "all", "low")
    pos = PolicySpec("position@x/all", "position", "all", k=30)
    from gearbx_mlx.evaluation.teacher import TeacherForcing

    with TeacherForcing(spread_model, windows, layout, config, VOCAB, [ref, low, pos]) as tf:
        r_ref, r_low, r_pos = tf.run([ref, low, pos], "p")
        work = tf.work["p"]
    # One reference pass and one pass per row per window; the position rule's first 30 steps are the reference's.
    assert work.passes == 3 * 3 and work.positions_copied == 3 * 30
    assert r_pos.kl[:30] == [0.0] * 30 and r_pos.hits[:30] == [True] * 30 and r_pos.kl[30] > 0
    assert work.positions_run == 3 * 39 + 3 * 39 + 3 * 9


def test_a_cache_that_cannot_be_trimmed_runs_one_step_per_pass(spread_model, monkeypatch):
    """Fault injection: with a cache that cannot take steps back, no guess is ever made."""
    config = GearboxConfig()
    layout = ModelLayout.of(spread_model, config, VOCAB)
    windows = _windows(1, 50)
    specs = [PolicySpec("static-high", "static", "all", "high"),
             PolicySpec("dynamic-a/all", "entropy", "all", thresholds=SPREAD["a"])]
    want = teacher_forced(spread_model, windows, specs, layout, config, VOCAB)
    monkeypatch.setattr(chunked, "can_trim_prompt_cache", lambda cache: False)

    def refuse(cache, n):
        raise AssertionError("trimmed a cache that cannot be trimmed")

    monkeypatch.setattr(chunked, "trim_prompt_cache", refuse)
    got = teacher_forced(spread_model, windows, specs, layout, config, VOCAB)
    assert got[1].gears == want[1].gears
    np.testing.assert_allclose(got[1].kl, want[1].kl, rtol=CHUNKED_RTOL, atol=CHUNKED_KL_ATOL)


def test_a_row_keeps_no_step_of_a_wrong_guess(spread_model, monkeypatch):
    """Fault injection: guesses that are always wrong cost passes, never correctness."""
    config = GearboxConfig()
    layout = ModelLayout.of(spread_model, config, VOCAB)
    windows = _windows(1, 60)
    specs = [PolicySpec("static-high", "static", "all", "high"),
             PolicySpec("dynamic-a/all", "entropy", "all", thresholds=SPREAD["a"])]
    want = teacher_forced(spread_model, windows, specs, layout, config, VOCAB)
    real = chunked._guess

    def wrong(policy, monitor, gear, start, n, predicted):
        g = real(policy, monitor, gear, start, n, predicted)
        return g[:1] + ["low" if x != "low" else "high" for x in g[1:]]

    monkeypatch.setattr(chunked, "_guess", wrong)
    got = teacher_forced(spread_model, windows, specs, layout, config, VOCAB)
    assert got[1].gears == want[1].gears
    np.testing.assert_allclose(got[1].kl, want[1].kl, rtol=CHUNKED_RTOL, atol=CHUNKED_KL_ATOL)


def test_per_position_keys_route_each_position(spread_model):
    """A (1, L) input with L keys per path equals L decode steps, each in its own variant."""
    from mlx_lm.models.cache import make_prompt_cache

    config = GearboxConfig()
    layout = ModelLayout.of(spread_model, config, VOCAB)
    ids = [3, 17, 42, 5, 99]
    keys = (ORIGINAL, 4, 8, 4, ORIGINAL)
    with VariantModel(spread_model, {p: [4, 8] for p in layout.paths}, 64) as vm:
        vm.set_keys({p: keys for p in layout.paths})
        mixed = spread_model(mx.array([ids]))[0]
        cache = make_prompt_cache(spread_model)
        for t, k in enumerate(keys):
            vm.set_keys({p: (k,) for p in layout.paths})
            step = spread_model(mx.array([[ids[t]]]), cache=cache)[0, 0]
            np.testing.assert_allclose(np.array(mixed[t]), np.array(step), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="variant keys"):
            vm.set_keys({p: (0, 4, 8) for p in layout.paths})
            spread_model(mx.array([ids]))


# -- equal bytes by construction ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_layout():
    return ModelLayout.of(make_tiny_llama(), GearboxConfig(), VOCAB)


@settings(max_examples=200, deadline=None)
@given(
    windows=st.lists(st.text(alphabet="lmh", min_size=1, max_size=80), min_size=1, max_size=5).filter(
        lambda ws: len({len(w) for w in ws}) == 1),
    scope=st.sampled_from(("attention", "all")),
    seed=st.integers(0, 2**16),
)
def test_random_baseline_spends_exactly_the_policys_bytes(tiny_layout, windows, scope, seed):
    """Any gear sequences: the matched random row replays a permutation of them, window by window."""
    dyn = PolicySpec(f"dynamic-x/{scope}", "entropy", scope)
    counts = {g: sum(w.count(GEAR_CHAR[g]) for w in windows) for g in GEARS}
    mean_bytes = tiny_layout.sequence_bytes(dyn, counts) / sum(map(len, windows))
    _, rnd = matched_specs([(dyn, windows, mean_bytes)], tiny_layout, len(windows[0]) + 1, seed)
    for w, gears in enumerate(windows):
        policy = rnd.make_policy(stream=w)
        played = [policy.initial(COLD_START)] + [policy.next_gear(t, None) for t in range(len(gears) - 1)]
        assert sorted(played) == sorted(CHAR_GEAR[c] for c in gears)
        own = {g: gears.count(GEAR_CHAR[g]) for g in GEARS}
        mine = {g: played.count(g) for g in GEARS}
        assert tiny_layout.sequence_bytes(rnd, mine) == tiny_layout.sequence_bytes(dyn, own)  # exactly


def test_replay_policy_rejects_bad_gears():
    with pytest.raises(ValueError, match="gears"):
        ReplayPolicy([])
    with pytest.raises(ValueError, match="'fast'"):
        ReplayPolicy(["high", "fast"])
    with pytest.raises(ValueError, match="sequences"):
        PolicySpec("random@x", "random", sequences=("hq",))
    with pytest.raises(ValueError, match="window 2"):
        PolicySpec("random@x", "random", sequences=("hl", "lh")).make_policy(2)


# -- significance ---------------------------------------------------------------------------


def test_paired_difference_outcomes():
    rng = np.random.default_rng(0)
    base = rng.exponential(1e-3, 512)
    noise = base + rng.normal(0, 1e-4, 512)
    lower = significance.paired_difference(base * 0.5, base, 64)
    assert lower["outcome"] == "lower" and lower["interval"][1] < 0 and lower["blocks"] == 16
    assert significance.paired_difference(base, base * 0.5, 64)["outcome"] == "higher"
    same = significance.paired_difference(noise, base, 64)
    assert same["outcome"] == "indistinguishable" and same["interval"][0] < 0 < same["interval"][1]
    zero = significance.paired_difference([0.0] * 20, [0.0] * 20, 10)
    assert zero["outcome"] == "indistinguishable" and zero["interval"] == [0.0, 0.0]
    # Seeded: the same inputs give the same interval.
    assert significance.paired_difference(noise, base, 64, seed=3) == significance.paired_difference(
        noise, base, 64, seed=3)
    with pytest.raises(ValueError, match="window_steps"):
        significance.paired_difference(base, base, 100)
    with pytest.raises(ValueError, match="equal-length"):
        significance.paired_difference(base, base[:10], 64)


def _row(name, kind, kl, matched_to=None, bytes_per_token=100.0):
    return {"name": name, "spec": {"kind": kind, "matched_to": matched_to}, "perplexity": 10.0,
            "mean_kl": float(np.mean(kl)), "top1_agreement": 0.99, "bytes_per_token": bytes_per_token,
            "relative_bytes": bytes_per_token / 200.0}


def test_median_verdict_needs_the_whole_interval_past_the_target():
    steady = [1.05, 1.06, 1.04, 1.07, 1.05, 1.06]
    assert significance.median_verdict(steady, 1.0, 1000)["verdict"] == significance.MET
    assert significance.median_verdict([r - 0.2 for r in steady], 1.0, 1000)["verdict"] == significance.MISSED
    noisy = [0.8, 1.2, 0.9, 1.1, 0.85, 1.15]
    j = significance.median_verdict(noisy, 1.0, 1000)
    assert j["verdict"] == significance.WITHIN_NOISE and j["interval_95"][0] < 1.0 < j["interval_95"][1]
    assert j == significance.median_verdict(noisy, 1.0, 1000)  # seeded
    with pytest.raises(ValueError, match="at least one ratio"):
        significance.median_verdict([], 1.0)
    with pytest.raises(ValueError, match="at least 100"):
        significance.median_verdict(steady, 1.0, resamples=10)


@given(n=st.integers(1, 6), start=st.integers(0, 40))
@settings(max_examples=60, deadline=None)
def test_a_balanced_order_puts_every_item_at_every_place_equally_often(n, start):
    """A fixed order ran one configuration always last in its round; that place measured slowest."""
    items = [f"config {i}" for i in range(n)]
    rounds = [significance.balanced_order(items, start + r) for r in range(2 * n)]
    assert all(sorted(order) == items for order in rounds)  # every item once a round
    for item in items:
        places = [order.index(item) for order in rounds]
        assert all(places.count(place) == 2 for place in range(n)), (item, places)
    if n > 1:  # a round's partner is another order (A/B then B/A, say)
        assert significance.balanced_order(items, 2 * start) != significance.balanced_order(items, 2 * start + 1)


def test_a_balanced_order_of_nothing_and_a_negative_round():
    assert significance.balanced_order([], 3) == []
    with pytest.raises(ValueError, match="at least 0"):
        significance.balanced_order(["a"], -1)


def test_a_tiny_kl_difference_within_noise_is_not_a_win_and_prints_its_digits():
    rng = np.random.default_rng(1)
    a = rng.exponential(2e-5, 600)
    b = a[::-1].copy()  # the same values in another order: means equal, positions differ
    b[0] += 1e-7  # the policy's mean is (barely) lower
    rows = [_row("dynamic-x/all", "entropy", a), _row("random@x/all", "random", b, "dynamic-x/all")]
    comps = report.comparisons(rows, {"dynamic-x/all": a, "random@x/all": b}, 100, seed=0)
    assert comps[0]["test_random"]["outcome"] == "indistinguishable" and comps[0]["beats_random"] is False
    text = report.verdict(comps)
    assert "is indistinguishable from the random baseline" in text and "beats" not in text
    assert "0.0000 vs 0.0000" not in text and format(np.mean(a), ".3g") in text
    assert "bytes 0.5000 vs 0.5000 of fp16, equal" in text


def test_a_clear_kl_difference_is_a_win():
    rng = np.random.default_rng(2)
    b = rng.exponential(1e-3, 600)
    a = b * 0.3
    rows = [_row("dynamic-x/all", "entropy", a), _row("position@x/all", "position", b, "dynamic-x/all", 101.0)]
    comps = report.comparisons(rows, {"dynamic-x/all": a, "position@x/all": b}, 100, seed=0)
    assert comps[0]["beats_position"] is True and comps[0]["test_position"]["outcome"] == "lower"
    assert comps[0]["bytes_difference_position"] == pytest.approx(0.01)
    assert report.verdict(comps).startswith("dynamic-x/all: beats the position baseline")


def test_a_file_without_tests_renders_with_a_note_and_one_with_kl_traces_gets_its_tests():
    a, b = [1e-5, 2e-5, 3e-5, 4e-5], [4e-5, 5e-5, 6e-5, 7e-5]
    rows = [_row("dynamic-x/all", "entropy", a), _row("random@x/all", "random", b, "dynamic-x/all")]
    old = {"comparisons": report.comparisons(rows), "policies": rows, "text": {"window": 3}, "traces": {}}
    assert "test_random" not in old["comparisons"][0]
    assert report.refresh_comparisons(old) == old["comparisons"]
    text = report.verdict(old["comparisons"])
    assert "beats the random baseline on KL (2.5e-05 vs 5.5e-05 nats" in text and "no significance test" in text
    old["traces"] = {"dynamic-x/all": {"kl": a}, "random@x/all": {"kl": b}}
    fresh = report.refresh_comparisons(old)
    assert fresh[0]["test_random"]["positions"] == 4 and fresh[0]["test_random"]["blocks"] == 2


# -- end to end on the tiny model -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_results(spread_model):
    text = "".join(chr(32 + (i * 37) % 90) for i in range(400))
    return evaluate(spread_model, ByteTokenizer(bos=1), text, base_specs(SPREAD), tokens=200, window=50,
                    speed_tokens=0, workload_tokens=0, speculative=False, seed=5)


def test_evaluation_random_rows_have_the_policys_bytes_and_gears_per_window(tiny_results):
    rows = {r["name"]: r for r in tiny_results["policies"]}
    traces = tiny_results["traces"]
    steps = tiny_results["text"]["window"] - 1
    checked = 0
    for name, r in rows.items():
        if r["spec"]["kind"] != "entropy":
            continue
        rnd = rows[name.replace("dynamic-", "random@")]
        assert rnd["bytes_per_token"] == r["bytes_per_token"] and rnd["gear_counts"] == r["gear_counts"]
        a, b = traces[name]["gears"], traces[rnd["name"]]["gears"]
        for w in range(tiny_results["text"]["windows"]):
            assert sorted(a[w * steps:(w + 1) * steps]) == sorted(b[w * steps:(w + 1) * steps])
        assert a != b
        checked += 1
    assert checked == 5  # two threshold sources x two scopes, and the nested store's row


def test_evaluation_comparisons_carry_tests_and_traces_carry_kl(tiny_results, tmp_path, capsys):
    for c in tiny_results["comparisons"]:
        for kind in ("random", "position"):
            t = c[f"test_{kind}"]
            assert t["positions"] == tiny_results["text"]["scored_positions"]
        assert c["beats_position"] == (c["test_position"]["outcome"] == "lower")
        # Against random routing: the permutation test over the distribution, not the one draw.
        dist = c["random_distribution"]
        assert dist["permutations"] >= 20 and c["beats_random"] == (dist["outcome"] == "lower")
        k = dist["mean_kl"]
        assert k["p2_5"] <= k["median"] <= k["p97_5"]
    assert len(tiny_results["traces"]["dynamic-a/all"]["kl"]) == tiny_results["text"]["scored_positions"]
    assert "kl" not in tiny_results["traces"]["static-low/all"]
    assert tiny_results["significance"]["seed"] == 5
    forcing = tiny_results["routing"]["forcing"]
    assert forcing["pass 1"]["passes"] < forcing["pass 1"]["positions_kept"]
    # A saved run without its tests gets them back from the KL traces, the same ones.
    saved = json.loads(json.dumps(tiny_results))
    for c in saved["comparisons"]:
        for kind in ("random", "position"):
            del c[f"test_{kind}"]
    path = report.write_json(saved, tmp_path / "r.json")
    assert main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "95% interval" in out and "no significance test" not in out
    redone = report.refresh_comparisons(saved)
    for c, d in zip(redone, tiny_results["comparisons"]):
        assert c["test_random"]["outcome"] == d["test_random"]["outcome"]
        assert c["test_random"]["mean_difference"] == pytest.approx(d["test_random"]["mean_difference"], rel=1e-4)


def test_evaluation_says_the_tokenizer_adds_a_bos(tiny_results):
    note = tiny_results["text"]["tokenization"]
    assert "adds <bos> (id 1) before the text" in note and "no BOS" not in note
    assert "later windows begin mid-text" in note


# -- text and tokens ---------------------------------------------------------------------------


def test_text_in_another_encoding_is_read_losslessly_and_reported(tmp_path):
    words = "Café déjà vu: naïve façade — 10 €"
    cp = tmp_path / "cp1252.txt"
    cp.write_bytes(words.encode("cp1252"))
    text, info = read_text(str(cp))
    assert info["encoding"] == "latin-1" and info["encoding_source"] == "fallback"
    assert "not UTF-8" in info["encoding_note"] and "--encoding" in info["encoding_note"]
    assert text.encode("latin-1") == cp.read_bytes()  # lossless: every byte back
    text, info = read_text(str(cp), "cp1252")
    assert text == words and info == {**info, "encoding": "cp1252", "encoding_source": "given"}
    u16 = tmp_path / "u16.txt"
    u16.write_bytes(words.encode("utf-16"))
    text, info = read_text(str(u16))
    assert text == words and info["encoding_source"] == "byte-order mark"
    sig = tmp_path / "sig.txt"
    sig.write_bytes(b"\xef\xbb\xbf" + words.encode("utf-8"))
    assert read_text(str(sig))[0] == words  # the BOM is not part of the text
    with pytest.raises(ValueError, match=r"not valid utf-8 text \(byte 0xe9 at offset 3\)"):
        read_text(str(cp), "utf-8")
    with pytest.raises(ValueError, match="unknown --encoding 'klingon'"):
        decode(b"abc", "klingon")


def test_cli_rejects_an_unknown_encoding_before_loading(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("hello")
    assert main(["--text", str(f), "--encoding", "klingon"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown --encoding 'klingon'" in err[0]


def test_tokens_keep_a_bos_and_drop_an_eos_added_at_the_cut():
    tok = ByteTokenizer(bos=1, eos=2)
    text = "abcdefghij" * 100
    ids = text_tokens(tok, text, 50)
    assert ids[0] == 1 and 2 not in ids and len(ids) == 50 and ids[1:4] == [97, 98, 99]
    assert text_tokens(tok, "short", 50) == [1] + list(b"short")  # the whole text, no EOS
    note = tokenization_note(tok, text, 1)
    assert "<bos> (id 1) before the text" in note and "<eos> (id 2)" in note and "dropped" in note
    assert tokenization_note(ByteTokenizer(), text, 3).endswith("the tokenizer adds no BOS")


# -- metrics: numpy against its MLX reference ----------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    positions=st.integers(1, 9),
    vocab=st.integers(2, 301),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_numpy_metrics_equal_the_mlx_reference(positions, vocab, scale, seed):
    rng = np.random.default_rng(seed)
    ref_logits = mx.array((rng.normal(size=(positions, vocab)) * scale).astype(np.float32))
    logits = mx.array((np.array(ref_logits) + rng.normal(size=(positions, vocab)) * 0.3).astype(np.float32))
    targets = rng.integers(0, vocab, positions).tolist()
    lp_ref, lp = _log_softmax64(np.array(ref_logits)), _log_softmax64(np.array(logits))
    want = {
        "nll": -lp[np.arange(positions), targets],
        "kl": (np.exp(lp_ref) * (lp_ref - lp)).sum(-1),
        "entropy": -(np.exp(lp) * lp).sum(-1) / math.log(2),
        "hits": (lp.argmax(-1) == lp_ref.argmax(-1)).tolist(),
    }
    for backend, atol in (("numpy", NUMPY_FLOAT64_ATOL), ("mlx", MLX_FLOAT64_ATOL)):
        ref, nll, ent = metrics.reference(ref_logits, targets, backend)
        np.testing.assert_allclose(nll, -lp_ref[np.arange(positions), targets], rtol=METRICS_RTOL, atol=atol)
        np.testing.assert_allclose(ent, -(np.exp(lp_ref) * lp_ref).sum(-1) / math.log(2), rtol=METRICS_RTOL,
                                   atol=atol)
        got = metrics.routed(logits, targets, ref, backend)
        for k in ("nll", "kl", "entropy"):
            np.testing.assert_allclose(got[k], want[k], rtol=METRICS_RTOL, atol=atol, err_msg=f"{backend} {k}")
        assert got["hits"] == want["hits"]


def _log_softmax64(z):
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def test_metrics_guard_non_finite_logits_like_entropy_bits():
    logits = mx.array([[0.0, float("nan"), 1.0, float("inf")], [1.0, 2.0, 3.0, 4.0]])
    _, _, ent = metrics.reference(logits, [0, 1], "numpy")
    np.testing.assert_allclose(ent, entropy_bits(logits).tolist(), atol=1e-6)
    assert all(math.isfinite(h) for h in ent)
    with pytest.raises(ValueError, match="backend"):
        metrics.routed(logits, [0, 1], None, "torch")



def test_a_real_tokenizer_that_adds_a_bos_is_reported_and_its_bos_kept():
    """The default model's Hugging Face tokenizer, told to add a BOS as Gemma's does."""
    from mlx_lm.utils import load_tokenizer
    from tokenizers import processors

    from gearbx_mlx.sources.models import default_model_path

    folder = default_model_path(None)
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"the default model is not in the cache ({folder})")
    tok = load_tokenizer(folder)
    plain = tok.encode("Hello world")
    assert tokenization_note(tok, "Hello world", 2).endswith("adds no BOS")
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    assert tok.encode("Hello world") == [bos] + plain  # the tokenizer now adds one
    note = tokenization_note(tok, "Hello world", 2)
    assert f"adds <|im_start|> (id {bos}) before the text" in note and "later windows begin mid-text" in note
    assert text_tokens(tok, "Hello world " * 50, 5)[:3] == [bos] + plain


# -- the nested store's rows --------------------------------------------------------------------

#: A view sums its planes' quantized products in float32; the variant multiplies by their
#: float sum: the two agree to float32 rounding of a 192-term dot product.
NESTED_VIEW_ATOL = 2e-5


@pytest.mark.parametrize("shape", [(96, 192), (33, 128), (7, 64)])
def test_nested_variants_multiply_by_what_the_nested_views_multiply_by(shape):
    import mlx.nn as nn

    from gearbx_mlx.nested.layers import make_view, nested_weights_of
    from gearbx_mlx.nested.planes import DEFAULT_PLAN

    mx.random.seed(shape[0])
    lin = nn.Linear(shape[1], shape[0], bias=False)
    x = mx.random.normal((3, 5, shape[1]))
    w = nested_weights_of(lin, DEFAULT_PLAN)
    for key, n in ((4, 1), (NESTED_MID, 2), (NESTED_HIGH, 3)):
        view = make_view(w, n, embedding=False, fused=False)
        got = x @ variant_weight(lin.weight, key, 64).T
        np.testing.assert_allclose(np.array(got), np.array(view(x)), atol=NESTED_VIEW_ATOL, rtol=0)
    # The low gear of the nested store is MLX 4-bit: one key serves both stores.
    assert mx.array_equal(variant_weight(lin.weight, 4, 64), w.planes[0].dequantize())
    with pytest.raises(ValueError, match="unknown variant key"):
        variant_weight(lin.weight, -7, 64)
    # Several keys at once share one build of the planes, with the same weights.
    together = variant_weights(lin.weight, (4, 8, NESTED_MID, NESTED_HIGH), 64)
    for key in (4, 8, NESTED_MID, NESTED_HIGH):
        assert mx.array_equal(together[key], variant_weight(lin.weight, key, 64)), key
    with pytest.raises(ValueError, match="unknown variant key"):
        variant_weights(lin.weight, (4, -7), 64)


def test_nested_variants_share_the_nested_stores_planes_cache(tmp_path, monkeypatch):
    """The evaluation's nested rows read the planes file that ``generate --store nested --scope all``
    reads and writes (same key, same folder), with the values a build gives, and build it when it
    is missing; a damaged file is rebuilt, not trusted."""
    from gearbx_mlx import precision
    from gearbx_mlx.evaluation import variants
    from gearbx_mlx.nested import store

    model = make_tiny_llama()
    (tmp_path / "model.safetensors").write_bytes(b"weights of the folder the key is made from")
    paths, _ = precision.discover(model, "all", 64)
    want = {p: variants.variant_weights(dict(model.named_modules())[p].weight, (NESTED_MID, NESTED_HIGH), 64)
            for p in paths}
    # The store's own manager writes the file a nested --scope all --high planes run reads.
    # (on a second copy of the weights: a high gear of planes replaces the loaded layers)
    manager = precision.PrecisionManager(make_tiny_llama(), GearboxConfig(store="nested", scope="all", high="planes"),
                                         tmp_path)
    assert manager.planes_origin == "built" and manager.planes_file.is_file()
    monkeypatch.setattr(store, "build_nested", lambda *a, **k: pytest.fail("built again instead of read"))
    got = variants.VariantModel(model, {p: (NESTED_MID, NESTED_HIGH) for p in paths}, 64, tmp_path)
    for p in paths:
        for key in (NESTED_MID, NESTED_HIGH):
            assert mx.array_equal(got.variants[p]._variants[key], want[p][key]), (p, key)
    monkeypatch.undo()
    # Without the file (and in another folder): built, written, and read back the next time.
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"another model")
    said = []
    first = variants.nested_planes(model, paths[:2], 2, 64, other, said.append)
    files = list((other / store.CACHE_FOLDER).glob("*.safetensors"))
    assert len(first) == 2 and len(files) == 1
    monkeypatch.setattr(store, "build_nested", lambda *a, **k: pytest.fail("built again instead of read"))
    again = variants.nested_planes(model, paths[:2], 2, 64, other, said.append)
    assert [m.split(":")[0].split(" (")[0] for m in said] == [
        f"building the nested store's planes of {len(paths)} layers", "the nested store's planes"]
    assert "reading " + str(files[0]) in said[1]
    assert all(mx.array_equal(a.weight, b.weight) for p in first for a, b in zip(first[p], again[p]))
    monkeypatch.undo()
    files[0].write_bytes(files[0].read_bytes()[:-8] + bytes(8))  # damaged, same size
    with pytest.warns(UserWarning, match="rebuilding it"):
        rebuilt = variants.nested_planes(model, paths[:2], 2, 64, other)
    assert all(mx.array_equal(a.scales, b.scales) for p in first for a, b in zip(first[p], rebuilt[p]))
    # No folder, or a layer the store does not manage: nothing cached, the variants build their own.
    assert variants.nested_planes(model, paths, 2, 64, None) == {}
    assert variants.nested_planes(model, ["not.a.layer"], 2, 64, other) == {}


def test_nested_rows_cost_their_planes_and_route_their_own_gears(tiny_results):
    rows = {r["name"]: r for r in tiny_results["policies"]}
    mid, nested_mid = rows["static-mid/all"], rows["static-mid/all+nested"]
    planes, high = rows["static-high+planes"], rows["static-high"]
    # Planes 4/64 + 4/32 read 9.5 bits a weight against MLX 8-bit's 8.5; every plane 16 bits, fp16's.
    assert nested_mid["bytes_per_token"] > mid["bytes_per_token"]
    assert planes["bytes_per_token"] == pytest.approx(high["bytes_per_token"])
    # They are other weights: near the reference, not equal to it or to the separate store's rows.
    assert 0 < planes["mean_kl"] < nested_mid["mean_kl"]
    assert nested_mid["mean_kl"] != mid["mean_kl"]
    assert rows["dynamic-a/all+nested"]["spec"]["store"] == "nested"
    assert rows["random@a/all+nested"]["spec"]["store"] == "nested"


def test_a_mixed_row_has_no_nested_store():
    with pytest.raises(ValueError, match="no nested store"):
        PolicySpec("m", "mixed", "all", store="nested")
    with pytest.raises(ValueError, match="store must be one of"):
        PolicySpec("m", "static", "all", store="planes")


def test_thresholds_are_calibrated_once_per_weights_and_a_damaged_record_is_redone(tmp_path, monkeypatch):
    """evaluate's threshold calibration is kept by the weights' fingerprint: a second run reads it;
    other weights calibrate anew; an unreadable record is calibrated again and rewritten."""
    from gearbx_mlx.evaluation import harness

    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake(model, tokenizer, vocab):
        calls.append(model)
        return {"median": (1.0 + len(calls), 2.0), "percentile": (0.5, 3.0)}, {"samples": 7}

    monkeypatch.setattr(harness, "calibrated_thresholds", fake)
    folders = []
    for seed in (0, 1):
        d = tmp_path / f"m{seed}"
        d.mkdir()
        make_tiny_llama(seed=seed).save_weights(str(d / "model.safetensors"))
        folders.append(d)
    lines = []
    first = harness.cached_thresholds("m", None, 256, folders[0], lines.append)
    again = harness.cached_thresholds("m", None, 256, folders[0], lines.append)
    assert len(calls) == 1 and again[0] == first[0] and again[1]["reused"] and "reusing" in lines[-1]
    harness.cached_thresholds("m", None, 256, folders[1], lines.append)
    assert len(calls) == 2
    for path in (tmp_path / "cache" / "calibrations").glob("*.json"):
        path.write_text("{not json")
    redone = harness.cached_thresholds("m", None, 256, folders[0], lines.append)
    assert len(calls) == 3 and "cannot be read" in lines[-2] and redone[0]["median"] == (4.0, 2.0)
    def readable(path):
        try:
            return bool(json.loads(path.read_text())["thresholds"])
        except ValueError:
            return False

    assert sum(map(readable, (tmp_path / "cache" / "calibrations").glob("*.json"))) == 1  # rewritten whole
    harness.cached_thresholds("m", None, 256, None, lines.append)  # no folder: nothing kept
    assert len(calls) == 4


# -- the random baseline as a distribution over permutations ------------------------------------------------

from gearbx_mlx.evaluation import permutation  # noqa: E402
from gearbx_mlx.evaluation.teacher import RowResult  # noqa: E402


def _static(gear: str, kl, scope: str = "all") -> RowResult:
    spec = PolicySpec(f"static-{gear}/{scope}", "static", scope, gear)
    r = RowResult(spec, steps=len(kl))
    r.kl, r.nll = list(kl), [2.0 + x for x in kl]
    r.hits = [x < 0.05 for x in kl]
    r.gears = [{"low": "l", "mid": "m", "high": "h"}[gear]] * len(kl)
    r.kl_sum, r.nll_sum, r.agree = sum(r.kl), sum(r.nll), sum(r.hits)
    return r


def _policy(gears: str) -> RowResult:
    r = RowResult(PolicySpec("dynamic-x/all", "entropy", "all"), steps=len(gears))
    r.gears = list(gears)
    return r


@pytest.fixture
def three_gears():
    rng = np.random.default_rng(3)
    low = rng.uniform(0.0, 0.2, 200)
    return [_static("high", np.zeros(200)), _static("mid", low / 10), _static("low", low)], low


def test_a_permutation_reselects_each_position_from_its_gears_row(three_gears):
    first, low = three_gears
    rows = permutation.gear_rows(first, _policy("l" * 200))
    assert set(rows) == {"h", "m", "l"}
    got = permutation.reselect("l" * 100 + "h" * 100, rows)
    np.testing.assert_array_equal(got["kl"], np.concatenate([low[:100], np.zeros(100)]))
    np.testing.assert_array_equal(got["nll"], np.concatenate([2.0 + low[:100], np.full(100, 2.0)]))
    # A policy using a gear without a static row has no distribution.
    assert permutation.gear_rows(first[:2], _policy("l" * 200)) is None


def test_placing_the_low_gear_well_beats_random_and_badly_loses_to_it(three_gears):
    first, low = three_gears
    cheap = np.argsort(low)  # positions where the low gear costs least, first
    good, bad = np.array(["h"] * 200), np.array(["h"] * 200)
    good[cheap[:100]], bad[cheap[100:]] = "l", "l"
    rows = permutation.gear_rows(first, _policy("".join(good)))
    outcomes = {}
    for name, trace in (("good", good), ("bad", bad)):
        d = permutation.random_distribution(_policy("".join(trace)), rows, 100, seed=1, permutations=50)
        assert d["permutations"] == 50 and d["mean_kl"]["p2_5"] <= d["mean_kl"]["median"] <= d["mean_kl"]["p97_5"]
        outcomes[name] = d["outcome"], d["p_value"]
    assert outcomes["good"][0] == "lower" and outcomes["good"][1] < 0.05
    assert outcomes["bad"][0] == "higher" and outcomes["bad"][1] > 0.95
    # One window of all one gear permutes to itself: nothing to tell apart.
    same = permutation.random_distribution(_policy("l" * 100 + "h" * 100), rows, 100, permutations=20)
    assert same["outcome"] == "indistinguishable" and same["difference"]["median"] == 0.0
    with pytest.raises(ValueError, match="must divide"):
        permutation.random_distribution(_policy("l" * 200), rows, 30)


@pytest.mark.parametrize("positions", [64, 128, 512])
def test_with_no_real_difference_a_verdict_comes_at_most_at_its_level(positions):
    """Rows of the same distribution, 400 trials: the paired bootstrap may call a difference in
    about 5% of them. Over 2 or 4 blocks it called one in 55% and 19% (too few distinct
    resamples); those now get no verdict, and 16 blocks stay near the level."""
    rng = np.random.default_rng(positions)
    called = 0
    for trial in range(400):
        a, b = rng.exponential(1e-3, positions), rng.exponential(1e-3, positions)
        test = significance.paired_difference(a, b, positions, seed=trial, settings=significance.BootstrapSettings(
            resamples=400))
        called += test["outcome"] != "indistinguishable"
        if test["blocks"] < significance.MIN_BLOCKS:
            assert "too_few_blocks" in test and "no verdict" in significance.describe(test)
    assert called / 400 <= 0.08, called


def test_a_text_shorter_than_tokens_says_what_is_scored(spread_model):
    """--tokens 200 of a 60-token text scored 59 positions with only the JSON saying so."""
    said = []
    text = "".join(chr(32 + (i * 37) % 90) for i in range(60))
    evaluate(spread_model, ByteTokenizer(bos=1), text, base_specs(SPREAD)[:1], tokens=200, window=50,
             speed_tokens=0, workload_tokens=0, speculative=False, seed=5, progress=said.append)
    notes = [m for m in said if "for --tokens 200" in m]
    assert len(notes) == 1 and "scoring 50 (1 window(s) of 50" in notes[0], said
