"""Fused packed projections (gearbx_mlx.packed.fused): same numbers, fewer launches."""

from __future__ import annotations

from typing import List

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from gearbx_mlx.bindings import gpu, packed_gpu
from gearbx_mlx.packed import formats, fused
from gearbx_mlx.packed.fused import FusedPackedLinear, fusable, fuse_plan
from gearbx_mlx.packed.layers import PackedLinear


def tiny_llama():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=96, tie_word_embeddings=False)
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def packed_model(bits=4, group_size=None):
    model = tiny_llama()
    plan = [(p, PackedLinear.from_linear(m, bits=bits, group_size=group_size))
            for p, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in p]
    model.update_modules(tree_unflatten(plan))
    return model


def param_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("group_size", [None, 64])
def test_fusion_keeps_logits_and_bytes(group_size):
    model = packed_model(4, group_size)
    tokens = mx.array([[1, 5, 7, 2, 9]])
    before, nbytes = model(tokens), param_bytes(model)
    plan = fuse_plan(model)
    # q/k/v and gate/up of both layers.
    assert sorted(p.rsplit(".", 1)[-1] for p, _ in plan) == sorted(
        ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] * 2)
    model.update_modules(tree_unflatten(plan))
    assert isinstance(model.layers[0].self_attn.k_proj, FusedPackedLinear)
    assert param_bytes(model) == nbytes
    # On the CPU every member computes its own rows: bit-identical logits.
    assert mx.array_equal(model(tokens), before)
    # Members' rows are the original layers' rows.
    k = model.layers[1].self_attn.k_proj
    assert k.weight.shape == (64, 64) and k.scales.shape[0] == 64


def test_only_alike_packed_int4_siblings_fuse():
    lin = [nn.Linear(128, 64, bias=False) for _ in range(3)]
    assert fusable([PackedLinear.from_linear(m, bits=4) for m in lin])
    assert not fusable([PackedLinear.from_linear(m, bits=8) for m in lin])      # int8: no mma body
    assert not fusable([PackedLinear.from_linear(lin[0], bits=4),
                        PackedLinear.from_linear(lin[1], bits=4, group_size=64)])  # mixed scales
    assert not fusable(lin)                                                 # not packed
    assert not fusable([PackedLinear.from_linear(nn.Linear(96, 64), bits=4)] * 2)  # K % 64
    model = packed_model(8)
    assert fuse_plan(model) == []


class FakeLauncher:
    """Stands in for the GPU kernel: the reference product, split, and a call count."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, backend, bits, group_size, in_features, out_features, dtype, has_bias, *,
                 mma=None, splits=()):
        assert mma and backend == "cuda"

        def run(x, weight, scales, bias=None) -> List[mx.array]:
            self.calls += 1
            y = formats.reference_matmul(x, weight, scales, bits=bits, group_size=group_size,
                                       in_features=in_features, bias=bias)
            bounds = (0,) + splits + (out_features,)
            return [y[..., a:b] for a, b in zip(bounds, bounds[1:])]

        return run


def test_siblings_share_one_launch_per_input(monkeypatch):
    fake = FakeLauncher()
    monkeypatch.setattr(gpu, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(packed_gpu, "launcher", fake)
    lin = [nn.Linear(128, n, bias=True) for n in (64, 32, 32)]
    layers = [PackedLinear.from_linear(m, bits=4) for m in lin]
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = layers
    plan = fuse_plan(parent)
    parent.update_modules(tree_unflatten(plan))
    x = mx.array(np.random.default_rng(0).standard_normal((1, 1, 128)).astype(np.float32))
    x = x.astype(mx.bfloat16)
    outs = [parent.q_proj(x), parent.k_proj(x), parent.v_proj(x)]
    assert fake.calls == 1
    for got, layer in zip(outs, layers):
        want = formats.reference_matmul(x, layer.weight, layer.scales, bits=4, group_size=None,
                                      in_features=128, bias=layer.bias)
        assert got.shape == want.shape and mx.array_equal(got, want)
    # A new input (the next token) launches again; the same input does not.
    x2 = x + 1
    parent.v_proj(x2)
    parent.q_proj(x2)
    assert fake.calls == 2
    # Prefill (several tokens) takes each member's own product, no fused launch.
    xs = mx.concatenate([x, x2], axis=1)
    y = parent.k_proj(xs)
    assert fake.calls == 2 and y.shape == (1, 2, 32)


def test_fuse_modules_works_on_a_gear_dict():
    """The precision manager's form: path -> layer, siblings found by path."""
    model = packed_model(4, 64)
    gear = {p: m for p, m in model.named_modules() if isinstance(m, PackedLinear)}
    out = fused.fuse_modules(gear)
    assert out.keys() == gear.keys()
    kinds = {p.rsplit(".", 1)[-1]: type(m).__name__ for p, m in out.items()}
    assert kinds["q_proj"] == kinds["up_proj"] == "FusedPackedLinear"
    assert kinds["o_proj"] == kinds["down_proj"] == "PackedLinear"
    # A sibling missing from the dict (not managed) leaves its set unfused.
    del gear["model.layers.0.self_attn.v_proj"]
    out = fused.fuse_modules(gear)
    assert type(out["model.layers.0.self_attn.q_proj"]) is PackedLinear
    assert type(out["model.layers.1.self_attn.q_proj"]) is FusedPackedLinear


def test_packed_gears_of_the_precision_manager_are_fused():
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.precision import PrecisionManager

    model = tiny_llama()
    tokens = mx.array([[3, 1, 4, 1, 5]])
    mgr = PrecisionManager(model, GearboxConfig(kernel="packed", scope="all", store="separate"))
    mgr.shift("low")
    assert isinstance(model.layers[0].self_attn.v_proj, FusedPackedLinear)
    assert isinstance(model.layers[0].mlp.gate_proj, FusedPackedLinear)
    fused_logits = model(tokens)
    # The same gear without fusion: same numbers (prefill and one decode token).
    plain = tiny_llama()
    built = {p: PackedLinear.from_linear(m, bits=4, group_size=64) for p, m in plain.named_modules()
             if isinstance(m, nn.Linear)}
    plain.update_modules(tree_unflatten(list(built.items())))
    assert mx.allclose(fused_logits, plain(tokens), atol=1e-5)
    one = mx.array([[7]])
    assert mx.allclose(model(one), plain(one), atol=1e-5)
    low_bytes = mgr.memory()["low_bytes"]
    assert low_bytes == sum(
        v.nbytes for p, m in built.items() for _, v in tree_flatten(m.parameters()))
    mgr.shift("high")
    assert type(model.layers[0].self_attn.v_proj) is nn.Linear
