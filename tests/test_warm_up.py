"""The command's warm-up at load (``gearbx_mlx.generation.warm_up``): one token through the model
with a throwaway cache, so that a fresh process's first prompt finds its buffers in MLX's cache
instead of faulting in fresh pages, and nothing the model or the gearbox holds changes."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from gearbx_mlx import generation
from gearbx_mlx.gearbox import Gearbox

#: A fresh process: the default model on the nested store, then the page faults (getrusage's
#: minor faults) of its first prompt window, mlx-lm's prompt time, with or without the warm-up.
CHILD = r"""
import json, resource, sys
import gearbx_mlx
from gearbx_mlx import generation
from gearbx_mlx.chat import apply_chat_template
model, tok, gb = gearbx_mlx.load(None, scope="all", store="nested")
if sys.argv[1] == "warm":
    generation.warm_up(model)
generation.settle_loaded()
prompt = "Explain how a bicycle gearbox works, and why a rider shifts between the gears on a hill."
run = gearbx_mlx.prepare(model, tok, apply_chat_template(tok, prompt, None, use_template=True), gb,
                         max_tokens=2, prompt_text=prompt)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
first = next(run.tokens())
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
run.close()
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
cache = make_prompt_cache(model)
mx.eval(model(mx.array([[0]]), cache=cache))  # the KV cache's first step: what the warm-up leaves for reuse
kv_pages = sum(c.keys.nbytes + c.values.nbytes for c in cache) // 4096
print(json.dumps({"faults": faults, "prompt_tokens": first.prompt_tokens, "kv_pages": kv_pages}))
"""


def test_warm_up_changes_no_output_and_no_gearbox_state(tiny_llama):
    gearbox = Gearbox(tiny_llama)
    ids = mx.array([[3, 17, 42, 9, 120]])
    cache = make_prompt_cache(tiny_llama)
    before = tiny_llama(ids, cache=cache)
    mx.eval(before)
    kv_bytes = sum(c.keys.nbytes + c.values.nbytes for c in cache)  # the first step: 256 positions a layer
    del cache
    summary = json.dumps(gearbox.summary(), sort_keys=True, default=str)
    mx.clear_cache()
    generation.warm_up(tiny_llama)
    assert mx.get_cache_memory() >= kv_bytes  # its buffers, the KV cache's among them, wait in MLX's cache
    after = tiny_llama(ids, cache=make_prompt_cache(tiny_llama))
    assert mx.array_equal(before, after).item()
    assert json.dumps(gearbox.summary(), sort_keys=True, default=str) == summary


def test_the_command_warms_up_before_the_prompt(monkeypatch):
    """``generate`` warms the model up once it is loaded, before the prompt's window."""
    generate = importlib.import_module("gearbx_mlx.generate")  # the module (the package names a function so)

    order = []
    monkeypatch.setattr(generate, "warm_up", lambda model: order.append("warm_up"))
    monkeypatch.setattr(generate, "settle_loaded", lambda: order.append("settle"))
    monkeypatch.setattr(generate, "run_loaded", lambda *a, **k: order.append("prompt") or 0)
    monkeypatch.setattr(generate, "load", lambda *a, **k: (object(), object(), object()))
    monkeypatch.setattr(generate, "check_sparse_model", lambda *a: None)
    monkeypatch.setattr(generate, "set_thresholds", lambda *a: "prefill")
    monkeypatch.setattr(generate, "check_thresholds", lambda g: None)
    monkeypatch.setattr(generate, "_templated", lambda *a: "text")
    assert generate._run(generate.build_parser().parse_args(["--prompt", "hello", "--max-tokens", "1"]), None) == 0
    assert order == ["warm_up", "settle", "prompt"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="getrusage's page-fault counts as Linux keeps them")
def test_the_first_prompt_faults_in_far_fewer_pages_after_the_warm_up(default_model):
    """The default model on the nested store, a fresh process each: without the warm-up the first
    window faulted in about 3,400 pages with OpenBLAS and 5,800-6,400 with MLX's reference BLAS,
    with it about 370 and 3,000-3,500: fewer by most of the pages of mlx-lm's KV cache's first
    step (256 positions a layer, 2,880 pages here), which the warm-up leaves in MLX's buffer
    cache. Counted, not timed (a count does not move with the machine's load)."""
    counts = {}
    for mode in ("cold", "warm"):
        out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=300,
                             check=True, env=dict(os.environ))
        counts[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["cold"]["prompt_tokens"] == counts["warm"]["prompt_tokens"] > 16
    assert counts["cold"]["kv_pages"] > 1000
    assert counts["cold"]["faults"] - counts["warm"]["faults"] > 0.5 * counts["cold"]["kv_pages"], counts
