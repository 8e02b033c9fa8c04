"""Gear distribution by workload: real generation from prose, code and arithmetic prompts.

Unlike the teacher-forced quality pass, this is generation as a user runs
it: ``gearbx_mlx.stream_generate`` with the chat template, greedy sampling,
the cold-start classifier choosing the first gear, and the entropy policy
routing every step on the real kernels.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.nn as nn

from ..chat import apply_chat_template
from ..config import GEARS, GearboxConfig
from ..gearbox import Gearbox
from ..pipeline import stream_generate
from .specs import PolicySpec

#: Prompts of each workload (ours; the paper names the workloads, not prompts).
WORKLOADS: Dict[str, List[str]] = {
    "prose": [
        "Write a short paragraph about a lighthouse keeper's quiet evening.",
        "Describe a busy market street on a Saturday morning.",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a JavaScript function that checks whether a string is a palindrome.",
    ],
    "arithmetic": [
        "What is 17 multiplied by 23? Work it out step by step.",
        "Compute 1234 + 5678 - 910, showing each step.",
    ],
}


def gear_by_workload(
    model: nn.Module,
    tokenizer: Any,
    specs: Sequence[PolicySpec],
    config: GearboxConfig,
    vocab_size: int,
    max_tokens: int = 48,
    workloads: Optional[Dict[str, List[str]]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, Dict[str, Dict[str, int]]]:
    """``{workload: {policy name: {gear: tokens}}}`` over greedy generations.

    Args:
        specs: entropy policies (thresholds and scope are taken from them).
        max_tokens: tokens generated per prompt.
    """
    workloads = workloads or WORKLOADS
    boxes: Dict[tuple, Gearbox] = {}
    out: Dict[str, Dict[str, Dict[str, int]]] = {w: {} for w in workloads}
    for spec in specs:
        if spec.kind != "entropy":
            raise ValueError(f"{spec.name}: the workload figure routes entropy policies only")
        gb = boxes.get((spec.scope, spec.store))
        if gb is None:
            gb = boxes[spec.scope, spec.store] = Gearbox(model, spec.gear_config(config), vocab_size)
        gb.set_thresholds(*(spec.thresholds or gb.default_thresholds()))
        for name, prompts in workloads.items():
            counts = {g: 0 for g in GEARS}
            for prompt in prompts:
                last = None
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # double quantization: known, recorded
                    for resp in stream_generate(
                        model, tokenizer, apply_chat_template(tokenizer, prompt), gb, policy=spec.make_policy(),
                        lag=0, max_tokens=max_tokens, prompt_text=prompt,
                    ):
                        last = resp
                for g, n in last.session.gear_counts().items():
                    counts[g] += n
            out[name][spec.name] = counts
        if progress:
            progress(f"workloads: {spec.name} done")
    return out
