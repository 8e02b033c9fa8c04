"""The nested store's low gear by mlx-lm's quantizers (``--low-quant``): plane 0 stays an MLX
4-bit layer, the mid and high planes still fit the loaded weights, the choice keys the planes
cache (a second load builds nothing), and bad values are one clear error."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama

from gearbx_mlx import precision
from gearbx_mlx.config import LOW_QUANTS, GearboxConfig
from gearbx_mlx.nested import lowquant
from gearbx_mlx.nested.planes import build_planes, quantize_plane, reference_matmul
from gearbx_mlx.precision import PrecisionManager

IDS = [[1, 5, 9, 42, 7, 3, 100, 17, 250, 64, 33, 8]]
#: KL(loaded || high gear read from every plane), nats per position: the high gear's promise.
HIGH_KL = 1e-5
QUANTIZERS = [m for m in LOW_QUANTS if m != "rtn"]


class ByteTokenizer:
    """A tokenizer of the tiny model's vocabulary: one id per byte of the text."""

    def encode(self, text: str, **_kw):
        return [b % 256 for b in text.encode("utf-8")][:4096]


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """A folder with the tiny model's weights; its 'tokenizer' reads bytes."""
    monkeypatch.setattr(precision, "load_tokenizer", lambda _path: ByteTokenizer())
    d = tmp_path / "model"
    d.mkdir()
    make_tiny_llama().save_weights(str(d / "model.safetensors"))
    return d


def _cfg(low_quant: str, **kw) -> GearboxConfig:
    return GearboxConfig(scope="all", store="nested", low_quant=low_quant, **kw)


def _log_softmax(model) -> np.ndarray:
    z = np.array(model(mx.array(IDS))[0].astype(mx.float32), dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _kl(ref: np.ndarray, got: np.ndarray) -> float:
    return float((np.exp(ref) * (ref - got)).sum(axis=-1).mean())


@pytest.mark.parametrize("method", QUANTIZERS)
def test_the_low_plane_is_an_mlx_4bit_layer_and_the_planes_above_fit_the_loaded_weights(model_dir, method):
    model = make_tiny_llama()
    ref = _log_softmax(model)
    mgr = PrecisionManager(model, _cfg(method, high="planes"), planes_dir=model_dir)
    assert mgr.planes_origin == "built" and mgr.low_quant_seconds > 0
    loaded = dict(make_tiny_llama().named_modules())
    changed = set()
    for p, w in mgr.nested.items():
        planes = w.planes
        low = planes[0]
        assert (low.bits, low.group_size, low.exponent) == (4, 64) + (0,)
        rows, cols = low.shape
        # An MLX QuantizedLinear holding plane 0 computes the low gear's product.
        q = nn.QuantizedLinear(cols, rows, bias=False, group_size=64, bits=4)
        q.weight, q.scales, q.biases = low.weight, low.scales, low.biases
        x = mx.random.normal((3, cols))
        np.testing.assert_allclose(np.array(q(x)), np.array(reference_matmul(x, planes, 1)), rtol=1e-5, atol=1e-5)
        rtn = quantize_plane(loaded[p].weight, 4, 64)
        if not (mx.array_equal(rtn.weight, low.weight) and mx.array_equal(rtn.scales, low.scales)
                and mx.array_equal(rtn.biases, low.biases)):
            changed.add(p)
        # The planes above plane 0 are the residual planes of the loaded weight over this plane 0.
        again = build_planes(loaded[p].weight, [(pl.bits, pl.group_size) for pl in planes], low=low)
        assert all(mx.array_equal(a.weight, b.weight) for a, b in zip(again, planes))
    assert changed, f"{method} left every low plane as round-to-nearest"
    if method == "gptq":  # the tied embedding is the output projection: GPTQ's, through an lm_head
        assert "model.embed_tokens" in changed
    kls = {}
    for gear in ("low", "mid", "high"):
        mgr.shift(gear)
        kls[gear] = _kl(ref, _log_softmax(model))
    assert kls["high"] < HIGH_KL and kls["mid"] < kls["low"], kls


def test_a_second_load_with_the_same_settings_builds_nothing(model_dir, monkeypatch):
    first = PrecisionManager(make_tiny_llama(), _cfg("gptq"), planes_dir=model_dir)
    assert first.planes_origin == "built"
    rtn = PrecisionManager(make_tiny_llama(), _cfg("rtn"), planes_dir=model_dir)
    assert rtn.planes_file != first.planes_file  # the quantizer keys the cache

    def no_build(*_a, **_kw):
        raise AssertionError("the low planes were built again")

    monkeypatch.setattr(precision, "low_planes", no_build)
    monkeypatch.setattr(precision, "build_nested", no_build)
    again = PrecisionManager(make_tiny_llama(), _cfg("gptq"), planes_dir=model_dir)
    assert again.planes_origin == "cache" and again.planes_file == first.planes_file
    assert again.low_quant_seconds == 0.0
    for p in first.paths:
        for a, b in zip(first.nested[p].planes, again.nested[p].planes):
            assert mx.array_equal(a.weight, b.weight) and mx.array_equal(a.scales, b.scales)


def test_bad_low_quant_settings_are_one_clear_error():
    with pytest.raises(ValueError, match="low_quant must be one of"):
        GearboxConfig(low_quant="hqq")
    with pytest.raises(ValueError, match="needs store='nested'"):
        GearboxConfig(low_quant="gptq", store="separate")
    with pytest.raises(ValueError, match="no configuration for 'mamba'"):
        lowquant.check_low_quant("awq", "mamba")
    with pytest.raises(ValueError, match="load a local model"):
        PrecisionManager(make_tiny_llama(), _cfg("gptq"))
    # Where the store resolves to separate copies, or nothing is swapped, the quantizer would be
    # ignored: refused instead.
    with pytest.raises(ValueError, match="needs store='nested'"):
        PrecisionManager(make_tiny_llama(), GearboxConfig(low_quant="gptq", bits={"low": 4, "mid": 6}))
    with pytest.raises(ValueError, match="runs telemetry only"):
        PrecisionManager(make_tiny_llama(), GearboxConfig(low_quant="gptq", telemetry_only=True))


@pytest.mark.parametrize("argv, message", [
    (["--low-quant", "hqq"], "invalid choice: 'hqq'"),
    (["--low-quant", "gptq", "--store", "separate"], "needs the nested store, not --store separate"),
    (["--low-quant", "dwq", "--telemetry-only"], "needs the nested store, not --telemetry-only"),
])
def test_bad_low_quant_flags_are_one_error_line_before_loading(argv, message, capsys, monkeypatch):
    generate = importlib.import_module("gearbx_mlx.generate")  # the package exports a function of that name
    monkeypatch.setattr(generate, "load", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) if "hqq" in argv else _nothing():
        code = generate.main(["--prompt", "hi", *argv])
        assert code != 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_cli_records_the_quantizer_and_a_second_run_builds_nothing(tmp_path, monkeypatch, capsys):
    from fault_models import tiny_model_folder

    from gearbx_mlx.telemetry.trace import read_trace

    generate = importlib.import_module("gearbx_mlx.generate")
    folder = tiny_model_folder(tmp_path / "m")
    argv = ["--model", str(folder), "--scope", "all", "--low-quant", "gptq", "-p", "Hello", "-m", "3"]
    assert generate.main(argv + ["--trace", str(tmp_path / "a.jsonl")]) == 0
    assert "Low gear: mlx-lm's GPTQ (--low-quant), built in" in capsys.readouterr().err
    first = read_trace(tmp_path / "a.jsonl")
    assert first.header["low_quant"] == "gptq" and first.header["store"] == "nested"
    assert first.summary["low_quant_seconds"] > 0

    def no_build(*_a, **_kw):
        raise AssertionError("the low planes were built again")

    monkeypatch.setattr(precision, "low_planes", no_build)
    assert generate.main(argv + ["--trace", str(tmp_path / "b.jsonl")]) == 0
    assert "Low gear: mlx-lm's GPTQ (--low-quant), read from the planes cache" in capsys.readouterr().err
    second = read_trace(tmp_path / "b.jsonl")
    assert second.header["low_quant"] == "gptq" and second.summary["low_quant_seconds"] == 0


def _tokens(n: int = 6, length: int = 16) -> mx.array:
    return mx.array(np.random.default_rng(0).integers(0, 256, size=(n, length)), dtype=mx.int32)


def test_gptq_in_groups_of_layers_gives_the_planes_of_one_pass():
    """A Hessian budget smaller than one layer's quantizes each layer in a calibration pass of
    its own: the planes are those of the pass over every layer (the Hessians are of the
    loaded model's inputs either way), so the planes cache key does not name the budget."""
    import dataclasses

    from gearbx_mlx.config import LOW_QUANT

    model = make_tiny_llama()
    paths = [p for p, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    tokens = _tokens()
    one = lowquant.low_planes(model, paths, "gptq", tokens, 64, LOW_QUANT)
    shapes = {p: m.weight.shape for p, m in model.named_modules() if type(m) is nn.Linear}
    assert len(lowquant.hessian_groups(shapes, 1)) == len(shapes)
    assert lowquant.hessian_groups(shapes, LOW_QUANT.gptq_hessian_bytes) == [list(shapes)]
    each = lowquant.low_planes(model, paths, "gptq", tokens, 64, dataclasses.replace(LOW_QUANT, gptq_hessian_bytes=1))
    assert set(one) == set(each) == set(paths)
    for p in paths:
        for name in ("weight", "scales", "biases"):
            assert mx.array_equal(getattr(one[p], name), getattr(each[p], name)), (p, name)
    assert "gptq_hessian_bytes" not in lowquant.settings_of("gptq")


def test_the_quantizers_student_shares_the_models_buffers(monkeypatch):
    """The student a quantizer works on holds no second copy of the weights (a 1.5B float32
    model is 7 GB: MLX's copy of an evaluated array shares its buffer), and what the quantizer
    writes into it leaves the model as loaded."""
    model = make_tiny_llama()
    mx.eval(model.parameters())
    before = {k: np.array(v) for k, v in _flat(model).items()}
    seen = {}

    def spy(student, teacher, paths, tokens, group_size, settings):
        mx.eval(student.parameters())
        seen["bytes"] = mx.get_active_memory() - seen["start"]
        for p in paths:
            m = dict(student.named_modules())[p]
            m.weight[0] = 1e3  # a write into the student's array
            mx.eval(m.weight)
            if isinstance(m, nn.Embedding):
                new = nn.QuantizedEmbedding.from_embedding(m, group_size, 4)
            else:
                new = nn.QuantizedLinear.from_linear(m, group_size, 4)
            student.update_modules(lowquant.tree_unflatten([(p, new)]))

    monkeypatch.setitem(lowquant.QUANTIZERS, "gptq", spy)
    paths = [p for p, m in model.named_modules() if type(m) is nn.Linear]
    mx.clear_cache()
    seen["start"] = mx.get_active_memory()
    lowquant.low_planes(model, paths, "gptq", _tokens(), 64)
    weights = sum(v.nbytes for v in _flat(model).values())
    assert seen["bytes"] < weights / 10, (seen["bytes"], weights)
    for k, v in _flat(model).items():
        np.testing.assert_array_equal(np.array(v), before[k], err_msg=k)


def _flat(model) -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.parameters()))
