"""Decode speed of each policy on the real kernels.

Each policy decodes the same stretch of text through the real machinery:
``gearbx_mlx.stream_generate`` (mlx-lm's decode loop, the routing session,
``PrecisionManager`` swaps of MLX ``QuantizedLinear``/``QuantizedEmbedding``
layers). A forcing sampler returns the text's next token instead of a
sampled one, so every policy does exactly the same work: a prompt of
``prompt_tokens`` tokens, then ``decode_tokens`` decode steps. The speed is
mlx-lm's own ``generation_tps``. Speed varies run to run; quality does not
come from here.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate as mlx_stream

from ..config import GearboxConfig
from ..gearbox import Gearbox
from ..pipeline import stream_generate
from ..precision import mlx_quantizer
from .specs import ModelLayout, PolicySpec


def forcing_sampler(tokens: Sequence[int]) -> Callable[[mx.array], mx.array]:
    """A sampler that returns ``tokens`` in order (then repeats the last one).

    mlx-lm calls its sampler once per step, in order, including one step it
    queues past ``max_tokens``.
    """
    count = [0]

    def sampler(logprobs: mx.array) -> mx.array:
        i = min(count[0], len(tokens) - 1)
        count[0] += 1
        return mx.array([tokens[i]], dtype=mx.uint32)

    return sampler


class SpeedBench:
    """Real-kernel gearboxes for every (scope, recipe) a policy needs.

    Args:
        model: the loaded model (left with its loaded modules afterwards).
        tokenizer: its tokenizer.
        layout: managed paths and the mixed recipe.
        config: gearbox settings; the initial gear is forced to ``high``,
            as in the quality pass.
        vocab_size: the model's vocabulary size.
    """

    def __init__(
        self, model: nn.Module, tokenizer: Any, layout: ModelLayout, config: GearboxConfig, vocab_size: int
    ) -> None:
        self.model, self.tokenizer, self.layout = model, tokenizer, layout
        self.config = config.replace(initial_gear="high")
        self.vocab_size = vocab_size
        self._boxes: Dict[tuple, Gearbox] = {}
        #: KV keyword arguments of every run (``kv_bits``, ...; empty: mlx-lm's float cache).
        self.kv: Dict[str, Any] = {}
        #: The loaded model's folder: the nested store's planes are read from its cache (None: built).
        self.planes_dir: Optional[Path] = None

    def gearbox(self, spec: PolicySpec) -> Gearbox:
        key = (spec.scope, spec.kind == "mixed", spec.store)
        if key not in self._boxes:
            gb = Gearbox(self.model, spec.gear_config(self.config), self.vocab_size, planes_dir=self.planes_dir)
            with warnings.catch_warnings():
                # The double-quantization warning is known and recorded in the results.
                warnings.simplefilter("ignore")
                if spec.kind == "mixed":
                    # The recipe is installed as this gearbox's low gear.
                    gs = self.config.group_size
                    gb.manager.cache["low"] = {
                        p: mlx_quantizer(m, self.layout.mixed_bits[p], gs)
                        for p, m in gb.manager.originals.items()
                    }
                    mx.eval([m.parameters() for m in gb.manager.cache["low"].values()])
                else:
                    gb.prepare("low")
                    gb.prepare("mid")
            self._boxes[key] = gb
        return self._boxes[key]

    def run(self, spec: PolicySpec, tokens: Sequence[int], prompt_tokens: int, decode_tokens: int) -> Dict[str, Any]:
        """Decode ``decode_tokens`` forced tokens after a ``prompt_tokens`` prompt."""
        if len(tokens) < prompt_tokens + decode_tokens:
            raise ValueError(
                f"speed run needs {prompt_tokens + decode_tokens} tokens of text, got {len(tokens)}"
            )
        gb = self.gearbox(spec)
        th = spec.thresholds or gb.default_thresholds()
        gb.set_thresholds(*th)
        prompt = list(tokens[:prompt_tokens])
        forced = list(tokens[prompt_tokens : prompt_tokens + decode_tokens])
        last = None
        tic = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for resp in stream_generate(
                self.model, self.tokenizer, prompt, gb, policy=spec.make_policy(), lag=0,
                sampler=forcing_sampler(forced), max_tokens=decode_tokens, prompt_text="", **self.kv,
            ):
                last = resp
        wall = time.perf_counter() - tic
        session = last.session
        return {
            "tokens_per_s": last.generation_tps,
            "decode_tokens": last.generation_tokens,
            "prompt_tokens": prompt_tokens,
            "wall_s": wall,
            "gear_counts": session.gear_counts(),
            "shifts": sum(1 for r in session.records if r.shifted),
            "shift_seconds": session.shift_seconds,
        }

    def baseline(self, tokens: Sequence[int], prompt_tokens: int, decode_tokens: int) -> Dict[str, Any]:
        """Plain ``mlx_lm.stream_generate`` on the loaded model: no gearbox at all."""
        prompt = list(tokens[:prompt_tokens])
        forced = list(tokens[prompt_tokens : prompt_tokens + decode_tokens])
        last = None
        for resp in mlx_stream(
            self.model, self.tokenizer, prompt, sampler=forcing_sampler(forced), max_tokens=decode_tokens
        ):
            last = resp
        return {"tokens_per_s": last.generation_tps, "decode_tokens": last.generation_tokens}


def speed_spec(spec: PolicySpec, window: int, decode_tokens: int) -> PolicySpec:
    """The spec as run for speed: a position rule keeps its high fraction over the shorter run."""
    if spec.kind != "position":
        return spec
    k = int(round(spec.k * decode_tokens / max(window - 1, 1)))
    return dataclasses.replace(spec, k=k)


def measure_speed(
    bench: SpeedBench,
    specs: Sequence[PolicySpec],
    tokens: Sequence[int],
    window: int,
    prompt_tokens: int = 32,
    decode_tokens: int = 128,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, Dict[str, Any]]:
    """Speed of every spec (one run each, after one warm-up run), plus the plain mlx-lm baseline."""
    ref = next(s for s in specs if s.is_reference)
    bench.run(ref, tokens, prompt_tokens, min(decode_tokens, 16))  # warm-up: allocations, caches
    out: Dict[str, Dict[str, Any]] = {}
    for i, spec in enumerate(specs):
        run_spec = speed_spec(spec, window, decode_tokens)
        out[spec.name] = bench.run(run_spec, tokens, prompt_tokens, decode_tokens)
        if run_spec.kind == "position":
            out[spec.name]["k"] = run_spec.k
        if progress:
            progress(f"speed {i + 1}/{len(specs)}: {spec.name} {out[spec.name]['tokens_per_s']:.1f} tok/s")
    out["mlx-lm (no gearbox)"] = bench.baseline(tokens, prompt_tokens, decode_tokens)
    return out
