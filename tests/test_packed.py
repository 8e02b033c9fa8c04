"""PackedLinear / PackedEmbedding: storage, dispatch, and outputs vs the oracle.

Runs on any machine. On the CPU the GPU call sites are exercised through the
reference: `gpu.gpu_backend` and `packed_gpu.gemv` are replaced by stand-ins
that validate the launch arguments and return the reference product. On a
CUDA machine the same tests run the real twin (see also test_kernels_cuda.py).
"""

from __future__ import annotations

import re
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from gearbx_mlx.bindings import gpu, packed_gpu
from gearbx_mlx.packed import formats, layers
from gearbx_mlx.packed.layers import PackedEmbedding, PackedLinear, backend_for

#: Output of a packed layer vs the oracle, relative to sum |terms| of the
#: product (float32 accumulation order) plus one output ulp (see test_kernels_cuda).
ACCUM_TOL = 1e-4
OUTPUT_RTOL = {mx.float32: 2.0**-21, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
#: A dequant-cache product (weights rounded to the input dtype first) vs the oracle.
CACHE_RTOL = {mx.float32: 1e-5, mx.float16: 2.0**-9, mx.bfloat16: 2.0**-6}
#: 8-bit per-row logits of a tiny model vs its float32 logits.
MODEL_ATOL_8BIT = 0.05

ODD_SHAPES = [(67, 96), (33, 4104)]
HAS_CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()


def linear(out_features, in_features, bias=True, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    lin.set_dtype(dtype)
    return lin


def assert_matches_oracle(y, layer, x, bias):
    in_features = layer.in_features
    ref = formats.reference_matmul(x, layer.weight, layer.scales, bits=layer.bits,
                                 group_size=layer.group_size, in_features=in_features,
                                 bias=bias)
    mag = mx.abs(x.astype(mx.float32)) @ mx.abs(layer.dequantized_weight()).T
    y32, r32 = np.array(y.astype(mx.float32)), np.array(ref.astype(mx.float32))
    bound = OUTPUT_RTOL[x.dtype] * np.abs(r32) + ACCUM_TOL * np.array(mag) + 1e-6
    assert np.all(np.abs(y32 - r32) <= bound)


class FakeKernel:
    """Stands in for an ``mx.fast.cuda_kernel``: checks the call, returns the oracle."""

    def __init__(self, name: str, has_bias: bool, consts_source: str, calls: list):
        self.name, self.has_bias, self.calls = name, has_bias, calls
        # The constants the real kernel would be compiled with.
        self.consts = {k: int(v) for k, v in re.findall(r"constexpr int (\w+) = (\d+);",
                                                         consts_source)}
        self.dtype_name = re.search(r"using T = (\w+);", consts_source).group(1)

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes):
        t = dict(self.consts)
        w, scales, x = inputs[:3]
        bias = inputs[3] if self.has_bias else None
        assert len(inputs) == 3 + self.has_bias and x.size == x.shape[-1]
        assert threadgroup == (256, 1, 1) and grid[0] % 256 == 0
        assert gpu.TYPE_NAMES["cuda"][x.dtype] == self.dtype_name
        assert x.dtype == output_dtypes[0]
        assert output_shapes == [x.shape[:-1] + (w.shape[0],)]
        gs = t["GS"] or None
        self.calls.append({"name": self.name, "template": t, "x_shape": x.shape})
        # The matrix-unit kernel (no BITS constant) is int4 only.
        return [formats.reference_matmul(x, w, scales, bits=t.get("BITS", 4), group_size=gs,
                                       in_features=x.shape[-1], bias=bias)]


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend the default device is a CUDA GPU whose kernels compute the oracle.

    Everything between the layer and ``mx.fast.cuda_kernel`` runs for real.
    Returns the list of kernel calls.
    """
    if HAS_CUDA:
        pytest.skip("a real CUDA GPU is present: the real twin runs instead")
    calls = []
    monkeypatch.setattr(gpu, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(packed_gpu, "build_kernel",
                        lambda backend, name, has_bias, consts, mma=False, n_out=1:
                        FakeKernel(name, has_bias, consts, calls))
    packed_gpu.launcher.cache_clear()
    yield calls
    packed_gpu.launcher.cache_clear()


@pytest.fixture(autouse=True)
def float_cpu_path(monkeypatch):
    """The C kernels' float32 path: the oracle's arithmetic (int8 activations
    are tested on their own, with their own bound)."""
    monkeypatch.setattr(layers, "CPU_GEMV_PATH", "float")


# -- storage -------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 6, 4, 2])
@pytest.mark.parametrize("group_size", [None, 32])
def test_parameters_are_the_packed_bytes(bits, group_size):
    layer = PackedLinear.from_linear(linear(67, 96), bits=bits, group_size=group_size)
    params = dict(tree_flatten(layer.parameters()))
    assert set(params) == {"weight", "scales", "bias"}
    n_groups = 1 if group_size is None else 96 // group_size
    expected = 67 * 96 * bits // 8 + 67 * n_groups * 4 + 67 * 2
    assert sum(v.nbytes for v in params.values()) == expected
    assert layer.trainable_parameters() == {}
    assert "bits=%d" % bits in repr(layer)


def test_dequant_cache_is_not_a_parameter():
    layer = PackedLinear.from_linear(linear(67, 96), bits=4, dequant_cache=True)
    layer(mx.ones((2, 96), dtype=mx.bfloat16))
    assert set(dict(tree_flatten(layer.parameters()))) == {"weight", "scales", "bias"}


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Linear"):
        PackedLinear.from_linear(nn.Embedding(10, 64), bits=4)
    with pytest.raises(TypeError, match="nn.Embedding"):
        PackedEmbedding.from_embedding(nn.Linear(64, 10), bits=4)
    with pytest.raises(ValueError, match="bit width"):
        PackedLinear.from_linear(linear(8, 64), bits=3)
    with pytest.raises(ValueError, match="multiple of group_size"):
        PackedLinear.from_linear(linear(8, 96), bits=4, group_size=64)
    with pytest.raises(ValueError, match="expects 96"):
        PackedLinear.from_linear(linear(8, 96), bits=4)(mx.ones((1, 64)))
    # bits and group_size are keywords, as nn.QuantizedLinear.from_linear names
    # them (its positional order is the opposite: group size first).
    with pytest.raises(TypeError):
        PackedLinear.from_linear(linear(8, 64), 4, 64)
    with pytest.raises(TypeError):
        PackedEmbedding.from_embedding(nn.Embedding(10, 64), 4)


# -- dispatch ------------------------------------------------------------------------


def test_backend_for_on_this_machine():
    x1 = mx.ones((1, 1, 96))
    cpu = layers.cpu_backend() is not None
    if gpu.gpu_backend() is None:
        assert backend_for(x1, 4, 96, 67) == ("cpu" if cpu else "reference")
        # No C kernel for int6/int2: the reference.
        assert backend_for(x1, 6, 96, 67) == "reference"
    assert backend_for(mx.ones((2, 96)), 4, 96, 67) == "reference"  # prefill
    assert backend_for(mx.ones((2, 96)), 4, 96, 67, dequant_cache=True) == "dequant-cache"


def test_backend_for_a_gpu_is_decided_at_call_time(monkeypatch):
    monkeypatch.setattr(gpu, "gpu_backend", lambda: "metal")
    x = mx.ones((1, 96), dtype=mx.float16)
    assert backend_for(x, 4, 96, 67) == "metal"
    assert backend_for(x, 6, 96, 67) == "reference"  # no int6 kernel
    assert backend_for(mx.ones((1, 36)), 4, 36, 67) == "reference"  # K % 8
    assert backend_for(mx.ones((3, 96)), 4, 96, 67) == "reference"
    monkeypatch.setattr(gpu, "gpu_backend", lambda: None)
    assert backend_for(x, 4, 96, 67) in ("cpu", "reference")


# -- outputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 6, 4, 2])
@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_single_token_and_prefill_match_the_oracle(bits, shape, dtype):
    out_features, in_features = shape
    lin = linear(out_features, in_features, dtype=dtype)
    layer = PackedLinear.from_linear(lin, bits=bits)
    for x_shape in ((1, 1, in_features), (in_features,), (2, 3, in_features)):
        x = mx.random.normal(x_shape).astype(dtype)
        y = layer(x)
        assert y.shape == x_shape[:-1] + (out_features,) and y.dtype == dtype
        assert_matches_oracle(y, layer, x, lin.bias)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_gpu_call_site_through_the_reference(fake_gpu, bits, group_size, shape):
    out_features, in_features = shape
    if group_size and in_features % group_size:
        pytest.skip("K not a multiple of the group")
    lin = linear(out_features, in_features, bias=bits == 4)
    layer = PackedLinear.from_linear(lin, bits=bits, group_size=group_size)
    x = mx.random.normal((1, 1, in_features)).astype(mx.bfloat16)
    assert layer.backend_for(x) == "cuda"
    y = layer(x)
    assert len(fake_gpu) == 1 and y.shape == (1, 1, out_features)
    call = fake_gpu[0]
    assert call["x_shape"] == (1, 1, in_features)  # passed as is: no reshape node
    assert ("_bias_" in call["name"]) == (bits == 4)
    assert call["template"]["BITS"] == bits and call["template"]["GS"] == (group_size or 0)
    assert_matches_oracle(y, layer, x, lin.get("bias"))
    layer(mx.random.normal((2, in_features)).astype(mx.bfloat16))  # prefill: no kernel
    assert len(fake_gpu) == 1


def test_cpu_call_site_with_a_stand_in(monkeypatch):
    """The C kernel's contract: float32 (O,) out; bias and cast are the layer's job."""
    seen = {}

    def fake_cpu_gemv(weight, scales, x, *, bits, group_size, in_features, path="auto",
                      threads=None):
        seen.update(bits=bits, group_size=group_size, x=x, path=path)
        return formats.reference_matmul(x, weight, scales, bits=bits, group_size=group_size,
                                      in_features=in_features).astype(mx.float32)

    stand_in = types.SimpleNamespace(available=lambda: True, gemv=fake_cpu_gemv)
    monkeypatch.setattr(layers, "cpu_backend", lambda: stand_in)
    monkeypatch.setattr(gpu, "gpu_backend", lambda: None)
    lin = linear(33, 4104)
    layer = PackedLinear.from_linear(lin, bits=8)
    x = mx.random.normal((1, 1, 4104)).astype(mx.bfloat16)
    assert layer.backend_for(x) == "cpu"
    y = layer(x)
    assert seen["x"].shape == (4104,) and seen["bits"] == 8 and seen["path"] == "float"
    assert y.dtype == mx.bfloat16 and y.shape == (1, 1, 33)
    assert_matches_oracle(y, layer, x, lin.bias)


#: The C kernels' default path rounds activations to int8, one scale per block
#: of 32: each x_j moves by at most max|x_block| / 254.
ACT_BLOCK = 32


@pytest.mark.skipif(layers.cpu_backend() is None, reason="gearbx_mlx.bindings.cpu is not built")
@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_kernels_int8_activation_path(monkeypatch, bits):
    monkeypatch.setattr(layers, "CPU_GEMV_PATH", "auto")
    monkeypatch.setattr(gpu, "gpu_backend", lambda: None)
    lin = linear(67, 96)
    layer = PackedLinear.from_linear(lin, bits=bits, group_size=32)
    x = mx.random.normal((1, 96)).astype(mx.float32)
    assert layer.backend_for(x) == "cpu"
    y = np.array(layer(x).astype(mx.float32))[0]
    ref = np.array(formats.reference_matmul(x, layer.weight, layer.scales, bits=bits,
                                          group_size=32, in_features=96, bias=lin.bias))[0]
    xb = np.abs(np.array(x)[0]).reshape(-1, ACT_BLOCK).max(axis=1) / 254
    wb = np.abs(np.array(layer.dequantized_weight())).reshape(67, -1, ACT_BLOCK).sum(axis=2)
    bound = wb @ xb * (1 + 1e-3) + 1e-4 + 2.0**-7 * np.abs(ref)
    assert np.all(np.abs(y - ref) <= bound)


def test_dequant_cache_reuses_and_invalidates():
    lin = linear(67, 96)
    layer = PackedLinear.from_linear(lin, bits=4, group_size=32, dequant_cache=True)
    x = mx.random.normal((2, 96)).astype(mx.bfloat16)
    y = layer(x)
    cached = layer.runtime.weight
    assert cached is not None and cached.dtype == mx.bfloat16
    layer(x)
    assert layer.runtime.weight is cached  # reused
    ref = formats.reference_matmul(x, layer.weight, layer.scales, bits=4, group_size=32,
                                 in_features=96, bias=lin.bias)
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               rtol=CACHE_RTOL[mx.bfloat16], atol=0.05)
    layer(x.astype(mx.float32))
    assert layer.runtime.weight.dtype == mx.float32  # rebuilt for the new dtype
    layer.clear_cache()
    assert layer.runtime.weight is None


# -- embeddings and a tied-embedding model ---------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_embedding_lookup_and_as_linear(bits):
    mx.random.seed(1)
    emb = nn.Embedding(100, 64)
    emb.set_dtype(mx.bfloat16)
    pe = PackedEmbedding.from_embedding(emb, bits=bits, group_size=32)
    ids = mx.array([[3, 99, 0], [5, 5, 7]])
    rows = pe(ids)
    assert rows.shape == (2, 3, 64) and rows.dtype == mx.bfloat16
    table = formats.dequantize(pe.weight, pe.scales, bits, 32, 64, mx.bfloat16)
    assert mx.array_equal(rows, table[ids]).item()
    x = mx.random.normal((1, 1, 64)).astype(mx.bfloat16)
    y = pe.as_linear(x)
    assert y.shape == (1, 1, 100)
    assert_matches_oracle(y, pe, x, None)


def test_tied_llama_runs_fully_packed():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    tokens = mx.array([[1, 5, 9, 200]])
    ref = model(tokens)
    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear):
            swaps.append((path, PackedLinear.from_linear(m, bits=8)))
        elif isinstance(m, nn.Embedding):
            swaps.append((path, PackedEmbedding.from_embedding(m, bits=8)))
    model.update_modules(tree_unflatten(swaps))
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    out = model(tokens)
    assert out.shape == ref.shape
    assert mx.max(mx.abs(out - ref)).item() < MODEL_ATOL_8BIT
