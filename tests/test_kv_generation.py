"""The KV-cache option of generation: API and CLI wiring, gears, speculative
decoding, prompt caches, restoring the model, and one clear error per bad input.

Tiny random llamas throughout; numerics of the transform itself are held to
references in test_kvcache.py.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama, make_tiny_tokenizer, skip_without_quantized_attention
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache

from gearbx_mlx.calibration import Calibration
from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.console import kv_line
from gearbx_mlx.gearbox import Gearbox
from gearbx_mlx.kvcache import RotatedKVCache, RotatedQuantizedKVCache, calibrate_text
from gearbx_mlx.kvcache.option import KVOptions, open_kv, plain_summary, recipe
from gearbx_mlx.pipeline import stream_generate, stream_speculative_generate
from gearbx_mlx.policies import RandomPolicy
from gearbx_mlx.speculative.decode import SpeculativeConfig

VOCAB = 64
PROMPT = [3, 4, 5, 6, 7, 8]
#: Max |Δ logprob| at the prompt's last position between an 8-bit rotated
#: cache and the float cache on the tiny model, whose logprobs are ~-90
#: (measured: 0.05; a query left unrotated moves them by tens).
LOGPROB_ATOL_8BIT = 0.2


def _model(seed: int = 0) -> nn.Module:
    return make_tiny_llama(vocab=VOCAB, hidden=256, seed=seed)  # head size 64: one group


def _snapshot(model: nn.Module):
    return ({k: np.array(v) for k, v in tree_flatten(model.parameters())},
            [type(layer.self_attn) for layer in model.layers])


def _same(model: nn.Module, snap) -> bool:
    params, classes = snap
    now = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    return (now.keys() == params.keys() and all(np.array_equal(now[k], params[k]) for k in now)
            and [type(layer.self_attn) for layer in model.layers] == classes)


def _gen(model, gb, n=8, **kw):
    return list(stream_generate(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, max_tokens=n, **kw))


@pytest.mark.parametrize("store", ["separate", "nested"])
def test_rotated_cache_through_the_gears_is_close_and_restored(store):
    """Entropy routing with gear shifts on both stores: the rotated 8-bit cache's
    logprobs stay near the float cache's, the caches are the rotated ones, and
    the model is exactly as loaded afterwards (also after a broken-off stream)."""
    skip_without_quantized_attention()
    model = _model()
    # MLX's kernels: the tolerance is for the cache's error, not the C kernels' int8 activations.
    gb = Gearbox(model, GearboxConfig(scope="all", store=store, kernel="mlx"), vocab_size=VOCAB)
    snap = _snapshot(model)
    # Random gears, the same draws for both runs: a shift at most steps, every gear visited.
    def policy():
        return RandomPolicy({"low": 1 / 3, "mid": 1 / 3, "high": 1 / 3}, seed=1)

    ref = _gen(model, gb, policy=policy())
    cache = make_prompt_cache(model)
    out = _gen(model, gb, kv_bits=8, quantized_kv_start=0, prompt_cache=cache, policy=policy())
    assert all(type(c) is RotatedQuantizedKVCache for c in cache)
    assert cache[0].offset >= len(PROMPT) + len(out) - 1  # mlx-lm runs one token ahead
    assert _same(model, snap)
    assert [r.gear for r in out] == [r.gear for r in ref]
    assert np.abs(np.array(out[0].logprobs) - np.array(ref[0].logprobs)).max() < LOGPROB_ATOL_8BIT
    summary = out[-1].session.kv_cache
    assert summary["kind"] == "rotated" and summary["bits"] == 8 and summary["ratio_to_float16"] < 0.6
    assert sum(r.shifted for r in out) >= 2 and {r.gear for r in out} == {"low", "mid", "high"}
    # A stream the consumer abandons restores the model too.
    stream = stream_generate(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, max_tokens=8, kv_bits=4,
                             quantized_kv_start=0)
    next(stream)
    assert type(model.layers[0].self_attn) is not snap[1][0]
    stream.close()
    assert _same(model, snap)


def test_4bit_rotated_is_nearer_float_than_plain_4bit():
    """Same model, same prompt: the rotated 4-bit cache's first logprobs are
    closer to the float cache's than mlx-lm's plain 4-bit cache's (a test that
    fails if the rotation were dropped on the way to mlx-lm)."""
    skip_without_quantized_attention(copies=False)
    from gearbx_mlx.kvcache import KVConfig, apply_kv

    model = make_tiny_llama(vocab=VOCAB, hidden=256, seed=3)
    ids = mx.array(list(range(2, 60)))[None]
    ref = model(ids)[0]
    plain = model(ids, cache=[QuantizedKVCache(64, 3) for _ in model.layers])[0]
    with apply_kv(model, KVConfig(bits=3, lam_alpha=0.0, key_offset="none", sink=False)) as kv:
        rot = model(ids, cache=kv.make_cache())[0]
    err = lambda x: float(mx.abs(x - ref).mean())  # noqa: E731
    assert err(rot) < err(plain)


def test_plain_rotation_none_is_mlx_lms_cache():
    skip_without_quantized_attention(copies=False)
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    cache = make_prompt_cache(model)
    out = _gen(model, gb, kv_bits=4, kv_rotation="none", quantized_kv_start=0, prompt_cache=cache)
    assert all(type(c) is QuantizedKVCache for c in cache)
    assert out[-1].session.kv_cache["kind"] == "affine"
    out = _gen(model, gb)
    assert out[-1].session.kv_cache["kind"] == "float"


def test_quantized_kv_start_keeps_mlx_lms_meaning():
    """A start given keeps mlx-lm's meaning (float until the cache holds that many tokens); with
    none given the rotated cache is quantized from the first token."""
    skip_without_quantized_attention()
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    late, early, default = make_prompt_cache(model), make_prompt_cache(model), make_prompt_cache(model)
    _gen(model, gb, n=6, kv_bits=4, quantized_kv_start=5000, prompt_cache=late)
    assert all(type(c) is RotatedKVCache for c in late)
    _gen(model, gb, n=6, kv_bits=4, quantized_kv_start=8, prompt_cache=early)
    assert all(type(c) is RotatedQuantizedKVCache for c in early)
    _gen(model, gb, n=6, kv_bits=4, prompt_cache=default)
    assert all(type(c) is RotatedQuantizedKVCache for c in default)


def test_prompt_cache_carries_a_conversation_and_refuses_another_basis():
    skip_without_quantized_attention()
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    cache = make_prompt_cache(model)
    _gen(model, gb, n=4, kv_bits=4, quantized_kv_start=0, prompt_cache=cache)
    first = cache[0].offset
    _gen(model, gb, n=4, kv_bits=4, quantized_kv_start=0, prompt_cache=cache)  # same settings: reused
    assert cache[0].offset > first
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="another KV transform"):
        _gen(model, gb, n=4, kv_bits=4, kv_group_size=32, quantized_kv_start=0, prompt_cache=cache)
    assert _same(model, snap)
    filled = make_prompt_cache(model)
    _gen(model, gb, n=2, prompt_cache=filled)  # float tokens in the plain basis
    with pytest.raises(ValueError, match="another KV transform"):
        _gen(model, gb, n=2, kv_bits=4, quantized_kv_start=0, prompt_cache=filled)


@pytest.mark.parametrize("later", [{}, {"kv_bits": 4, "kv_rotation": "none", "quantized_kv_start": 0},
                                   {"speculative": "force"}], ids=["float", "mlx-lm-4bit", "speculative"])
def test_a_rotated_cache_is_refused_by_a_stream_on_mlx_lms_caches(later):
    """mlx-lm's caches would read the rotated keys as noise (garbled text, and the cache spoiled
    for the next call): refused, before the model or the cache change."""
    skip_without_quantized_attention()
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    cache = make_prompt_cache(model)
    _gen(model, gb, n=4, kv_bits=4, quantized_kv_start=0, prompt_cache=cache)
    offsets, snap = [c.offset for c in cache], _snapshot(model)
    run = stream_speculative_generate if later.pop("speculative", None) else stream_generate
    with pytest.raises(ValueError, match="made by the rotated KV cache"):
        list(run(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, max_tokens=4, prompt_cache=cache, **later))
    assert [c.offset for c in cache] == offsets and _same(model, snap)


@pytest.mark.parametrize("speculative", [False, True])
def test_an_empty_prompt_cache_list_is_filled_in_place_without_the_kv_option_too(speculative):
    """As with ``kv_bits`` (documented); mlx-lm's own loop failed on ``[]`` with an IndexError."""
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    cache: list = []
    run = stream_speculative_generate if speculative else stream_generate
    out = list(run(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, max_tokens=4, prompt_cache=cache))
    assert out and len(cache) == len(model.layers) and cache[0].offset >= len(PROMPT)


@pytest.mark.parametrize("rotation", ["auto", "none"])
@pytest.mark.parametrize("start", [3, 7, 9, 12])
def test_speculative_converts_a_float_cache_at_the_token_mlx_lm_does(rotation, start):
    """A cache quantized from token ``start`` is converted after the step that reaches it (mlx-lm's
    rule); blocks that crossed the start read the positions after it in float, and the prefill
    never converted between its chunks: the text differed from the high gear's."""
    skip_without_quantized_attention()
    model = _model(seed=1)
    # weights x3: logits whose argmax a 2-bit cache's rounding moves (as it does not for the plain tiny model)
    model.update({"model": {"layers": tree_map(lambda a: 3 * a, model.model.parameters()["layers"])}})
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    high = Gearbox(model, GearboxConfig(scope="all", static_gear="high"), vocab_size=VOCAB)
    kv = dict(kv_bits=2, kv_rotation=rotation, quantized_kv_start=start)
    tok = make_tiny_tokenizer(VOCAB)
    prompt = PROMPT * 2  # 12 tokens: prefilled in chunks of 4 below, the start inside or past them
    ref = [r.token for r in stream_generate(model, tok, prompt, high, max_tokens=12, prefill_step_size=4, **kv)]
    config = SpeculativeConfig(max_draft=4, prefill_step_size=4)
    out = [r.token for r in stream_speculative_generate(model, tok, prompt, gb, config=config, max_tokens=12,
                                                        **kv)]
    assert out == ref


def test_speculative_keeps_both_caches_quantized_and_matches_the_high_gear():
    """Greedy speculative decoding with the rotated cache emits the high gear's
    tokens with the same cache, and the drafter's cache is quantized too."""
    skip_without_quantized_attention()
    model = _model(seed=1)
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    snap = _snapshot(model)
    tok = make_tiny_tokenizer(VOCAB)
    kv = dict(kv_bits=8, quantized_kv_start=0)
    high = Gearbox(model, GearboxConfig(scope="all", static_gear="high"), vocab_size=VOCAB)
    ref = [r.token for r in _gen(model, high, n=10, **kv)]
    cache = make_prompt_cache(model)
    out = list(stream_speculative_generate(model, tok, PROMPT, gb, config=SpeculativeConfig(max_draft=3),
                                           max_tokens=10, prompt_cache=cache, **kv))
    assert [r.token for r in out] == ref
    assert all(type(c) is RotatedQuantizedKVCache for c in cache)
    s = out[-1].stats.summary()["kv_cache"]
    assert s["caches"] == "high gear and drafter" and s["bits"] == 8
    assert out[-1].draft.module.layers[0].self_attn.__class__.__name__ == "Attention"
    assert _same(model, snap)


def test_calibration_file_carries_the_kv_statistics(tmp_path):
    skip_without_quantized_attention()
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    kvcal = calibrate_text(model, list(range(2, 40)))
    cal = Calibration(low=0.5, high=1.0, strategy="median", n_samples=3, vocab_size=VOCAB, kv=kvcal.to_dict())
    back = Calibration.load(cal.save(tmp_path / "c.json"))
    gb.set_calibration(back)
    out = _gen(model, gb, n=3, kv_bits=4, quantized_kv_start=0)
    assert out[-1].session.kv_cache["statistics"] == "text"
    gb.set_calibration(Calibration(low=0.5, high=1.0, strategy="median", n_samples=3, vocab_size=VOCAB))
    assert _gen(model, gb, n=3, kv_bits=4, quantized_kv_start=0)[-1].session.kv_cache["statistics"] == "weights"
    bad = tmp_path / "bad.json"
    data = json.loads(cal.save(tmp_path / "x.json").read_text())
    data["kv"] = {"format": 1}
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="kv"):
        Calibration.load(bad)


def test_bad_input_one_error_before_generation():
    skip_without_quantized_attention()
    model, other = _model(0), _model(5)
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    snap = _snapshot(model)
    foreign = calibrate_text(other, list(range(2, 40)))
    with pytest.raises(ValueError, match="another model"):
        _gen(model, gb, kv_bits=4, kv_calibration=foreign)
    for bad, match in (({"kv_bits": 7}, "kv_bits must be one of"), ({"kv_bits": 1}, "kv_bits must be one of"),
                       ({"kv_bits": 1, "kv_rotation": "none"}, "kv_bits must be one of 2, 3, 4, 5, 6, 8"),
                       ({"kv_bits": 4, "kv_group_size": 48}, "kv_group_size must be one of"),
                       ({"kv_bits": 4, "kv_rotation": "dct"}, "kv_rotation must be one of"),
                       ({"kv_bits": 4, "max_kv_size": 64}, "max_kv_size"),
                       ({"kv_bits": 4, "kv_rotation": "none", "max_kv_size": 64},
                        r"max_kv_size \(--max-kv-size, a rotating window cache\) cannot be combined with kv_bits")):
        with pytest.raises(ValueError, match=match):
            _gen(model, gb, **bad)
    assert _same(model, snap)
    # An architecture whose layers keep sliding-window caches.
    model.make_cache = lambda: [RotatingKVCache(max_size=16) for _ in model.layers]
    with pytest.raises(ValueError, match="RotatingKVCache"):
        _gen(model, gb, kv_bits=4)
    del model.make_cache
    # An attention without RoPE module cannot take the rotation.
    odd = _model()
    for layer in odd.layers:
        layer.self_attn.rope = None
    with pytest.raises(ValueError, match="rope"):
        open_kv(odd, KVOptions(bits=4))


@pytest.mark.parametrize("rotation", ["auto", "none"])
def test_a_backend_without_quantized_attention_is_one_error_before_generation(monkeypatch, rotation):
    """MLX 0.32's CUDA backend lacks the quantized products of quantized attention
    for some shapes; that is found by a probe before the first token, for the
    rotated cache and for mlx-lm's own (rotation none) alike."""
    from gearbx_mlx.kvcache import quantize

    def missing(*a, **k):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x5x64x4")

    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    snap = _snapshot(model)
    monkeypatch.setattr(quantize, "_probed", {})
    monkeypatch.setattr(mx, "quantized_matmul", missing)
    seen = []
    with pytest.raises(ValueError, match="cannot run quantized attention over a 4-bit, group 64 cache with head "
                                         "dimension 64 .*No implementation"):
        for r in stream_generate(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, max_tokens=4, kv_bits=4,
                                 kv_rotation=rotation):
            seen.append(r)
    assert seen == [] and _same(model, snap)
    monkeypatch.undo()
    skip_without_quantized_attention(copies=rotation != "none")
    assert len(_gen(model, gb, n=3, kv_bits=4, kv_rotation=rotation)) == 3  # the real products run here


def test_a_backend_that_reads_only_contiguous_copies(monkeypatch):
    """MLX 0.32's CUDA quantized_matmul takes only operands with contiguous storage,
    which a cache's slice of its buffer is not. Emulated here: the rotated cache hands
    attention contiguous copies and gives the same tokens as over slices; mlx-lm's own
    cache, which cannot, is one error before generation that names the way out."""
    from gearbx_mlx.kvcache import quantize

    skip_without_quantized_attention()
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    over_views = [r.token for r in _gen(model, gb, n=6, kv_bits=4, quantized_kv_start=0)]
    made, real_contiguous, real_expand, real_qmm = [], mx.contiguous, mx.expand_dims, mx.quantized_matmul

    def contiguous(a, *args, **kw):
        out = real_contiguous(a, *args, **kw)
        made.append(out)
        return out

    def expand_dims(a, *args, **kw):  # a new axis keeps the storage contiguous (grouped-query heads)
        out = real_expand(a, *args, **kw)
        if any(a is m for m in made):
            made.append(out)
        return out

    def qmm(x, w, *args, **kw):  # a weight (2-D) is contiguous; a cache's operand (4-D, 5-D) must be made so
        if w.ndim > 2 and not any(w is m for m in made):
            raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x5x64x4")
        return real_qmm(x, w, *args, **kw)

    monkeypatch.setattr(quantize, "_probed", {})
    monkeypatch.setattr(mx, "contiguous", contiguous)
    monkeypatch.setattr(mx, "expand_dims", expand_dims)
    monkeypatch.setattr(mx, "quantized_matmul", qmm)
    over_copies = [r.token for r in _gen(model, gb, n=6, kv_bits=4, quantized_kv_start=0)]
    assert over_copies == over_views and made
    assert quantize.attention_reads(4, 64, 64, mx.float32) == "copies"
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="only on contiguous copies.*--kv-rotation auto"):
        _gen(model, gb, n=3, kv_bits=4, kv_rotation="none")
    assert _same(model, snap)


def test_the_key_offset_comes_from_the_weights_not_the_name():
    """Without a text calibration, a model whose k_proj biases put large offsets on
    its keys gets them removed (estimated from the biases); one without gets none."""
    skip_without_quantized_attention()
    from test_kvcache import _tiny

    calm, qwenish = _tiny("qwen2"), _tiny("qwen2", bias_outlier=300.0)
    for m in (calm, qwenish):
        assert recipe(m, KVOptions(bits=4)).key_offset == "mean"
    sizes = []
    # Without --kv-group-size the model with outlying biases gets groups of 32 (6.0 bits
    # an element with these float32 models' scales and biases), the other mlx-lm's 64 (5.0 bits).
    for m, group, bits in ((calm, 64, 5.0), (qwenish, 32, 6.0)):
        with open_kv(m, KVOptions(bits=4, quantized_kv_start=0)) as kv:
            s = kv.summary()
            assert (s["statistics"], s["group_size"], s["bits_per_element"]) == ("weights", group, bits)
            assert {c.group_size for c in kv.handle.make_cache()} == {group}
            sizes.append(max(float(mx.abs(t.key_offset).max()) for t in kv.handle.transforms))
    assert sizes[0] < 1.0 and sizes[1] > 10.0  # a bias of 300 on one RoPE pair, averaged over positions
    assert recipe(qwenish, KVOptions(bits=4, group_size=64)).group_size == 64  # asked for: kept
    plain = recipe(qwenish, KVOptions(bits=4, rotation="none"))
    assert (plain.rotation, plain.group_size) == ("none", 64)  # mlx-lm's own cache keeps mlx-lm's default


def test_summary_line():
    line = kv_line({"kind": "rotated", "bits": 4, "group_size": 64, "quantized_kv_start": 0, "rotation": ["srht"],
                    "lambda": True, "statistics": "text", "key_offset": True, "layer_bits": [4, 8, 4],
                    "bits_per_element": 5.83, "bytes_per_token": 2048.0, "ratio_to_float16": 0.36})
    assert "rotated 4-bit g64" in line and "layers 1 at 8 bits" in line and "2.0 KiB per token" in line
    assert "0.36x float16" in line
    assert kv_line({"kind": "float", "bytes_per_token": 1024.0}).startswith("KV cache: float")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("rotation", ["auto", "none"])
def test_the_quantized_cache_line_states_the_bytes_the_cache_holds(dtype, rotation):
    """Scales and biases are stored in the model's dtype: the summary counts them so, and
    compares the cache with the float cache of that dtype (it said float16 for both)."""
    skip_without_quantized_attention()
    model = _model()
    model.set_dtype(dtype)
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    cache: list = []
    out = _gen(model, gb, n=4, kv_bits=4, kv_rotation=rotation, quantized_kv_start=0, prompt_cache=cache)
    # bytes per cached position of every (batch, heads, positions, ...) buffer: codes, scales, biases
    held = sum(a.nbytes / a.shape[2] for c in cache for _, a in tree_flatten(c.state)
               if isinstance(a, mx.array) and a.ndim == 4)
    s = out[-1].run.kv_cache
    assert s["bytes_per_token"] == pytest.approx(held)
    name = str(dtype).split(".")[-1]
    flt = plain_summary(model, KVOptions())["bytes_per_token"]
    assert s["ratio_to_float"] == pytest.approx(held / flt)
    assert f"x the {name} cache)" in kv_line(s)


@pytest.mark.parametrize("dtype, size", [(mx.float32, 4), (mx.float16, 2), (mx.bfloat16, 2)])
def test_the_float_cache_line_states_its_real_dtype_and_bytes(dtype, size):
    """mlx-lm's float cache holds the keys in the model's dtype: a float32 model's is twice float16's."""
    model = make_tiny_llama()
    model.set_dtype(dtype)
    s = plain_summary(model, KVOptions())
    elements = sum(2 * layer.self_attn.n_kv_heads * layer.self_attn.head_dim for layer in model.layers)
    name = str(dtype).split(".")[-1]
    assert s["dtype"] == name and s["bytes_per_token"] == elements * size
    assert s["float16_bytes_per_token"] == elements * 2 and s["ratio_to_float16"] == size / 2
    cache = make_prompt_cache(model)  # what mlx-lm really stores
    model(mx.array([[1, 2, 3]]), cache=cache)
    assert cache[0].keys.dtype == dtype
    assert kv_line(s) == f"KV cache: float (mlx-lm's), {elements * size / 1024:.1f} KiB per token at {name}"


# -- the evaluation's KV column ---------------------------------------------------------------


def test_evaluation_rows_carry_the_cache_beside_the_weights():
    skip_without_quantized_attention()
    from gearbx_mlx.evaluation.harness import evaluate
    from gearbx_mlx.evaluation.report import kv_note, table
    from gearbx_mlx.evaluation.specs import base_specs

    model = _model()
    tok = make_tiny_tokenizer(VOCAB)
    text = " ".join(f"t{(7 * i) % (VOCAB - 2) + 2}" for i in range(64))
    snap = _snapshot(model)
    opts = dict(tokens=32, window=16, speed_tokens=4, speed_prompt=4, workload_tokens=0, speculative=False,
                matched=False)
    policies = base_specs({"fixed": (0.5, 1.0)}, scopes=("all",))  # the KV column is per run, not per scope
    flt = evaluate(model, tok, text, policies, **opts)
    rot = evaluate(model, tok, text, policies, kv=KVOptions(bits=4, quantized_kv_start=5000), **opts)
    assert _same(model, snap)
    assert flt["kv_cache"]["kind"] == "float" and rot["kv_cache"]["kind"] == "rotated"
    assert rot["kv_cache"]["quantized_kv_start"] == 0  # evaluation quantizes from the first token
    f, r = _rows_by_name(flt), _rows_by_name(rot)
    per_f, per_r = flt["kv_cache"]["bytes_per_token"], rot["kv_cache"]["bytes_per_token"]
    # 5.0 bits an element (float32 scales and biases) against float16's 16; the float cache holds float32
    assert per_r == pytest.approx(flt["kv_cache"]["float16_bytes_per_token"] * 5.0 / 16)
    for name in f:
        assert f[name]["kv_bytes_per_token"] == pytest.approx(per_f * 16 / 2)  # mean context: window / 2
        assert r[name]["total_bytes_per_token"] == pytest.approx(r[name]["bytes_per_token"] + per_r * 8)
    # The cache changed the numbers: the 4-bit cache's reference is not the float cache's.
    assert r["static-high"]["perplexity"] != f["static-high"]["perplexity"]
    assert r["static-high"]["speed"]["decode_tokens"] == 4
    assert "KV MB" in table(rot["policies"]) and "rotated 4-bit g64" in kv_note(rot["kv_cache"])


def _rows_by_name(results):
    return {row["name"]: row for row in results["policies"]}


def test_evaluate_cli_rejects_bad_kv_flags(capsys):
    from gearbx_mlx.evaluate import main

    for argv, msg in ((["--kv-bits", "7"], "--kv-bits must be one of"),
                      (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size must be one of")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0]


def test_kv_bits_alone_quantizes_from_the_first_token_with_the_rotated_cache():
    """``--kv-bits 4`` means a quantized cache now: the rotated cache starts at the first token
    unless a start is given; mlx-lm's own cache keeps mlx-lm's 5000. The summary says what the
    cache held, so a run below the start does not claim the saving."""
    from gearbx_mlx.kvcache.option import DEFAULT_QUANTIZED_KV_START
    from gearbx_mlx.record import kv_held

    assert KVOptions(bits=4).start == 0
    assert KVOptions(bits=4, rotation="none").start == DEFAULT_QUANTIZED_KV_START
    assert KVOptions(bits=4, quantized_kv_start=7).start == 7
    kv = {"kind": "affine", "quantized_kv_start": DEFAULT_QUANTIZED_KV_START, "bits": 4}
    assert kv_held(kv, 40) == {**kv, "held_tokens": 40, "quantized_tokens": 0}
    assert kv_held(kv, 40, last_fed=False)["held_tokens"] == 39
    assert kv_held({**kv, "quantized_kv_start": 0}, 40)["quantized_tokens"] == 40
    assert kv_held({"kind": "float"}, 40) == {"kind": "float"}


@pytest.mark.parametrize("speculative", [False, True])
def test_the_summary_says_how_many_tokens_the_cache_really_held(speculative):
    """mlx-lm feeds each token before handing it out, so a routed run's cache holds every token
    (the summary said one less, and "none quantized" at the start's boundary); speculative
    decoding keeps what precedes its last token."""
    skip_without_quantized_attention()
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    cache: list = []
    run = stream_speculative_generate if speculative else stream_generate
    out = list(run(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, max_tokens=5, kv_bits=4, quantized_kv_start=0,
                   prompt_cache=cache))
    held = out[-1].run.summary(out[-1])["kv_cache"]["held_tokens"]
    assert held == cache[0].offset == len(PROMPT) + len(out) - (1 if speculative else 0)


@pytest.mark.parametrize("mode", ["routed", "speculative"])
def test_a_stream_stopped_early_finishes_mlx_lms_pending_step(monkeypatch, mode):
    """mlx-lm computes the next step on its generation stream before it yields a token; a stream
    stopped at max_tokens left that step running, and a process exiting right after tore MLX's
    allocator down under the stream's thread (``generate --model smollm2-135m-q4 --kv-bits 4``
    crashed at exit in 3 of 8 runs under ``MALLOC_PERTURB_``). Closing the run waits for it."""
    import gearbx_mlx.pipeline as pipeline

    synced = []
    real = mx.synchronize
    monkeypatch.setattr(pipeline.mx, "synchronize", lambda s=None: synced.append(s) or real(s))
    model, tok = _model(), make_tiny_tokenizer(VOCAB)
    gb = Gearbox(model, GearboxConfig())
    gen = stream_generate if mode == "routed" else stream_speculative_generate
    out = list(gen(model, tok, "hello there", gb, max_tokens=3))
    assert len(out) == 3
    assert pipeline.generation_stream in synced


def test_a_window_applies_where_the_models_own_cache_would_ignore_it():
    """mlx-lm's make_prompt_cache calls a model's own make_cache (llama's), which takes no window:
    max_kv_size did nothing, silently. Where the model's caches are plain growing ones, the
    window is made as mlx-lm makes it for other models, and the cache holds no more than it."""
    import warnings

    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    assert hasattr(model, "make_cache")
    from gearbx_mlx.pipeline import prepare

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = prepare(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, max_tokens=8, max_kv_size=5)
        caches = run.kwargs["prompt_cache"]
        assert len(list(run.tokens())) == 8
    assert all(type(c) is RotatingKVCache and c.max_size == 5 for c in caches)
    assert all(c.keys.shape[2] <= 5 for c in caches)


def test_cli_kv_flags_without_kv_bits_and_an_empty_or_odd_calibration_path_are_errors(tmp_path, capsys):
    import os

    from gearbx_mlx.generate import main

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv, msg in ((["--kv-group-size", "32"], "--kv-group-size applies to a quantized KV cache: give --kv-bits"),
                      (["--quantized-kv-start", "5", "--kv-rotation", "srht"],
                       "--quantized-kv-start, --kv-rotation apply to a quantized KV cache"),
                      (["--calibration", ""], "--calibration needs a file name"),
                      (["--calibration", str(tmp_path)], "is a directory, not a calibration file"),
                      (["--calibration", str(fifo)], "is not a regular file")):
        assert main(["--prompt", "hi", *argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_a_calibration_of_another_vocabulary_names_the_file(tmp_path, capsys):
    from fault_models import tiny_model_folder

    from gearbx_mlx.generate import main

    cal = Calibration(1.0, 3.0, "median", 10, vocab_size=49152)
    path = tmp_path / "other.json"
    cal.save(path)
    folder = tiny_model_folder(tmp_path / "m")
    assert main(["--model", str(folder), "--prompt", "t2 t3", "--calibration", str(path), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --calibration {path}: calibration was made for a vocabulary of 49152"), err


def test_the_speculative_decision_times_the_drafter_and_caches_the_run_uses():
    """With a quantized KV cache the run drafts through the MLX tree over quantized caches; the
    decision timed the host drafter on float caches, a cost the run never had."""
    skip_without_quantized_attention()
    model = _model()
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    for kv in ({"kv_bits": 4}, {}):
        out = list(stream_generate(model, make_tiny_tokenizer(VOCAB), PROMPT, gb, speculative="force", max_tokens=4,
                                   **kv))
        stats = out[-1].stats
        assert stats.plan["drafter"]["path"] == stats.drafter["path"], kv


def test_the_rotated_cache_keeps_the_prompt_in_float_and_quantizes_it_when_it_is_in():
    """With no start given, the prompt is processed on float attention (a prefill over a quantized
    cache ran 3.2x slower) and the whole cache is quantized once the prompt is in: the first token
    is the float cache's, every later one reads the quantized cache, and the summary says so."""
    skip_without_quantized_attention()
    model, tok = _model(), make_tiny_tokenizer(VOCAB)
    assert KVOptions(bits=4).at_prompt_end(9).start == 9
    assert KVOptions(bits=4, quantized_kv_start=0).at_prompt_end(9).start == 0  # a start given is kept
    assert KVOptions(bits=4, rotation="none").at_prompt_end(9).start == KVOptions(bits=4, rotation="none").start
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    plain = list(stream_generate(model, tok, PROMPT, gb, max_tokens=4, policy="high"))
    cache: list = []
    out = list(stream_generate(model, tok, PROMPT, gb, max_tokens=4, policy="high", kv_bits=4, prompt_cache=cache))
    assert out[0].token == plain[0].token
    assert all(type(c) is RotatedQuantizedKVCache for c in cache)
    kv = out[-1].run.summary(out[-1])["kv_cache"]
    assert kv["quantized_kv_start"] == len(PROMPT) and kv["quantized_tokens"] == kv["held_tokens"] > len(PROMPT)


@pytest.mark.parametrize("speculative", [False, True])
def test_a_conversation_on_the_default_start_keeps_its_cache_turn_after_turn(speculative):
    """The default start is each call's prompt end, so it differs from turn to turn; the cache a
    first turn made is still this transform's on the next (it was refused as another basis)."""
    skip_without_quantized_attention()
    model, tok = _model(), make_tiny_tokenizer(VOCAB)
    gb = Gearbox(model, GearboxConfig(scope="all"), vocab_size=VOCAB)
    run = stream_speculative_generate if speculative else stream_generate
    cache: list = []
    for turn in (PROMPT, [9, 10, 11], [12, 13]):
        out = list(run(model, tok, turn, gb, max_tokens=4, kv_bits=4, prompt_cache=cache))
        assert len(out) == 4
    assert all(type(c) is RotatedQuantizedKVCache for c in cache)
