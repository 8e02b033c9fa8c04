"""Fused nested projections (gearbx_mlx.nested.fused): the siblings' gears in one product, same numbers.

The group's one-launch path runs where a GPU is the default device; here the
group is told a GPU is there (its product then takes this machine's kernels
over the stacked rows), which is the logic under test: stacking, the
exponents, the row slices, one product per input.
"""

from __future__ import annotations

from types import SimpleNamespace

import decode_steps
import mlx.core as mx
import numpy as np
import pytest

from gearbx_mlx.nested import fused as nested_fused
from gearbx_mlx.nested.fused import FusedNestedLinear, fuse_nested_views, stack_planes
from gearbx_mlx.nested.layers import NestedWeights, make_view
from gearbx_mlx.nested.matmul import NestedProduct

PLAN = ((4, 64), (4, 32), (6, 64))


def siblings(scales=(1.0, 8.0, 0.125), rows=(64, 32, 32), in_features=128, bias=False):
    """Planes of three sibling matrices of different magnitudes (so their residual exponents differ)."""
    out = []
    for i, (s, o) in enumerate(zip(scales, rows)):
        w = mx.random.normal((o, in_features), key=mx.random.key(5 + i)) * (0.02 * s)
        b = mx.random.normal((o,), key=mx.random.key(50 + i)) * 0.1 if bias else None
        out.append(NestedWeights.from_weight(w, b, plan=PLAN))
    return out


@pytest.fixture
def gpu_told(monkeypatch):
    """The group sees a GPU backend; count the products it runs."""
    monkeypatch.setattr(nested_fused, "gpu", SimpleNamespace(gpu_backend=lambda: "cuda"))
    calls = []
    real = NestedProduct.__call__

    def counted(self, x, n, bias=None):
        calls.append(self.out_features)
        return real(self, x, n, bias)

    monkeypatch.setattr(NestedProduct, "__call__", counted)
    return calls


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_members_match_their_own_views(gpu_told, n, bias):
    members = siblings(bias=bias)
    assert len({m.exponents for m in members}) > 1  # the exponents differ: re-expressed
    paths = ["attn.q_proj", "attn.k_proj", "attn.v_proj"]
    views = {p: make_view(m, n, False) for p, m in zip(paths, members)}
    views["attn.o_proj"] = make_view(siblings()[0], n, False)  # no siblings: left as it is
    fused = fuse_nested_views(views)
    assert all(type(fused[p]) is FusedNestedLinear for p in paths)
    assert fused["attn.o_proj"] is views["attn.o_proj"]
    x = mx.random.normal((1, 1, 128), key=mx.random.key(9))
    gpu_told.clear()
    ys = [fused[p](x) for p in paths]
    low_mlx = views[paths[0]].through_mlx
    assert gpu_told == ([] if low_mlx else [128])  # one product for the three (a low gear on a GPU: MLX's call)
    for p, y in zip(paths, ys):
        ref = views[p](x)
        assert y.shape == ref.shape
        np.testing.assert_allclose(np.array(y), np.array(ref), rtol=2e-5, atol=2e-6)
    # Another input, or the members called out of order, still give each member its rows.
    x2 = x + 1
    assert np.allclose(np.array(fused[paths[2]](x2)), np.array(views[paths[2]](x2)), rtol=2e-5, atol=2e-6)
    # Several rows (a prompt) take each member's own product.
    xs = mx.random.normal((1, 3, 128), key=mx.random.key(2))
    np.testing.assert_allclose(np.array(fused[paths[1]](xs)), np.array(views[paths[1]](xs)), rtol=2e-5, atol=2e-6)


def test_low_gear_through_mlx_is_one_quantized_matmul(gpu_told):
    members = siblings(bias=True)
    paths = ["mlp.gate_proj", "mlp.up_proj"]
    views = {p: make_view(m, 1, False, fused=False) for p, m in zip(paths, members[:2])}
    assert all(v.through_mlx for v in views.values())  # the oracle of one plane is MLX's own call
    fused = fuse_nested_views(views)
    x = mx.random.normal((1, 1, 128), key=mx.random.key(4))
    for p in paths:
        assert mx.array_equal(fused[p](x), views[p](x))  # the same rows of the same call
    oracle = {p: make_view(m, 2, False, fused=False) for p, m in zip(paths, members[:2])}
    assert fuse_nested_views(oracle) == oracle  # the oracle asked for: left alone


def test_gears_share_one_stacked_copy():
    members = siblings(rows=(64, 64, 64))
    groups: dict = {}
    paths = ["mlp.gate_proj", "mlp.up_proj"]
    by_gear = {n: fuse_nested_views({p: make_view(m, n, False) for p, m in zip(paths, members)}, groups)
               for n in (1, 2, 3)}
    assert len(groups) == 1
    stacked = [by_gear[n][paths[0]]._group for n in (1, 2, 3)]
    assert stacked[0] is stacked[1] is stacked[2]


def test_unstackable_siblings_stay_apart():
    a = siblings()
    b = NestedWeights.from_weight(mx.random.normal((32, 128)) * 0.02, plan=((4, 64), (8, 64)))
    assert stack_planes([a[0], b]) is None
    views = {"attn.q_proj": make_view(a[0], 2, False), "attn.k_proj": make_view(b, 2, False),
             "attn.v_proj": make_view(a[2], 2, False)}
    assert fuse_nested_views(views) == views
    mixed = {"attn.q_proj": make_view(a[0], 2, False), "attn.k_proj": make_view(a[1], 3, False),
             "attn.v_proj": make_view(a[2], 2, False)}
    assert fuse_nested_views(mixed) == mixed  # views of different gears


def test_a_rescale_that_is_not_exact_refuses():
    """A plane whose scales would leave float16's range is not re-expressed (the siblings stay apart)."""
    members = siblings(scales=(1.0, 1.0, 1.0))
    big = members[0].planes[1]
    tiny = nested_fused.Plane(big.weight, big.scales.astype(mx.float16) * 0 + 6e-8, big.biases.astype(mx.float16),
                              big.bits, big.group_size, big.exponent - 30)
    assert nested_fused._at_exponent(tiny, big.exponent) is None


def _steps(model, tokens=(3, 9, 4), steps=4):
    return decode_steps.step_logits(model, tokens, steps)


@pytest.mark.parametrize("kernel", ["packed", "mlx"])
def test_the_manager_on_a_gpu_fuses_groups_and_compiles_steps(monkeypatch, kernel):
    """Where the precision manager sees a GPU: every gear's siblings fused (with the packed
    kernels), one stacked copy of their planes (each member's are row slices of it), and the
    blocks' one-token steps compiled (with MLX's kernels: the C kernels of this CPU evaluate,
    so they cannot be traced); every gear's decode logits as without either."""
    import dataclasses

    from conftest import make_tiny_llama

    from gearbx_mlx import blockstep, precision
    from gearbx_mlx.config import GearboxConfig

    config = GearboxConfig(scope="all", store="nested", high="planes", kernel=kernel)
    plain = precision.PrecisionManager(make_tiny_llama(tie=False), config)
    monkeypatch.setattr(precision, "gpu", SimpleNamespace(gpu_backend=lambda: "cuda"))
    monkeypatch.setattr(precision, "NESTED_KERNELS", dataclasses.replace(
        precision.NESTED_KERNELS, gpu_block_steps=kernel == "mlx"))
    mgr = precision.PrecisionManager(make_tiny_llama(tie=False), config)
    q = "model.layers.0.self_attn.q_proj"
    fused = isinstance(mgr.cache["mid"][q], FusedNestedLinear)
    assert fused == (kernel == "packed")
    if fused:
        assert mgr.nested[q] is mgr.cache["mid"][q]["nested"] is mgr.cache["low"][q]["nested"]
    compiled = isinstance(mgr.model.layers[0], blockstep.CompiledStep)
    assert compiled == (kernel == "mlx")
    for gear in ("low", "mid", "high"):
        plain.shift(gear)
        mgr.shift(gear)
        for a, b in zip(_steps(plain.model), _steps(mgr.model)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
