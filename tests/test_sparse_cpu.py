"""The C block-sparse product (csrc/sparse.c): against the pure-MLX masked oracle, its scalar
oracles, odd shapes and sparsities; the block choice; errors; the sparse drafter's host step."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama
from hypothesis import given, settings, strategies as st

from gearbx_mlx.bindings import cpu, guard, sparse_cpu
from gearbx_mlx.speculative.sparse import (
    QuantParts,
    SparseMLP,
    ffn_layers,
    hidden,
    masked_down,
    quant_parts,
    top_blocks,
)

pytestmark = pytest.mark.skipif(not cpu.available() or mx.default_device() != mx.cpu,
                                reason="the C kernels on the CPU device")

#: fp32 activations: the kernel and MLX differ only in summation order.
FLOAT_RTOL, FLOAT_ATOL = 1e-4, 1e-4
#: A fast kernel against its scalar oracle on the same path: summation order only.
ORACLE_RTOL, ORACLE_ATOL = 1e-5, 1e-5
#: int8 activations: each x_j moves by at most d_b / 2 (d_b = max |x_b| / 127 of its block of 32),
#: so |y_r - exact| <= sum_j |deq w_rj| d_b / 2; this slack covers the float sums around it.
INTDOT_SLACK = 1.05


def _layer(inp: int, out: int, group: int, bias: bool, seed: int, dtype=mx.float32) -> nn.QuantizedLinear:
    mx.random.seed(seed)
    lin = nn.Linear(inp, out, bias=bias)
    lin.weight = mx.random.normal((out, inp)) * 0.1
    if bias:
        lin.bias = mx.random.normal((out,))
    q = nn.QuantizedLinear.from_linear(lin, group_size=group, bits=4)
    q.scales, q.biases = q.scales.astype(dtype), q.biases.astype(dtype)
    return q


def _intdot_bound(q: nn.QuantizedLinear, h: mx.array, blocks: np.ndarray, group: int) -> np.ndarray:
    w = np.abs(np.array(mx.dequantize(q.weight, q.scales.astype(mx.float32), q.biases.astype(mx.float32),
                                      group_size=group, bits=4)))
    x = np.array(h).reshape(-1)
    d = np.abs(x).reshape(-1, 32).max(-1) / 127
    keep = np.zeros(x.size // group, bool)
    keep[blocks] = True
    err = np.repeat(d / 2, 32) * np.repeat(keep, group)
    return INTDOT_SLACK * (w @ err) + 1e-5


@settings(max_examples=60, deadline=None)
@given(out=st.integers(1, 70), nb=st.integers(1, 9), group=st.sampled_from([64, 128]), bias=st.booleans(),
       dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]), seed=st.integers(0, 2**16), data=st.data())
def test_sparse_product_matches_the_masked_dense_oracle(out, nb, group, bias, dtype, seed, data):
    """Every path over odd shapes, sparsities and scale dtypes: the dense MLX product with the dropped
    blocks zeroed (float), within the int8 activations' bound (intdot), and its own scalar oracle."""
    q = _layer(nb * group, out, group, bias, seed, dtype)
    h = mx.random.normal((1, nb * group), key=mx.random.key(seed))
    keep = data.draw(st.integers(0, nb))
    blocks = np.sort(np.array(data.draw(st.permutations(range(nb))))[:keep]).astype(np.int32)
    parts = quant_parts(q)
    want = np.array(masked_down(h, q, mx.array(blocks, dtype=mx.uint32), group)).reshape(-1) if keep else (
        np.array(q.bias) if bias else np.zeros(out, np.float32))
    got = {p: np.array(sparse_cpu.sparse_down(h, parts, mx.array(blocks), path=p)).reshape(-1)
           for p in ("float", "ref", "intdot", "intdot_ref")}
    np.testing.assert_allclose(got["float"], want, rtol=FLOAT_RTOL, atol=FLOAT_ATOL)
    np.testing.assert_allclose(got["ref"], want, rtol=FLOAT_RTOL, atol=FLOAT_ATOL)
    np.testing.assert_allclose(got["intdot"], got["intdot_ref"], rtol=ORACLE_RTOL, atol=ORACLE_ATOL)
    assert (np.abs(got["intdot"] - want) <= _intdot_bound(q, h, blocks, group)).all()


def test_result_does_not_depend_on_the_thread_count():
    q = _layer(1536, 576, 64, False, 3)
    h = mx.random.normal((1, 1536), key=mx.random.key(1))
    blocks = mx.array(np.arange(0, 24, 2))
    parts = quant_parts(q)
    prep = sparse_cpu.prepared_sparse(parts)
    assert sparse_cpu.prepared_sparse(parts) is prep  # kept on the parts object
    for path in ("float", "intdot"):
        one = np.array(prep.gemv(h, blocks, path=path, threads=1))
        np.testing.assert_array_equal(one, np.array(prep.gemv(h, blocks, path=path, threads=2)))


def test_only_the_kept_blocks_are_read():
    """Poisoning the dropped blocks' codes, scales and biases (NaN) changes nothing."""
    q = _layer(512, 40, 64, False, 5)
    h = mx.random.normal((1, 512), key=mx.random.key(2))
    blocks = np.array([1, 4, 6], np.int32)
    want = np.array(sparse_cpu.PreparedSparse(quant_parts(q)).gemv(h, blocks))
    s, b, w = np.array(q.scales), np.array(q.biases), np.array(q.weight)
    drop = np.setdiff1d(np.arange(8), blocks)
    s[:, drop], b[:, drop] = np.nan, np.nan
    w.reshape(40, 8, -1)[:, drop] = 0xFFFFFFFF
    poisoned = QuantParts(mx.array(w), mx.array(s), mx.array(b), None, 4, 64)
    for path in ("float", "intdot", "ref"):
        got = np.array(sparse_cpu.PreparedSparse(poisoned).gemv(h, blocks, path=path))
        np.testing.assert_allclose(got, want, rtol=1e-2 if "int" in path else 1e-6, atol=1e-2)


@settings(max_examples=40, deadline=None)
@given(nb=st.integers(1, 40), seed=st.integers(0, 2**16), data=st.data())
def test_c_block_choice_is_the_mlx_one(nb, seed, data):
    h = mx.random.normal((nb * 64,), key=mx.random.key(seed))
    keep = data.draw(st.integers(0, nb + 2))
    got = sparse_cpu.top_blocks(h, 64, keep)
    assert got.size == min(keep, nb)
    if keep:
        np.testing.assert_array_equal(got, np.array(top_blocks(h, min(keep, nb), 64)))


def test_ties_keep_the_lower_block():
    h = np.ones(4 * 64, np.float32)
    np.testing.assert_array_equal(sparse_cpu.top_blocks(h, 64, 2), [0, 1])


@pytest.mark.parametrize("blocks, message", [([2, 1], "shape"), ([0, 8], "shape"), ([-1], "shape"),
                                             ([1, 1], "shape")])
def test_bad_block_lists_are_refused(blocks, message):
    prep = sparse_cpu.PreparedSparse(quant_parts(_layer(512, 8, 64, False, 0)))
    with pytest.raises(ValueError, match="sparse_cpu.gemv"):
        prep.gemv(mx.zeros((1, 512)), np.array(blocks))


def test_weights_the_kernel_does_not_take_are_named():
    lin = nn.Linear(256, 8)
    for bits, group in ((8, 64), (4, 32)):
        parts = quant_parts(nn.QuantizedLinear.from_linear(lin, group_size=group, bits=bits))
        assert "4-bit codes in groups of 64 or 128" in sparse_cpu.unsupported(parts)
        with pytest.raises(ValueError, match="sparse_cpu"):
            sparse_cpu.PreparedSparse(parts)
    mlp = make_tiny_llama(vocab=64, hidden=128, layers=1).model.layers[0].mlp
    nn.quantize(mlp, group_size=32, bits=4)
    assert SparseMLP(mlp, 2).c_reason is not None  # auto falls back to MLX
    with pytest.raises(ValueError, match="the C gather cannot run here"):
        SparseMLP(mlp, 2, "c")


def test_tree_gathers_agree_on_a_one_token_step():
    model = make_tiny_llama(vocab=64, hidden=128, layers=1, seed=7)
    nn.quantize(model, group_size=64, bits=4)
    mlp = ffn_layers(model)[0].mlp
    x = mx.random.normal((1, 1, 128), key=mx.random.key(3))
    want = masked_down(hidden(mlp, x).reshape(1, -1), mlp.down_proj, top_blocks(hidden(mlp, x).reshape(-1), 2, 64), 64)
    for gather in ("auto", "c", "experts", "take"):
        got = SparseMLP(mlp, 2, gather)(x)
        np.testing.assert_allclose(np.array(got).reshape(-1), np.array(want).reshape(-1),
                                   rtol=FLOAT_RTOL, atol=FLOAT_ATOL)


def test_sparse_host_step_is_the_sparse_tree():
    """The sparse drafter's host step (numpy around C, down_proj over the kept blocks) gives the
    logits of its MLX tree fed the same tokens one at a time, on a nested store's low gear."""
    from mlx_lm.models.cache import KVCache

    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.speculative.draft import build_draft
    from gearbx_mlx.speculative.sparse import build_sparse_draft
    from gearbx_mlx.speculative.sparse_host import DOWN_SLOT

    m = make_tiny_llama(vocab=64, hidden=64, seed=3)  # FFN of 128 neurons: 2 blocks, 1 kept
    gb = Gearbox(m, GearboxConfig(scope="all", kernel="packed", store="nested"), vocab_size=64)
    d = build_draft(m, gb, "low", scope="all")
    if d.host is None:
        pytest.skip(f"the host step does not apply here: {d.host_reason}")
    sp = build_sparse_draft(d, 0.5, list(range(1, 60)))
    assert sp.host is not None and sp.sparse["path"] == "host"
    assert any(isinstance(row[DOWN_SLOT], sparse_cpu.TopBlocksProduct) for row in sp.host.layers)
    hc, mc = sp.make_cache(), [KVCache() for _ in sp.module.layers]
    for t in [3, 1, 4, 1, 5, 9, 2, 6]:
        a = np.asarray(sp(mx.array([[t]]), cache=hc))[0, -1]
        b = np.asarray(sp(mx.array([[t]]), cache=mc))[0, -1]
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    from gearbx_mlx.speculative.drafter import make_drafter

    described = make_drafter(sp).describe()
    assert described["path"] == "host" and described["kept_fraction"] == sp.sparse["kept_fraction"]
    assert "of down_proj's 64-neuron blocks (the C block-sparse kernel)" in described["detail"]
    # the tree's dense twin differs: blocks were really dropped
    dense = np.asarray(d.module(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])))[0, -1]
    assert not np.allclose(dense, a, atol=1e-4)


def test_a_kernel_that_fails_its_first_use_check_leaves_the_tree_drafting(monkeypatch):
    """A fast path that disagrees with its scalar oracle: no sparse host step, and the reason is given."""
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.speculative.draft import build_draft
    from gearbx_mlx.speculative.sparse import build_sparse_draft

    m = make_tiny_llama(vocab=64, hidden=64, seed=3)
    d = build_draft(m, Gearbox(m, GearboxConfig(scope="all", kernel="packed", store="nested"), vocab_size=64),
                    "low", scope="all")
    if d.host is None:
        pytest.skip(f"the host step does not apply here: {d.host_reason}")
    real = sparse_cpu.PreparedSparse.gemv

    def broken(self, x, blocks, *, path="float", threads=None, bias=True):
        y = real(self, x, blocks, path=path, threads=threads, bias=bias)
        return y if "ref" in path else y + 1.0

    monkeypatch.setattr(sparse_cpu.PreparedSparse, "gemv", broken)
    with pytest.warns(RuntimeWarning, match="C block-sparse GEMV kernel .* failed its first-use check"):
        sp = build_sparse_draft(d, 0.5, list(range(1, 60)))
    assert sp.host is None and "first-use check" in sp.host_reason and sp.sparse["path"] == "mlx"
    # listed with the guarded kernels' failures (what selftest and the bench report)
    assert any(name.startswith("C block-sparse GEMV") for name in guard.failed())
