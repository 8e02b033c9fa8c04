"""Compiled one-token block steps (gearbx_mlx.blockstep): the block's numbers, fewer calls, one pair per gear."""

from __future__ import annotations

import decode_steps
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten

from gearbx_mlx import blockstep


def tiny(kind="llama"):
    from mlx_lm.models import llama, qwen2

    mod = {"llama": llama, "qwen2": qwen2}[kind]
    args = mod.ModelArgs(model_type=kind, hidden_size=128, num_hidden_layers=2, intermediate_size=192,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=96,
                         tie_word_embeddings=False)
    mx.random.seed(3)
    model = mod.Model(args)
    mx.eval(model.parameters())
    return model


def logits_of(model, tokens, steps=6):
    return decode_steps.step_logits(model, tokens, steps)


def quantized_plan(model, bits):
    return [(p, nn.QuantizedLinear.from_linear(m, 64, bits)) for p, m in model.named_modules()
            if isinstance(m, nn.Linear) and "lm_head" not in p]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_compiled_steps_give_the_blocks_numbers(kind):
    model = tiny(kind)
    paths = [p for p, _ in model.named_modules()]
    ref = logits_of(model, [1, 5, 7])
    assert blockstep.compile_block_steps(model) == 2
    assert [p for p, _ in model.named_modules()] == paths  # the tree a gearbox swaps under is the same
    got = logits_of(model, [1, 5, 7])
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    steps = model.layers[0].__dict__["_gbx_block_steps"]
    assert len(steps) == 1 and all(s is not False for s in steps.values())  # compiled from the second step on


def test_a_gear_shift_gets_its_own_pair():
    model = tiny()
    blockstep.compile_block_steps(model)
    linears = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in p]
    high = logits_of(model, [2, 3])
    gears = {bits: quantized_plan(model, bits) for bits in (4, 8)}
    for bits, plan in gears.items():
        model.update_modules(tree_unflatten(plan))
        blockstep.restore_block_steps(model)
        ref = logits_of(model, [2, 3])  # the gear without compiled steps
        blockstep.compile_block_steps(model)
        model.update_modules(tree_unflatten(plan))
        for a, b in zip(ref, logits_of(model, [2, 3])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    model.update_modules(tree_unflatten(linears))
    for a, b in zip(high, logits_of(model, [2, 3])):  # back in the high gear: its own pair again
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert len(model.layers[1].__dict__["_gbx_block_steps"]) <= blockstep.MAX_STEPS


def test_pairs_are_bounded_and_restore_undoes_everything():
    model = tiny()
    base = type(model.layers[0])
    blockstep.compile_block_steps(model)
    assert blockstep.compile_block_steps(model) == 2  # idempotent
    for bits in (2, 3, 4, 6, 8, 4):
        model.update_modules(tree_unflatten(quantized_plan(tiny(), bits)))
        logits_of(model, [4], steps=2)
    assert len(model.layers[0].__dict__["_gbx_block_steps"]) == blockstep.MAX_STEPS
    blockstep.restore_block_steps(model)
    assert type(model.layers[0]) is base and "_gbx_block_steps" not in model.layers[0].__dict__


def test_unsupported_blocks_are_left_alone():
    class Block(nn.Module):
        def __call__(self, x, mask=None, cache=None):
            return x

    model = nn.Module()
    model.layers = [Block()]
    assert blockstep.compile_block_steps(model) == 0 and type(model.layers[0]) is Block
    assert blockstep.compile_block_steps(nn.Linear(2, 2)) == 0
    llama = tiny()
    llama.layers[0].self_attn.__class__ = type("Other", (type(llama.layers[0].self_attn),), {})
    assert not blockstep.supported(llama.layers[0]) and blockstep.supported(llama.layers[1])
