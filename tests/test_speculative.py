"""Self-speculative decoding: exactness (greedy and sampled), cache rollback, bad input."""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, List, Sequence

import mlx.core as mx
import pytest
from conftest import make_tiny_llama
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from gearbx_mlx.chat import apply_chat_template
from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.entropy import EntropyMonitor
from gearbx_mlx.gearbox import Gearbox
from gearbx_mlx.pipeline import stream_speculative_generate
from gearbx_mlx.speculative.acceptance import accept_block, make_log_dist
from gearbx_mlx.speculative.calibration import auc, draft_stats, replay_speedup
from gearbx_mlx.speculative.decode import (
    SpeculativeConfig,
    SpeculativeStats,
    speculative_generate_step,
)
from gearbx_mlx.speculative.draft import build_draft

VOCAB = 64
PROMPT = [1, 2, 3, 4, 5]


def chaotic_llama(seed: int = 0):
    """A tiny llama whose greedy output varies and whose 4-bit copy disagrees
    with it at about half the positions (weights of the layers scaled by 3)."""
    m = make_tiny_llama(vocab=VOCAB, hidden=64, seed=seed)
    m.model.update({"layers": tree_map(lambda a: 3 * a, m.model.parameters()["layers"])})
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def tiny():
    m = chaotic_llama()
    gb = Gearbox(m, GearboxConfig(scope="all"), vocab_size=VOCAB)
    return m, gb, build_draft(m, gb, "low")


def greedy_reference(model, prompt: Sequence[int], n: int) -> List[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(t) for (t, _), _ in zip(steps, range(n))]


def run(model, draft, config, n, prompt=PROMPT, monitor=None, **kw) -> List[int]:
    return [i.token for i in speculative_generate_step(
        mx.array(prompt), model, draft, config, max_tokens=n, monitor=monitor, **kw)]


# -- greedy exactness --------------------------------------------------------------


#: Block settings every greedy-exactness test runs.
GREEDY_CONFIGS = [
    SpeculativeConfig(max_draft=1),
    SpeculativeConfig(max_draft=3),
    SpeculativeConfig(max_draft=6, draft_entropy_stop=1.5),
    SpeculativeConfig(max_draft=4, draft_entropy_stop=0.0),  # every block ends after one draft
    SpeculativeConfig(max_draft=4, hard_max_draft=0, draft_entropy_stop=3.0),
]
GREEDY_IDS = ["k1", "k3", "k6-stop", "stop-all", "hard-cap-0"]


@pytest.mark.parametrize("config", GREEDY_CONFIGS, ids=GREEDY_IDS)
def test_greedy_output_is_the_high_gears_on_a_tiny_model(tiny, config):
    model, gb, draft = tiny
    want = greedy_reference(model, PROMPT, 40)
    stats = SpeculativeStats()
    monitor = EntropyMonitor(VOCAB, gb.config, (0.5, 1.0))  # low thresholds: the cap engages
    got = run(model, draft, config, 40, monitor=monitor, stats=stats)
    assert got == want
    assert 0 < stats.accepted < stats.drafted  # both paths (accept and reject) were taken
    assert stats.tokens == 40


def test_mid_drafter_and_max_tokens_inside_a_block(tiny):
    model, gb, _ = tiny
    mid = build_draft(model, gb, "mid")
    for n in (1, 2, 5, 7):
        assert run(model, mid, SpeculativeConfig("mid", max_draft=4), n) == greedy_reference(model, PROMPT, n)


#: Chat prompts of the default-model exactness tests (the host drafter's test runs them too).
DEFAULT_MODEL_PROMPTS = ["Write the days of the week in order, separated by commas.",
                         "Prove that the square root of 2 is irrational, step by step."]
#: Tokens each default-model exactness run compares: exactness holds token by token, and 12
#: tokens are three or more blocks of every config below (each block verifies and trims).
DEFAULT_MODEL_TOKENS = 12
#: The default-model exactness tests share their high-gear references: one worker runs both.
DEFAULT_MODEL_GROUP = pytest.mark.xdist_group("speculative-default-model")


@pytest.fixture(scope="module")
def high_greedy(default_model):
    """``(ids, n) -> the high gear's greedy tokens``, each reference decoded once per module."""
    model = default_model[0]
    memo: Dict[tuple, List[int]] = {}

    def reference(ids: Sequence[int], n: int) -> List[int]:
        key = (tuple(ids), n)
        if key not in memo:
            memo[key] = greedy_reference(model, ids, n)
        return memo[key]

    return reference


@DEFAULT_MODEL_GROUP
@pytest.mark.slow
def test_greedy_identical_on_the_default_model(default_model, high_greedy):
    """Two prompts x 12 tokens: the 4-bit drafter in fixed blocks and in gated blocks, and the
    8-bit one, each token for token the high gear's."""
    from gearbx_mlx.chat import encode_chat

    model, tok, gearbox = default_model
    n = DEFAULT_MODEL_TOKENS
    runs = [(DEFAULT_MODEL_PROMPTS[0], SpeculativeConfig(max_draft=4)),
            (DEFAULT_MODEL_PROMPTS[1], SpeculativeConfig(max_draft=6, draft_entropy_stop=2.0)),
            (DEFAULT_MODEL_PROMPTS[0], SpeculativeConfig("mid", max_draft=4))]
    accepted = 0
    for text, config in runs:
        ids = encode_chat(tok, text)
        want = high_greedy(ids, n)
        got = []
        for r in stream_speculative_generate(model, tok, ids, gearbox, config=config, max_tokens=n):
            got.append(r.token)
            accepted += r.accepted if config.draft_gear == "low" else 0
        assert got == want[: len(got)], (text, config)
        assert len(got) == n or got[-1] in tok.eos_token_ids
    assert accepted > 0


# -- cache rollback ------------------------------------------------------------------


def test_caches_are_rolled_back_consistently(tiny):
    """After a run, the high cache holds what a plain high run's holds (prompt and
    all generated tokens but the last), and the drafter's holds no more."""
    model, _, draft = tiny
    n = 23
    hcache, dcache = make_prompt_cache(model), make_prompt_cache(draft)
    got = run(model, draft, SpeculativeConfig(max_draft=4), n, prompt_cache=hcache, draft_cache=dcache)
    plain = make_prompt_cache(model)
    want = [int(t) for (t, _), _ in zip(generate_step(mx.array(PROMPT), model, max_tokens=n,
                                                        prompt_cache=plain), range(n))]
    assert got == want
    length = len(PROMPT) + n - 1
    assert all(c.offset == length for c in hcache)
    assert all(c.offset <= length for c in dcache)
    for mine, ref in zip(hcache, plain):
        for a, b in zip(mine.keys_and_values(), ref.keys_and_values()):
            assert mx.allclose(a[..., :length, :], b[..., :length, :], atol=1e-4, rtol=1e-4).item()
    # The next token from the kept cache is the high gear's next token.
    nxt = model(mx.array([[got[-1]]]), cache=hcache)[0, -1]
    assert int(mx.argmax(nxt).item()) == greedy_reference(model, PROMPT, n + 1)[-1]


def test_early_stop_by_the_consumer_trims_too(tiny):
    model, _, draft = tiny
    hcache = make_prompt_cache(model)
    steps = speculative_generate_step(mx.array(PROMPT), model, draft, SpeculativeConfig(max_draft=6),
                                      max_tokens=50, prompt_cache=hcache)
    got = [next(steps).token for _ in range(3)]
    steps.close()
    assert all(c.offset == len(PROMPT) + len(got) - 1 for c in hcache)


# -- the acceptance rule -------------------------------------------------------------


def test_accept_block_greedy_rule():
    logits = mx.array([[0.0, 5, 0], [3, 0, 0], [0, 0, 9]])  # argmax 1, 0, 2
    n, t = accept_block(logits, mx.array([1, 0]), None, None)
    assert (n.item(), t.item()) == (2, 2)  # both accepted, bonus 2
    n, t = accept_block(logits, mx.array([1, 2]), None, None)
    assert (n.item(), t.item()) == (1, 0)  # second rejected, replaced by 0


def test_accept_block_sampling_edge_cases():
    mx.random.seed(0)
    log_dist = make_log_dist(temp=1.0)
    logits = mx.log(mx.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]) + 1e-30)
    same = log_dist(logits[:1])
    for _ in range(20):  # q == p: always accepted
        n, _ = accept_block(logits, mx.array([1]), same, log_dist)
        assert n.item() == 1
    q_bad = mx.log(mx.array([[0.0, 0.0, 1.0]]) + 1e-30)  # drafts a token p gives no mass
    for _ in range(20):
        n, t = accept_block(logits, mx.array([2]), q_bad, log_dist)
        assert n.item() == 0 and t.item() in (0, 1)  # resampled from max(0, p - q)


def chi2_pvalue(stat: float, dof: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty normal approximation)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2(counts: Counter, probs: Dict[int, float], n: int) -> float:
    """p-value of ``counts`` under ``probs``; cells expecting < 5 are pooled."""
    big = [t for t, p in probs.items() if p * n >= 5]
    obs = [counts.get(t, 0) for t in big] + [n - sum(counts.get(t, 0) for t in big)]
    exp = [probs[t] * n for t in big] + [n * (1 - sum(probs[t] for t in big))]
    if exp[-1] < 5:  # too little left to pool: merge into the last big cell
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return chi2_pvalue(stat, len(obs) - 1)


def exact_marginals(model, prompt: Sequence[int], temp: float, depth: int) -> List[Dict[int, float]]:
    """Exact marginal distribution of each of the first ``depth`` sampled tokens."""
    log_dist = make_log_dist(temp)
    paths = {(): 1.0}
    out = []
    for _ in range(depth):
        seqs = list(paths)
        x = mx.array([list(prompt) + list(s) for s in seqs])
        probs = mx.exp(log_dist(model(x)[:, -1, :])).tolist()
        marginal: Dict[int, float] = {}
        nxt: Dict[tuple, float] = {}
        for s, row in zip(seqs, probs):
            for t, p in enumerate(row):
                w = paths[s] * p
                marginal[t] = marginal.get(t, 0.0) + w
                if w > 1e-6:
                    nxt[s + (t,)] = w
        out.append(marginal)
        paths = nxt
    return out


def test_sampling_matches_the_high_gears_distribution(tiny):
    """The first three tokens of many seeded runs follow the high gear's exact
    marginals (chi-square), and not the drafter's (the test has power)."""
    model, _, draft = tiny
    temp, n_runs = 1.0, 400  # the drafter's law is told apart at p ~ 1e-22 (1e-56 at 1000 runs)
    want = exact_marginals(model, PROMPT, temp, 3)
    q_first = exact_marginals(draft, PROMPT, temp, 1)[0]
    mx.random.seed(1234)
    log_dist = make_log_dist(temp)
    counts = [Counter() for _ in range(3)]
    stats = SpeculativeStats()
    for _ in range(n_runs):
        toks = run(model, draft, SpeculativeConfig(max_draft=2), 3, log_dist=log_dist, stats=stats)
        for i, t in enumerate(toks):
            counts[i][t] += 1
    assert 0 < stats.accepted < stats.drafted
    for i in range(3):
        assert chi2(counts[i], want[i], n_runs) > 1e-3, f"token {i + 1}"
    assert chi2(counts[0], q_first, n_runs) < 1e-6  # the drafter's own law is told apart


# -- drafter, measurement, bad input -------------------------------------------------


def test_draft_shares_every_unmanaged_array(tiny):
    model, gb, draft = tiny
    managed = set(draft.paths)
    high = dict(model.named_modules())
    low = dict(draft.module.named_modules())
    for path, m in high.items():
        on_the_way = path == "" or any(p.startswith(path + ".") for p in managed)
        if path in managed:
            assert low[path] is not m  # a quantized copy; the model keeps its own
        elif not on_the_way:
            assert low[path] is m, path  # norms, RoPE, unmanaged layers: the same objects
    mem = draft.memory
    assert mem["shared_bytes"] > 0
    assert mem["resident_total"] == mem["high_bytes"] + mem["store_bytes"] + mem["extra_bytes"]
    assert mem["store_bytes"] + mem["extra_bytes"] == mem["managed_draft_bytes"]  # the low copy, once


@pytest.mark.parametrize("high", ["original", "planes"])
def test_a_nested_store_drafts_from_its_own_planes_at_no_memory_cost(high):
    model = make_tiny_llama(vocab=VOCAB, hidden=64, seed=3)
    gb = Gearbox(model, GearboxConfig(scope="all", store="nested", high=high), vocab_size=VOCAB)
    before = gb.manager.memory()["resident_total"]
    draft = build_draft(model, gb, "low", scope="all")
    assert draft.memory["extra_bytes"] == 0 and gb.manager.memory()["resident_total"] == before
    low = gb.manager.cache["low"]
    mods = dict(draft.module.named_modules())
    assert all(mods[p] is low[p] for p in draft.paths)  # the store's own views
    # Greedy speculative output is the high gear's, token for token.
    ref = greedy_reference(model, PROMPT, 12)
    assert run(model, draft, SpeculativeConfig(max_draft=3), 12) == ref


def test_draft_stats_and_auc(tiny):
    model, _, draft = tiny
    seq = PROMPT + greedy_reference(model, PROMPT, 20)
    st = draft_stats(model, draft, seq, window=16)
    assert st.n == len(seq)
    s = st.summary()
    assert 0 < s["alpha_greedy"] < 1 and 0 < s["alpha_sampled"] <= 1
    assert auc([1, 2, 3, 4], [False, False, True, True]) == 1.0
    assert auc([1, 1, 1, 1], [False, True, False, True]) == 0.5
    assert math.isnan(auc([1, 2], [True, True]))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_draft": 0}, "max_draft must be an integer from 1 to 64"),
    ({"max_draft": 10**20}, "max_draft must be an integer from 1 to 64"),
    ({"max_draft": 2.5}, "max_draft must be an integer from 1 to 64"),
    ({"draft_gear": "high"}, "high gear verifies"),
    ({"draft_entropy_stop": -1.0}, "draft_entropy_stop"),
    ({"hard_max_draft": 9, "max_draft": 4}, "hard_max_draft"),
    ({"draft_scope": "mlp"}, "draft_scope"),
])
def test_bad_config_is_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


def test_bad_input_through_the_api(tiny):
    model, gb, _ = tiny
    with pytest.raises(ValueError, match="high gear verifies"):
        build_draft(model, gb, "high")
    with pytest.raises(ValueError, match="max_draft"):
        next(stream_speculative_generate(model, _NoTokenizer(), [1, 2], gb, max_draft=0))
    with pytest.raises(ValueError, match="temp"):
        make_log_dist(temp=-1.0)


class _NoTokenizer:
    """Never reached: the config is checked first."""


def test_cli_rejects_bad_speculative_flags(capsys):
    from gearbx_mlx.generate import main

    for argv in (["--speculative", "--max-draft", "0"], ["--speculative", "--max-draft", str(10**20)],
                 ["--speculative", "--draft-gear", "high"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert "--max-draft: expected an integer from 1 to 64, got 100000000000000000000" in capsys.readouterr().err
    assert main(["--speculative", "--max-kv-size", "64", "--prompt", "hi"]) == 1
    assert "cannot be combined with --speculative" in capsys.readouterr().err


# -- calibration of the drafter: replay, saved block, CLI resolution ------------------


def test_replay_speedup_counts_tokens_and_cost():
    assert replay_speedup([True] * 40, [0.0] * 40, 0.5, 3) == pytest.approx(40 / (10 * 2.5))
    # Every draft rejected: 4 wasted drafts a block (fewer in the last three blocks).
    assert replay_speedup([False] * 10, [1.0] * 10, 0.5, 4) == pytest.approx(10 / (7 * 3 + 2.5 + 2 + 1.5))
    assert replay_speedup([False] * 10, [1.0] * 10, 0.5, 4, stop=0.5) == pytest.approx(1 / 1.5)
    assert replay_speedup([True] * 8, [0.0] * 8, 0.0, 1, verify_cost=[1.0, 2.0]) == pytest.approx(1.0)


def test_best_replay_prefers_long_blocks_for_a_good_drafter_and_stops_a_bad_one():
    from gearbx_mlx.speculative.calibration import DraftStats, best_replay

    good = DraftStats([1.0] * 60, [1.0] * 60, [True] * 60, [1.0] * 60)
    r = best_replay(good, cost=0.2)
    assert r["stop_bits"] is None and r["max_draft"] == 8 and r["replayed_speedup"] > 3
    # Agrees only where its entropy is low: the best rule stops at high entropy.
    import random

    rng = random.Random(0)
    ent = [6.0 if rng.random() < 0.3 else 0.5 for _ in range(200)]
    bad = DraftStats(ent, ent, [h < 1 for h in ent], [1.0] * len(ent))
    r = best_replay(bad, cost=0.2)
    assert r["stop_bits"] is not None and r["stop_bits"] < 6.0
    assert r["replayed_speedup"] > r["best_fixed_speedup"]


def test_calibration_file_keeps_the_speculative_block(tmp_path):
    from gearbx_mlx.calibration import Calibration

    cal = Calibration(low=1.0, high=3.0, strategy="median", n_samples=10, vocab_size=VOCAB)
    cal.extra["speculative"] = {"low": {"stop_bits": 2.5, "max_draft": 3}}
    back = Calibration.load(cal.save(tmp_path / "c.json"))
    assert back.extra["speculative"]["low"] == {"stop_bits": 2.5, "max_draft": 3}


def test_cli_config_takes_flags_then_calibration_then_defaults(tiny):
    from types import SimpleNamespace

    from gearbx_mlx.calibration import Calibration
    from gearbx_mlx.generate import build_parser
    from gearbx_mlx.speculative.cli import speculative_config

    cal = Calibration(low=1.0, high=3.0, strategy="median", n_samples=10, vocab_size=VOCAB,
                      extra={"speculative": {"low": {"stop_bits": 2.5, "max_draft": 3}}})
    box = SimpleNamespace(calibration=cal)
    parse = build_parser().parse_args
    c = speculative_config(parse(["--speculative"]), box)
    assert (c.max_draft, c.draft_entropy_stop) == (3, 2.5)
    # the decision chooses among fixed and gated blocks with the saved stop as a candidate: a saved stop
    # forced gated blocks of 1 at a modeled 1.13x where fixed blocks of 4 modeled 1.42x
    from gearbx_mlx.speculative.plan import CHOOSE
    assert c.plan_options == {"stop": CHOOSE}
    c = speculative_config(parse(["--speculative", "--draft-entropy-stop", "2.0"]), box)
    assert c.draft_entropy_stop == 2.0 and "stop" not in c.plan_options  # a flag's stop is kept
    c = speculative_config(parse(["--speculative", "--max-draft", "5", "--draft-entropy-stop", "off"]), box)
    assert (c.max_draft, c.draft_entropy_stop) == (5, None)
    c = speculative_config(parse(["--speculative", "--draft-gear", "mid"]), box)  # no mid block saved
    assert (c.max_draft, c.draft_entropy_stop) == (SpeculativeConfig.max_draft, None)


@pytest.mark.slow
def test_cli_speculative_prints_the_high_gears_text_and_a_valid_trace(tmp_path, default_model):
    import subprocess
    import sys

    from mlx_lm import generate as mlx_generate

    from gearbx_mlx.telemetry.trace import read_trace

    model, tok, _ = default_model
    text = "List three colours of the rainbow."
    prompt = apply_chat_template(tok, text)
    # 8 tokens, and a block cap of 2: the start-of-run decision times a verify of k + 1 tokens
    # for every k up to the cap (8 rounds each), which dominated this command's time at a cap of 3
    want = mlx_generate(model, tok, prompt, max_tokens=8)
    trace = tmp_path / "t.jsonl"
    p = subprocess.run([sys.executable, "-m", "gearbx_mlx.generate", "--prompt", text, "--max-tokens", "8",
                        "--speculative", "--draft-gear", "mid", "--max-draft", "2", "--trace", str(trace)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == want
    assert "acceptance" in p.stderr and "Resident:" in p.stderr
    t = read_trace(trace)
    assert t.header["policy"] == "speculative" and t.summary["generation_tokens"] == len(t.tokens)
    assert all(r["verified_by"] == "high" and r["drafted"] <= 2 for r in t.tokens)
    assert sum(r["accepted"] for r in t.tokens) == t.summary["speculative"]["accepted"]


# -- the host drafter (numpy around the packed C kernels, CPU) -----------------------


def _host_or_skip(model, gb, gear="low", **kw):
    from gearbx_mlx.bindings import cpu

    if mx.default_device() != mx.cpu or not cpu.available():
        pytest.skip("the host drafter needs the CPU device and the C kernels")
    d = build_draft(model, gb, gear, **kw)
    assert d.host is not None
    return d


@pytest.fixture(scope="module")
def tiny_host():
    m = chaotic_llama()
    gb = Gearbox(m, GearboxConfig(scope="all", kernel="packed"), vocab_size=VOCAB)
    return m, gb, _host_or_skip(m, gb)


@pytest.mark.parametrize("scope", ["all", "attention"])
def test_host_forward_matches_the_mlx_tree(monkeypatch, scope):
    """Same logits as the drafter's MLX tree, one token at a time, with the
    float-activation GEMV (the int8-activation one rounds chaotically apart)."""
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from gearbx_mlx.packed import layers

    monkeypatch.setattr(layers, "CPU_GEMV_PATH", "float")
    m = make_tiny_llama(vocab=VOCAB, hidden=64, seed=3)
    gb = Gearbox(m, GearboxConfig(scope=scope, kernel="packed"), vocab_size=VOCAB)
    d = _host_or_skip(m, gb)
    hc, mc = d.make_cache(), [KVCache() for _ in d.module.layers]
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    for t in seq:
        a = np.asarray(d(mx.array([[t]]), cache=hc))[0, -1]
        b = np.asarray(d(mx.array([[t]]), cache=mc))[0, -1]
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    many = np.asarray(d(mx.array([seq]), cache=d.make_cache()))[0, -1]  # multi-token call
    np.testing.assert_allclose(many, a, atol=1e-5, rtol=1e-5)
    assert all(c.offset == len(seq) for c in hc)
    # A long input goes through the MLX tree once; the host cache continues from it.
    from gearbx_mlx.speculative import draft as draft_mod

    monkeypatch.setattr(draft_mod, "HOST_PREFILL_MAX", 4)
    pc = d.make_cache()
    d(mx.array([seq[:6]]), cache=pc)
    assert all(c.offset == 6 for c in pc)
    for t in seq[6:]:
        last = np.asarray(d(mx.array([[t]]), cache=pc))[0, -1]
    np.testing.assert_allclose(last, a, atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(pc[1].keys[:, :8], hc[1].keys[:, :8], atol=1e-4, rtol=1e-4)


def test_draft_statistics_are_the_same_row_by_row_and_hold_no_full_size_temporaries(monkeypatch):
    from gearbx_mlx.speculative import calibration

    mx.random.seed(7)
    rows, vocab = 40, 5000
    high = mx.random.normal((rows, vocab)) * 3
    low = high + mx.random.normal((rows, vocab))
    mx.eval(high, low)
    monkeypatch.setattr(calibration, "COMPARE_ROWS", rows)
    whole = calibration.compare_logits(high, low)
    monkeypatch.setattr(calibration, "COMPARE_ROWS", 8)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    chunked = calibration.compare_logits(high, low)
    # Compared whole, the softmaxes and entropies held about ten (rows, V) float32 arrays at once.
    assert mx.get_peak_memory() - base < 3 * rows * vocab * 4
    for name in ("draft_entropy", "high_entropy", "agree", "accept_prob"):
        assert getattr(chunked, name) == getattr(whole, name), name


def _tiny_qwen2(seed: int = 4):
    """A small mlx-lm qwen2 (llama with q/k/v biases), its biases far from zero."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen2

    mx.random.seed(seed)
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
                           tie_word_embeddings=False)
    model = qwen2.Model(args)
    biases = [(k, mx.random.normal(v.shape) * 0.5) for k, v in tree_flatten(model.parameters()) if k.endswith("bias")]
    model.update(tree_unflatten(biases))
    mx.eval(model.parameters())
    return model


def test_host_forward_of_qwen2_adds_its_biases_like_the_mlx_tree(monkeypatch):
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from gearbx_mlx.packed import layers

    monkeypatch.setattr(layers, "CPU_GEMV_PATH", "float")
    m = _tiny_qwen2()
    gb = Gearbox(m, GearboxConfig(scope="all", kernel="packed"), vocab_size=VOCAB)
    d = _host_or_skip(m, gb)
    hc, mc = d.make_cache(), [KVCache() for _ in d.module.layers]
    for t in [3, 1, 4, 1, 5, 9, 2, 6]:
        a = np.asarray(d(mx.array([[t]]), cache=hc))[0, -1]
        b = np.asarray(d(mx.array([[t]]), cache=mc))[0, -1]
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    model = _tiny_qwen2()
    draft = _host_or_skip(model, Gearbox(model, GearboxConfig(scope="all", kernel="packed"), vocab_size=VOCAB))
    prompt = [5, 17, 3, 42, 8]
    assert run(model, draft, SpeculativeConfig(max_draft=4), 12, prompt) == greedy_reference(model, prompt, 12)


def test_host_cache_grows_and_trims(monkeypatch, tiny_host):
    import numpy as np

    from gearbx_mlx.speculative.draft import HostKVCache

    monkeypatch.setattr(HostKVCache, "step", 4)
    _, _, d = tiny_host
    seq = list(range(1, 12))
    grown = d.make_cache()
    full = np.asarray(d(mx.array([seq]), cache=grown))
    assert grown[0].keys.shape[1] == 12 and grown[0].offset == 11
    assert grown[0].trim(3) == 3 and grown[0].offset == 8
    for c in grown[1:]:
        c.trim(3)
    again = np.asarray(d(mx.array([seq[8:]]), cache=grown))
    np.testing.assert_array_equal(again[0], full[0, 8:])
    with pytest.raises(ValueError, match="host"):  # a drafter without the host forward
        build_draft(*tiny_host[:2], "low", host=False)(mx.array([[1]]), cache=grown)


@pytest.mark.parametrize("config", GREEDY_CONFIGS, ids=GREEDY_IDS)
def test_greedy_output_is_the_high_gears_with_the_host_drafter(tiny_host, config):
    model, gb, draft = tiny_host
    want = greedy_reference(model, PROMPT, 40)
    stats = SpeculativeStats()
    monitor = EntropyMonitor(VOCAB, gb.config, (0.5, 1.0))
    got = run(model, draft, config, 40, monitor=monitor, stats=stats, single_token_drafts=True)
    assert got == want
    assert 0 < stats.accepted < stats.drafted
    if config.draft_entropy_stop == 0.0:
        assert all(b.drafted <= 1 for b in stats.blocks)


def test_host_drafter_cache_is_rolled_back(tiny_host):
    """The drafter's host cache after a run equals a fresh one fed the kept tokens."""
    import numpy as np

    model, _, draft = tiny_host
    n = 23
    dcache = make_prompt_cache(draft)
    got = run(model, draft, SpeculativeConfig(max_draft=4), n, draft_cache=dcache)
    kept = dcache[0].offset
    assert kept <= len(PROMPT) + n - 1 and all(c.offset == kept for c in dcache)
    fresh = make_prompt_cache(draft)
    draft(mx.array([(PROMPT + got)[:kept]]), cache=fresh)
    for a, b in zip(dcache, fresh):
        np.testing.assert_array_equal(a.keys[:, :kept], b.keys[:, :kept])
        np.testing.assert_array_equal(a.values[:, :kept], b.values[:, :kept])


def test_sampling_through_a_host_cache(tiny_host):
    """temp > 0 drafts through the MLX loop, on the host cache; tokens stay in the vocabulary."""
    model, _, draft = tiny_host
    mx.random.seed(0)
    got = run(model, draft, SpeculativeConfig(max_draft=3), 12, log_dist=make_log_dist(1.0),
              single_token_drafts=True)
    assert len(got) == 12 and all(0 <= t < VOCAB for t in got)


def test_numpy_entropy_matches_entropy_bits():
    import numpy as np

    from gearbx_mlx.entropy import entropy_bits, entropy_bits_np

    rng = np.random.default_rng(0)
    for scale in (0.1, 3.0, 30.0):
        z = (rng.standard_normal(1000) * scale).astype(np.float32)
        assert entropy_bits_np(z) == pytest.approx(entropy_bits(mx.array(z)).item(), abs=1e-4)
    z[3] = np.inf
    assert 0.0 <= entropy_bits_np(z) <= math.log2(z.size)


@DEFAULT_MODEL_GROUP
@pytest.mark.slow
def test_greedy_identical_on_the_default_model_with_the_host_drafter(default_model, high_greedy):
    """The host drafter in fixed and in gated blocks, token for token the high gear's."""
    from gearbx_mlx.chat import encode_chat

    model, tok, loaded = default_model
    # the nested planes of scope all come from the disk cache beside the model (built once per machine)
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="packed"), planes_dir=loaded.manager.planes_dir)
    draft = _host_or_skip(model, gb)
    configs = [SpeculativeConfig(max_draft=4), SpeculativeConfig(max_draft=6, draft_entropy_stop=2.0)]
    n = DEFAULT_MODEL_TOKENS
    accepted = 0
    for text, config in zip(DEFAULT_MODEL_PROMPTS, configs):
        ids = encode_chat(tok, text)
        want = high_greedy(ids, n)
        got = []
        for r in stream_speculative_generate(model, tok, ids, gb, config=config, draft=draft, max_tokens=n):
            got.append(r.token)
            accepted += r.accepted
        assert got == want[: len(got)], text
        assert len(got) == n or got[-1] in tok.eos_token_ids
    assert accepted > 0


@pytest.mark.parametrize("host", [False, True], ids=["mlx-tree", "host-step"])
def test_a_drafter_equal_to_the_high_gear_has_every_draft_accepted(host):
    """Every draft of the high gear's own weights is accepted, block after block:
    the drafter's context is rolled back to exactly the emitted tokens (a gap
    or a repeat after a fully accepted block would make drafts diverge)."""
    from gearbx_mlx.speculative.draft import DraftModel, attach_host

    model = chaotic_llama()
    same = DraftModel(model, "low", 32, "all", [], kernel="packed" if host else "mlx")
    if host:
        _host_or_skip(model, Gearbox(model, GearboxConfig(scope="all", kernel="packed"), vocab_size=VOCAB))
        attach_host(same, True)
    stats = SpeculativeStats()
    got = run(model, same, SpeculativeConfig(max_draft=4), 30, stats=stats, single_token_drafts=True)
    assert got == greedy_reference(model, PROMPT, 30)
    assert stats.drafter["path"] == ("host" if host else "mlx")
    assert stats.accepted == stats.drafted == 24  # 6 blocks of 4 drafts and a bonus each


@pytest.mark.parametrize("gear", ["low", "mid"])
def test_host_forward_reads_the_nested_planes_in_place(gear):
    """The CPU host step of a nested store's drafter runs the same C kernels on the
    store's planes as the MLX tree's views: the same logits, token by token."""
    import numpy as np
    from mlx_lm.models.cache import KVCache

    m = make_tiny_llama(vocab=VOCAB, hidden=64, seed=3)
    gb = Gearbox(m, GearboxConfig(scope="all", kernel="packed", store="nested"), vocab_size=VOCAB)
    d = build_draft(m, gb, gear, scope="all")
    if d.host is None:
        pytest.skip(f"the host step does not apply here: {d.host_reason}")
    assert d.memory["extra_bytes"] == 0
    hc, mc = d.make_cache(), [KVCache() for _ in d.module.layers]
    for t in [3, 1, 4, 1, 5, 9, 2, 6]:
        a = np.asarray(d(mx.array([[t]]), cache=hc))[0, -1]
        b = np.asarray(d(mx.array([[t]]), cache=mc))[0, -1]
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_generation_rate_counts_the_time_of_the_block_that_brought_the_first_token(tiny, monkeypatch):
    """A drafted block hands its tokens out together. Timing generation from the
    first token would count that block's other tokens as free: three tokens of one
    block would read as thousands of tokens/s. The rate is timed from the block's start."""
    import time

    from conftest import make_tiny_tokenizer

    from gearbx_mlx.speculative import decode

    model, gb, draft = tiny
    verdicts = decode.read_verdict
    calls: List[int] = []

    def slow_first_verify(*args, **kwargs):
        if not calls:
            time.sleep(0.4)  # inside the first block's timed span
        calls.append(1)
        return verdicts(*args, **kwargs)

    monkeypatch.setattr(decode, "read_verdict", slow_first_verify)
    config = SpeculativeConfig(max_draft=4)  # the first block: 2 drafts and the high gear's token, all 3
    out = list(stream_speculative_generate(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, config=config,
                                           draft=draft, max_tokens=3))
    assert len(out) == 3 and out[0].drafted == 2 and len(calls) == 1
    last = out[-1]
    assert last.generation_tokens / last.generation_tps >= 0.4
    assert len(PROMPT) / last.prompt_tps < 0.4  # the block is not the prompt's time
