"""Draft paths and the decision to draft: which drafter runs and why, the
measured costs at start, decoding plainly where drafting cannot pay."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_llama
from mlx.utils import tree_map
from mlx_lm.generate import generate_step

from gearbx_mlx.bindings import cpu
from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.gearbox import Gearbox
from gearbx_mlx.pipeline import stream_speculative_generate
from gearbx_mlx.speculative import plan as plan_mod
from gearbx_mlx.speculative.acceptance import make_log_dist
from gearbx_mlx.speculative.calibration import (
    REPLAY_MAX_DRAFT,
    DraftStats,
    calibrate_draft_stop,
    gated_speedup,
    gating_table,
    modeled_speedup,
)
from gearbx_mlx.speculative.cli import speculative_lines
from gearbx_mlx.speculative.decode import (
    SpeculativeConfig,
    SpeculativeStats,
    speculative_generate_step,
)
from gearbx_mlx.speculative.draft import build_draft
from gearbx_mlx.speculative.drafter import make_drafter
from gearbx_mlx.speculative.plan import (
    FALLBACK_ALPHA,
    GATED_MARGIN,
    MIN_MODELED_SPEEDUP,
    StartMeasurement,
    measure_start,
    plan_speculative,
)

VOCAB = 64
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def scaled(model):
    """Layers' weights times 3: greedy output varies, the 4-bit copy disagrees often."""
    model.model.update({"layers": tree_map(lambda a: 3 * a, model.model.parameters()["layers"])})
    mx.eval(model.parameters())
    return model


def tiny_qwen3(seed: int = 0):
    """A tiny mlx-lm qwen3 (norms on the queries and keys): a model the host step does not cover."""
    from mlx_lm.models import qwen3

    mx.random.seed(seed)
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=VOCAB, num_key_value_heads=2,
                           max_position_embeddings=512, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0)
    m = qwen3.Model(args)
    m.update({"model": {"embed_tokens": {"weight": mx.random.normal((VOCAB, 64)) * 0.5}}})
    mx.eval(m.parameters())
    return scaled(m)


def greedy_reference(model, prompt, n):
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def needs_host():
    if mx.default_device() != mx.cpu or not cpu.available():
        pytest.skip("the host drafter needs the CPU device and the C kernels")


@pytest.fixture(scope="module")
def llama_packed():
    m = scaled(make_tiny_llama(vocab=VOCAB, hidden=64, seed=0))
    gb = Gearbox(m, GearboxConfig(scope="all", kernel="packed"), vocab_size=VOCAB)
    return m, gb, build_draft(m, gb, "low")


# -- which path drafts, and why ------------------------------------------------------


def test_paths_and_reasons_on_llama(llama_packed):
    needs_host()
    model, gb, draft = llama_packed
    host = make_drafter(draft).describe()
    assert host["path"] == "host" and "C GEMV" in host["detail"] and host["reason"] is None
    sampled = make_drafter(draft, log_dist=make_log_dist(1.0)).describe()
    assert sampled["path"] == "mlx" and "sampling" in sampled["reason"]
    mlx_box = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=VOCAB)
    tree = make_drafter(build_draft(model, mlx_box, "low")).describe()
    assert tree["path"] == "mlx" and "'mlx'" in tree["reason"] and "--kernel packed" in tree["reason"]
    assert make_drafter(None).describe()["path"] == "none"


def test_a_model_the_host_step_does_not_cover_drafts_through_the_tree_exactly():
    """qwen3 with the packed kernel: the MLX tree drafts, the reason names the
    architecture, and greedy output is still the high gear's."""
    model = tiny_qwen3()
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="packed"), vocab_size=VOCAB)
    draft = build_draft(model, gb, "low")
    assert draft.host is None
    if mx.default_device() == mx.cpu and cpu.available():
        assert "'qwen3'" in draft.host_reason and "llama and qwen2 only" in draft.host_reason
    stats = SpeculativeStats()
    got = [t.token for t in speculative_generate_step(mx.array(PROMPT), model, draft, SpeculativeConfig(max_draft=3),
                                                      max_tokens=24, stats=stats, single_token_drafts=True)]
    assert got == greedy_reference(model, PROMPT, 24)
    assert stats.drafter["path"] == "mlx" and stats.drafter["reason"] == draft.host_reason
    assert 0 < stats.accepted < stats.drafted
    with pytest.raises(ValueError, match="qwen2 only|CPU|not built"):
        build_draft(model, gb, "low", host=True)


def test_plain_decoding_is_the_high_gears_with_no_drafts(llama_packed):
    model, gb, draft = llama_packed
    tok = CharTokenizer()
    got = list(stream_speculative_generate(model, tok, PROMPT, gb, draft=draft, plain=True, max_tokens=12))
    assert [r.token for r in got] == greedy_reference(model, PROMPT, 12)
    assert all(r.drafted == 0 and not r.accepted and r.gear == "high" for r in got)
    s = got[-1].stats
    assert s.drafter["path"] == "none" and len(s.blocks) == 12 and s.drafted == 0


# -- the decision ---------------------------------------------------------------------


def test_modeled_speedup_closed_form():
    assert modeled_speedup(0.5, 2, 0.0) == pytest.approx(1.75)  # 1 + a + a^2 tokens for one step
    assert modeled_speedup(1.0, 3, 0.25, 1.5) == pytest.approx(4 / 2.25)
    assert modeled_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # every draft wasted
    assert modeled_speedup(0.7, 0, 0.1, 1.0) == 1.0


def measured(c: float, v_max: float, alpha: float = 0.8, positions: int = 40, max_k: int = 4) -> StartMeasurement:
    return StartMeasurement({"high": 0.01, "draft": c * 0.01, "verify": v_max * 0.01}, max_k, alpha, alpha - 0.1,
                            positions)


def test_cheap_drafter_drafts_and_costly_one_decodes_plainly(llama_packed):
    model, _, draft = llama_packed
    cheap = plan_speculative(model, draft, PROMPT, 4, measured=measured(0.08, 1.3))
    want = max(modeled_speedup(0.8, k, 0.08, 1 + 0.3 * k / 4) for k in range(1, 5))
    assert cheap.speculate and cheap.best_speedup == pytest.approx(want) and want >= MIN_MODELED_SPEEDUP
    assert "drafting, fixed blocks of" in cheap.message() and "prompt positions" in cheap.alpha_source
    assert cheap.choice == "fixed" and cheap.gated is None and cheap.stop_bits is None
    costly = plan_speculative(model, draft, PROMPT, 4, measured=measured(0.9, 1.6))
    assert not costly.speculate and costly.best_speedup < MIN_MODELED_SPEEDUP
    assert "decoding plainly" in costly.message() and "--speculative force" in costly.message()
    forced = plan_speculative(model, draft, PROMPT, 4, mode="force", measured=measured(0.9, 1.6))
    assert forced.speculate and "forced" in forced.message()
    assert costly.speedups == forced.speedups and len(costly.speedups) == 4
    with pytest.raises(ValueError, match="mode"):
        plan_speculative(model, draft, PROMPT, 4, mode="always", measured=measured(0.1, 1.0))


def test_alpha_comes_from_the_calibration_then_the_prompt_then_a_guess(llama_packed):
    model, _, draft = llama_packed
    cal = {"alpha_greedy": 0.95, "alpha_sampled": 0.9, "n_samples": 144}
    p = plan_speculative(model, draft, PROMPT, 4, calibration=cal, measured=measured(0.3, 1.3, alpha=0.2))
    assert p.alpha == 0.95 and "144" in p.alpha_source
    p = plan_speculative(model, draft, PROMPT, 4, greedy=False, calibration=cal, measured=measured(0.3, 1.3))
    assert p.alpha == 0.9
    p = plan_speculative(model, draft, PROMPT, 4, measured=measured(0.3, 1.3, alpha=0.2))
    assert p.alpha == 0.2
    p = plan_speculative(model, draft, PROMPT, 4, measured=measured(0.3, 1.3, alpha=0.2, positions=3))
    assert p.alpha == FALLBACK_ALPHA and "assumed" in p.alpha_source


def test_measure_start_times_both_gears_on_the_prompt(llama_packed):
    model, _, draft = llama_packed
    m = measure_start(model, draft, PROMPT, 3, reps=1)
    assert m.positions == len(PROMPT) and m.max_k == 3 and m.stats.n == len(PROMPT)
    assert len(m.seconds["verify"]) == 3  # one verify per block length
    assert all(s > 0 and math.isfinite(s) for s in [m.seconds["high"], m.seconds["draft"], *m.seconds["verify"]])
    assert 0 <= m.alpha_greedy <= 1 and 0 <= m.alpha_sampled <= 1
    p = plan_speculative(model, draft, PROMPT, 3, measured=m)
    assert p.draft_cost == pytest.approx(m.seconds["draft"] / m.seconds["high"])
    assert len(p.verify_cost) == 4 and p.verify_cost[0] == 1.0
    assert p.verify_cost[1:] == pytest.approx([t / m.seconds["high"] for t in m.seconds["verify"]])


def test_a_later_decision_reuses_the_step_costs_and_reads_its_own_prompt(llama_packed, monkeypatch):
    """The second decision of the same drafter within REUSE_SECONDS takes the first's costs and rounds
    (no timed call runs) with α of its own prompt; past the age, or another block cap, it measures."""
    model, _, draft = llama_packed
    costs = plan_mod.StepCosts()
    clock = [100.0]
    monkeypatch.setattr(plan_mod.time, "monotonic", lambda: clock[0])
    first = plan_speculative(model, draft, PROMPT, 3, step_costs=costs)
    assert first.costs_age_s is None and len(costs) == 1
    other = [(7 * i + 3) % VOCAB for i in range(len(PROMPT))]
    timed = []
    real_perf = plan_mod.time.perf_counter
    monkeypatch.setattr(plan_mod.time, "perf_counter", lambda: timed.append(1) or real_perf())
    clock[0] += 5.0
    second = plan_speculative(model, draft, other, 3, step_costs=costs)
    assert not timed, "a reused decision timed calls"
    assert second.costs_age_s == pytest.approx(5.0) and "as measured 5 s earlier" in second.message()
    assert (second.draft_cost, second.verify_cost, second.high_ms) == (first.draft_cost, first.verify_cost,
                                                                       first.high_ms)
    alone = measure_start(model, draft, other, 3, reps=1)
    assert second.alpha == pytest.approx(alone.alpha_greedy)  # the prompt's own agreement
    plan_speculative(model, draft, other, 2, step_costs=costs)  # another block cap: timed anew
    assert timed and len(costs) == 2
    timed.clear()
    clock[0] += plan_mod.REUSE_SECONDS
    late = plan_speculative(model, draft, PROMPT, 3, step_costs=costs)
    assert timed and late.costs_age_s is None  # too old: measured again, and kept
    assert costs.get(plan_mod.StepCosts.key(draft, 3))[0] == 0.0


def test_the_pipeline_reuses_a_gearboxs_step_costs_across_calls(llama_packed):
    """Two automatic runs on one gearbox: the second decides on the first's step costs, and both
    decode the high gear's tokens."""
    model, gb, draft = llama_packed
    plan_mod.step_costs_of(gb).clear()
    plans, lines = [], []
    for prompt in (PROMPT, PROMPT[::-1]):
        got = list(stream_speculative_generate(model, CharTokenizer(), prompt, gb, draft=draft, mode="auto",
                                               max_tokens=6))
        assert [r.token for r in got] == greedy_reference(model, prompt, 6)
        plans.append(got[-1].stats.plan)
        lines.append(speculative_lines(got[-1].run.summary(got[-1])))
    assert plans[0]["costs_age_s"] is None and plans[1]["costs_age_s"] is not None
    assert plans[1]["draft_cost"] == plans[0]["draft_cost"]
    assert "s earlier" not in " ".join(lines[0]) and "(as measured 0 s earlier)" in " ".join(lines[1])


def test_step_costs_keys_and_limits(llama_packed):
    _, _, draft = llama_packed
    key = plan_mod.StepCosts.key
    assert key(draft, 3) != key(draft, 4) and key(draft, 3) != key(draft, 3, ("kv", "a1"))
    assert key(draft, 3) != key(dataclasses.replace(draft, gear="mid"), 3)
    assert key(draft, 3) != key(dataclasses.replace(draft, host=None), 3)
    never = plan_mod.StepCosts(max_age_s=0.0)
    never.put("k", measured(0.2, 1.3))
    assert never.get("k") is None and never.get("missing") is None
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="max_age_s"):
            plan_mod.StepCosts(max_age_s=bad)
    owner = type("Owner", (), {})()
    assert plan_mod.step_costs_of(owner) is plan_mod.step_costs_of(owner)
    plan_mod.step_costs_of(owner).put("k", measured(0.2, 1.3))
    plan_mod.step_costs_of(owner).clear()
    assert len(plan_mod.step_costs_of(owner)) == 0


# -- the command line: both decisions end to end ----------------------------------


class CharTokenizer:
    """A tokenizer without special tokens: token i prints as a letter."""

    eos_token_id = None
    bos_token = None
    chat_template = None

    def get_vocab(self):
        return {f"{chr(97 + i % 26)}{i // 26}": i for i in range(VOCAB)}

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) % VOCAB for ch in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, messages, **kwargs):
        raise ValueError("no chat template")


@pytest.mark.parametrize("c, mode, drafts", [(0.05, "auto", True), (0.95, "auto", False), (0.95, "force", True)])
def test_cli_follows_the_measured_decision(monkeypatch, capsys, tmp_path, llama_packed, c, mode, drafts):
    from gearbx_mlx.generate import build_parser, run_loaded
    from gearbx_mlx.telemetry.trace import read_trace

    model, gb, _ = llama_packed
    monkeypatch.setattr(plan_mod, "measure_start", lambda *a, **k: measured(c, 1.3, max_k=a[3]))
    trace = tmp_path / "t.jsonl"
    argv = ["--speculative", mode, "--max-tokens", "16", "--max-draft", "3", "--draft-scope", "all",
            "--trace", str(trace)]
    args = build_parser().parse_args(argv)
    text = "abcdefghij"
    assert run_loaded(args, model, CharTokenizer(), gb, text) == 0
    out, err = capsys.readouterr()
    want = greedy_reference(model, CharTokenizer().encode(text), 16)
    assert out.rstrip("\n") == CharTokenizer().decode(want)
    t = read_trace(trace)
    spec = t.summary["speculative"]
    ran = spec["drafter"]["path"]
    assert t.header["speculative"]["drafting"] is drafts and spec["plan"]["speculate"] is drafts
    assert (ran != "none") is drafts and (spec["drafted"] > 0) is drafts
    assert f"Drafter: {ran} path" in err and "Decision (" + mode in err
    assert ("decoding plainly" in err) is (not drafts)


# -- fixed or gated blocks, from the closed form ---------------------------------------


def simulated_gated(k, c, v, p, lo, hi, blocks=200_000, seed=0):
    """Monte Carlo of the block process :func:`gated_speedup` models: fresh i.i.d. drafts."""
    rng = np.random.default_rng(seed)
    tokens = cost = 0.0
    for _ in range(blocks):
        drafted, accepted, rejected = 0, 0, False
        while drafted < k:
            drafted += 1
            low = rng.random() < p
            ok = rng.random() < (lo if low else hi)
            if not rejected and ok:
                accepted += 1
            else:
                rejected = True
            if not low:
                break
        tokens += accepted + 1
        cost += drafted * c + v[drafted]
    return tokens / cost


@pytest.mark.parametrize("k, c, p, lo, hi", [
    (4, 0.1, 0.7, 0.9, 0.3), (6, 0.25, 0.5, 0.95, 0.1), (2, 0.05, 0.9, 0.6, 0.5),
])
def test_gated_closed_form_matches_the_block_process(k, c, p, lo, hi):
    v = [1.0 + 0.05 * d for d in range(k + 1)]
    want = gated_speedup(k, c, v, p, lo, hi)
    assert simulated_gated(k, c, v, p, lo, hi) == pytest.approx(want, rel=0.01)
    # Without a stop (every draft continues) it is the fixed-length closed form.
    assert gated_speedup(k, c, v, 1.0, lo, hi) == pytest.approx(modeled_speedup(lo, k, c, v[k]))


def stats_of(entropies, agree):
    return DraftStats(list(entropies), [0.0] * len(agree), list(agree), [float(a) for a in agree])


def with_stats(stats, c=0.1, v=(1.1, 1.15, 1.2, 1.25, 1.3, 1.35)):
    s = stats.summary()
    return StartMeasurement({"high": 0.01, "draft": c * 0.01, "verify": [0.01 * x for x in v]}, len(v),
                            s["alpha_greedy"], s["alpha_sampled"], stats.n, stats)


def informative(n=200, seed=0):
    """Low-entropy drafts agree, high-entropy ones do not: a stop pays."""
    rng = np.random.default_rng(seed)
    h = rng.random(n) * 8
    return stats_of(h.tolist(), (h < 4).tolist())


def uninformative(n=200, seed=0):
    """Agreement independent of entropy: a stop only cuts blocks short."""
    rng = np.random.default_rng(seed)
    return stats_of((rng.random(n) * 8).tolist(), (rng.random(n) < 0.8).tolist())


def test_the_plan_chooses_gated_blocks_where_the_entropy_predicts_rejection(llama_packed):
    model, _, draft = llama_packed
    p = plan_speculative(model, draft, PROMPT, 6, measured=with_stats(informative()))
    assert p.speculate and p.choice == "gated" and p.stop_bits is not None
    assert p.gated["speedup"] > GATED_MARGIN * p.fixed["speedup"] and p.best_speedup == p.gated["speedup"]
    assert 3.0 <= p.stop_bits <= 5.0 and p.gated["alpha_below"] > 0.9 > 0.1 > p.gated["alpha_above"]
    assert "gated blocks of up to" in p.message() and p.gating_source == "prompt positions"
    u = plan_speculative(model, draft, PROMPT, 6, measured=with_stats(uninformative()))
    assert u.choice == "fixed" and u.stop_bits is None and u.gated is not None
    assert u.gated["speedup"] <= GATED_MARGIN * u.fixed["speedup"]
    # Pinned by the caller: fixed blocks only, or this stop only.
    f = plan_speculative(model, draft, PROMPT, 6, measured=with_stats(informative()), stop=None)
    assert f.choice == "fixed" and f.gated is None
    g = plan_speculative(model, draft, PROMPT, 6, measured=with_stats(uninformative()), stop=2.0)
    assert g.choice == "gated" and g.stop_bits == 2.0 and g.gated["p_continue"] == pytest.approx(0.25, abs=0.1)
    e = plan_speculative(model, draft, PROMPT, 6, measured=with_stats(uninformative()), exact_k=True, stop=None)
    assert e.best_k == 6
    # A costly drafter decodes plainly, whatever the gating.
    plain = plan_speculative(model, draft, PROMPT, 6, measured=with_stats(informative(), c=1.5))
    assert not plain.speculate and plain.choice == "plain"


def test_the_plan_reads_the_saved_gating_table(llama_packed):
    model, _, draft = llama_packed
    table = gating_table(informative(), greedy=True)
    assert [t["percentile"] for t in table] == sorted(t["percentile"] for t in table) and table
    cal = {"alpha_greedy": 0.5, "n_samples": 200, "gating": {"greedy": table, "sampled": table}}
    p = plan_speculative(model, draft, PROMPT, 6, calibration=cal, measured=with_stats(uninformative()))
    assert p.choice == "gated" and p.gating_source == "saved calibration" and p.alpha == 0.5


def test_the_api_decides_and_follows_the_decision(monkeypatch, llama_packed):
    model, gb, draft = llama_packed
    for c, drafts in ((0.05, True), (1.5, False)):
        monkeypatch.setattr(plan_mod, "measure_start", lambda *a, c=c, **k: with_stats(uninformative(), c=c))
        got = list(stream_speculative_generate(model, CharTokenizer(), PROMPT, gb, draft=draft, mode="auto",
                                               max_tokens=16))
        assert [r.token for r in got] == greedy_reference(model, PROMPT, 16)
        s = got[-1].stats
        assert s.plan["speculate"] is drafts and (s.drafted > 0) is drafts
        assert s.plan["choice"] == ("fixed" if drafts else "plain")
        if drafts:
            assert max(b.drafted for b in s.blocks) <= s.plan["best_k"]


def test_calibration_saves_per_length_costs_and_gating(llama_packed):
    model, gb, draft = llama_packed
    block = calibrate_draft_stop(model, draft, CharTokenizer(), "replay", prompts=["abcdefgh", "ijklmnop"],
                                 max_tokens=12)
    assert len(block["verify_cost"]) == max(REPLAY_MAX_DRAFT) + 1 and block["verify_cost"][0] == 1.0
    assert len(block["step_ms"]["verify"]) == max(REPLAY_MAX_DRAFT)
    assert set(block["gating"]) == {"greedy", "sampled"}
    for t in block["gating"]["greedy"]:
        assert 0 < t["p_continue"] < 1 and 0 <= t["alpha_below"] <= 1 and 0 <= t["alpha_above"] <= 1


def test_cli_calibration_saves_the_costs_and_gating_the_decision_reads(monkeypatch, capsys, tmp_path, llama_packed):
    from gearbx_mlx.calibration import Calibration
    from gearbx_mlx.generate import build_parser, run_loaded
    from gearbx_mlx.speculative.cli import calibrate_drafter

    model, gb, _ = llama_packed
    thresholds = gb.thresholds
    gb.set_calibration(Calibration(low=0.5, high=2.0, strategy="median", n_samples=10, vocab_size=VOCAB))
    path = tmp_path / "cal.json"
    args = build_parser().parse_args(["--speculative", "--calibrate", "--calibration", str(path), "--max-tokens", "8"])
    try:
        calibrate_drafter(args, model, CharTokenizer(), gb)  # what the CLI's --calibrate does with --speculative
        gb.calibration.save(path)
        assert run_loaded(args, model, CharTokenizer(), gb, "abcdefghij") == 0
    finally:
        gb.calibration = None
        gb.set_thresholds(*thresholds)
    block = Calibration.load(path).extra["speculative"]["low"]
    assert len(block["step_ms"]["verify"]) == max(REPLAY_MAX_DRAFT) and block["gating"]["greedy"]
    err = capsys.readouterr().err
    assert "saved calibration" in err and "Decision (auto)" in err and "v(k)" in err


def test_auto_does_not_draft_within_the_timing_noise_of_break_even(llama_packed):
    """Rounds whose median models a speed-up but whose lower quartile does not: ``auto`` decodes
    plainly and says why, ``force`` drafts; the same median with tight rounds drafts."""
    model, _, draft = llama_packed

    def rounds(cs):
        return [{"high": 0.01, "draft": c * 0.01, "verify": 1.3 * 0.01} for c in cs]

    base = measured(0.3, 1.3)
    noisy = dataclasses.replace(base, rounds=rounds([1.0, 0.9, 0.3, 0.3, 0.3, 0.2, 0.1]))
    tight = dataclasses.replace(base, rounds=rounds([0.29, 0.3, 0.3, 0.3, 0.3, 0.31, 0.31]))
    for m in (noisy, tight):
        assert plan_speculative(model, draft, PROMPT, 4, measured=m).best_speedup > MIN_MODELED_SPEEDUP
    quiet = plan_speculative(model, draft, PROMPT, 4, measured=tight)
    assert quiet.speculate and quiet.speedup_low >= MIN_MODELED_SPEEDUP
    shaky = plan_speculative(model, draft, PROMPT, 4, measured=noisy)
    assert not shaky.speculate and shaky.speedup_low < MIN_MODELED_SPEEDUP <= shaky.best_speedup
    assert "within the timing noise" in shaky.message()
    assert plan_speculative(model, draft, PROMPT, 4, mode="force", measured=noisy).speculate


#: The decision's statistics from a few rows at a time against one whole-prompt call (float32).
STATS_RTOL = 1e-5


def test_the_decision_compares_the_prompt_a_few_positions_at_a_time(llama_packed, monkeypatch):
    """The start-of-run decision's prefill never holds the prompt's whole ``(T, V)`` logits of
    either gear (on a 151,936-token vocabulary they were most of a speculative run's peak memory
    above its weights): the high gear's body runs over the prompt and its head a few rows at a
    time, the host drafter is fed a few tokens a call; the statistics are those of whole-prompt
    calls up to float32 rounding, both caches bitwise."""
    from mlx_lm.models.cache import make_prompt_cache

    from gearbx_mlx.speculative import calibration, draft as draft_mod

    needs_host()
    model, gb, draft = llama_packed
    gb.manager.shift("high")
    prompt = mx.array((PROMPT * 4)[:37])[None]
    hc, dc = make_prompt_cache(model), make_prompt_cache(draft)
    whole = calibration.compare_logits(model(prompt, cache=hc)[0], draft(prompt, cache=dc)[0])
    hc2, dc2 = make_prompt_cache(model), make_prompt_cache(draft)
    rows, calls = [], []
    real = calibration.compare_logits
    monkeypatch.setattr(calibration, "compare_logits", lambda h, d: rows.append((h.shape, d.shape)) or real(h, d))
    monkeypatch.setattr(type(model), "__call__", lambda self, *a, **k: calls.append(a[0].shape) or pytest.fail(
        "the high gear computed the whole prompt's logits"))
    host = draft.host
    monkeypatch.setattr(draft, "host", lambda tokens, cache: calls.append(len(tokens)) or host(tokens, cache))
    got = calibration.prompt_stats(model, draft, prompt, hc2, dc2)
    assert draft_mod.PREFILL_ROWS < prompt.shape[1]
    assert all(h[0] <= draft_mod.PREFILL_ROWS and d[0] <= draft_mod.PREFILL_ROWS for h, d in rows), rows
    assert calls and all(n <= draft_mod.PREFILL_ROWS for n in calls), calls
    # the head's product over a few rows sums as the BLAS sums for that shape: equal up to the
    # last bits of float32 (OpenBLAS takes another kernel for 2 rows than for 37), not bitwise
    for name in ("draft_entropy", "high_entropy", "accept_prob"):
        np.testing.assert_allclose(getattr(got, name), getattr(whole, name), rtol=STATS_RTOL, err_msg=name)
    assert got.agree == whole.agree
    for a, b in zip(hc + dc, hc2 + dc2):
        assert a.offset == b.offset == prompt.shape[1]
        for name in ("keys", "values"):
            np.testing.assert_array_equal(np.asarray(getattr(a, name))[..., : a.offset, :],
                                          np.asarray(getattr(b, name))[..., : b.offset, :])


@pytest.mark.parametrize("length", [37, 100])
def test_the_drafters_prefill_computes_no_logits(llama_packed, monkeypatch, length):
    """The host drafter's prefill fills its cache as a call on the prompt would, without the
    ``(T, V)`` logits a call returns: a short prompt through the host step without its head,
    a long one (the tree's multi-token pass) through the tree's body alone."""
    from mlx_lm.models.cache import make_prompt_cache

    from gearbx_mlx.speculative.drafter import prefill

    needs_host()
    _, gb, draft = llama_packed
    prompt = mx.array((PROMPT * 12)[:length] + [7])
    ref = make_prompt_cache(draft)
    draft(prompt[:-1][None], cache=ref)
    got = make_prompt_cache(draft)
    steps = []
    step = draft.host.step
    monkeypatch.setattr(draft.host, "step", lambda t, c, logits=True: steps.append(logits) or step(t, c, logits))
    monkeypatch.setattr(type(draft.module), "__call__", lambda *a, **k: pytest.fail("the drafter computed logits"))
    last = prefill(draft, got, prompt, 512)
    assert last.tolist() == [7]
    assert not any(steps) and (bool(steps) == (length <= 64)), steps
    for a, b in zip(ref, got):
        assert a.offset == b.offset == length
        for name in ("keys", "values"):
            np.testing.assert_array_equal(a.keys[..., : a.offset, :] if name == "keys" else a.values[..., : a.offset, :],
                                          getattr(b, name)[..., : b.offset, :])
