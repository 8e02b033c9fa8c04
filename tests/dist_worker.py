"""One rank of tests/test_distributed.py: launched by ``mlx.launch`` (or alone, as
the one-process reference), it runs a scenario and writes what it saw to
``OUT/rank<r>.json``, every rank its own: tokens, each step's gear, every
rank's gear of each step as the exchange carried it, agreement, memory.

    python tests/dist_worker.py OUT SCENARIO [--model PATH] [--tokens N] [--timeout S]

A failure is written as ``{"error": ..., "type": ...}`` and printed as one
``error:`` line (exit status 1). ``signal.alarm`` ends the process after
``--timeout`` seconds whatever happens, so no rank outlives the test.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_map  # noqa: E402

from gearbx_mlx import GearboxConfig, load, speculative_generate, stream_generate  # noqa: E402
from gearbx_mlx.distributed import Ranks, launched_group, shard_model  # noqa: E402
from gearbx_mlx.gearbox import Gearbox  # noqa: E402

#: Prompt of the tiny models (token ids) and of real ones (text, no chat template).
TINY_PROMPT = [5, 6, 7, 100, 3]
TEXT_PROMPT = "The three primary colours are"
#: Entropy thresholds that make the tiny model's router shift between gears.
TINY_THRESHOLDS = (6.98, 7.1)


def tiny_model(seed: int = 0, scale: float = 2.0) -> Any:
    """An untied random llama (4 heads, 2 key/value heads) whose greedy text varies:
    the matrices are scaled up so that the output is not near-uniform."""
    from conftest import make_tiny_llama

    model = make_tiny_llama(tie=False, hidden=128, seed=seed)
    model.update(tree_map(lambda w: w * scale if w.ndim == 2 else w, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_gemma(seed: int = 0) -> Any:
    """A tiny gemma3_text model: mlx-lm gives this class no ``shard()``."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=1,
                                 intermediate_size=128, num_attention_heads=2, head_dim=32,
                                 num_key_value_heads=2, vocab_size=64)
    return gemma3_text.Model(args)


def run(model: Any, tok: Any, prompt: Any, tokens: int, config: GearboxConfig,
        thresholds: Optional[tuple] = None, **kw: Any) -> Dict[str, Any]:
    """One routed generation: what every step did on this rank."""
    gb = Gearbox(model, config)
    if thresholds:
        gb.set_thresholds(*thresholds)
    out: Dict[str, Any] = {"tokens": [], "entropies": [], "gears": [], "rank_gears": [], "ranks_agree": []}
    last = None
    for r in stream_generate(model, tok, prompt, gb, max_tokens=tokens, **kw):
        out["tokens"].append(int(r.token))
        out["entropies"].append(r.entropy)
        out["gears"].append(r.gear)
        out["rank_gears"].append(r.rank_gears)
        out["ranks_agree"].append(r.ranks_agree)
        last = r
    session = last.session
    out["exchanges"] = session.exchanges
    out["forward_steps"] = len(session.records)
    out["memory"] = gb.manager.memory()
    out["managed"] = len(gb.manager.paths)
    return out


def gears(model: Any, tok: Any, prompt: Any, tokens: int, dynamic: Optional[tuple], few: bool = False,
          static: tuple = ("high", "mid", "low"), store: Optional[str] = None, **base: Any) -> Dict[str, Any]:
    """Every static gear with both stores and kernels, the dynamic policy, speculative decoding
    (``few``: the ``static`` gears, none or some, and the dynamic policy on ``store`` only)."""
    runs: Dict[str, Any] = {}
    for gear in static if few else ("high", "mid", "low"):  # the separate store by name: the default may be nested
        runs[f"static-{gear}"] = run(model, tok, prompt, tokens,
                                     GearboxConfig(static_gear=gear, store="separate", **base))
    if few:
        runs["dynamic-lag0"] = run(model, tok, prompt, tokens, GearboxConfig(store=store, **base), thresholds=dynamic)
        return runs
    for gear in ("high", "mid", "low"):
        runs[f"scope-all-{gear}"] = run(model, tok, prompt, tokens, GearboxConfig(
            static_gear=gear, store="separate", **{**base, "scope": "all"}))
    for gear in ("mid", "low"):
        runs[f"static-{gear}-mlx"] = run(model, tok, prompt, tokens, GearboxConfig(
            static_gear=gear, store="separate", **{**base, "kernel": "mlx"}))
        runs[f"nested-{gear}"] = run(model, tok, prompt, tokens,
                                     GearboxConfig(static_gear=gear, store="nested", **base))
    for lag in (0, 1):
        runs[f"dynamic-lag{lag}"] = run(model, tok, prompt, tokens, GearboxConfig(lag=lag, store="separate", **base),
                                        thresholds=dynamic)
    runs["dynamic-nested"] = run(model, tok, prompt, tokens, GearboxConfig(store="nested", **base),
                                 thresholds=dynamic)
    gb = Gearbox(model, GearboxConfig(**base))
    greedy = speculative_generate(model, tok, prompt, gb, max_tokens=tokens, max_draft=3)
    sampled = speculative_generate(model, tok, prompt, gb, max_tokens=tokens, max_draft=3, temp=0.8)
    runs["speculative"] = {"text": greedy, "sampled_text": sampled}
    # Last: a nested high gear that reads the planes drops the loaded layers for good.
    runs["nested-planes-high"] = run(model, tok, prompt, tokens, GearboxConfig(
        static_gear="high", store="nested", high="planes", **base))
    return runs


def scenario(name: str, args: argparse.Namespace, group: Any) -> Dict[str, Any]:
    rank = group.rank() if group is not None else 0
    ranks = Ranks(group) if group is not None else None
    if name == "gears-tiny":
        from conftest import make_tiny_tokenizer

        model = tiny_model()
        if group is not None:
            shard_model(model, group)
        return gears(model, make_tiny_tokenizer(), TINY_PROMPT, args.tokens, TINY_THRESHOLDS, group_size=32)
    if name == "gears-model":
        model, tok, _ = load(args.model, group=group)
        # MLX's kernels: the packed C kernels quantize activations per call, which a shard does apart.
        return gears(model, tok, TEXT_PROMPT, args.tokens, args.thresholds, few=args.few, static=tuple(args.static),
                     store=args.store, kernel="mlx")
    if name == "disagree-thresholds":
        from conftest import make_tiny_tokenizer

        model = tiny_model()
        shard_model(model, group)
        low = TINY_THRESHOLDS[0] + (0.5 if rank == 1 else 0.0)
        return {"run": run(model, make_tiny_tokenizer(), TINY_PROMPT, args.tokens, GearboxConfig(group_size=32),
                           thresholds=(low, TINY_THRESHOLDS[1] + 1))}
    if name == "disagree-model":
        from conftest import make_tiny_tokenizer

        model = tiny_model(seed=rank)  # rank 1's weights are another model's
        shard_model(model, group)
        return {"run": run(model, make_tiny_tokenizer(), TINY_PROMPT, args.tokens, GearboxConfig(group_size=32))}
    if name == "missing-on-one-rank":
        path = args.model if rank == 0 else args.model + "-missing"
        load(path, group=group)
        return {}
    if name in ("disagree-calibration", "calibration-missing-on-one-rank"):
        from gearbx_mlx.calibration import Calibration

        cal = Path(args.out, f"calibration{rank}.json")
        shift = 0.5 if rank == 1 and name == "disagree-calibration" else 0.0
        Calibration(low=1.0 + shift, high=3.0, strategy="median", n_samples=4,
                    vocab_size=json.loads(Path(args.model, "config.json").read_text())["vocab_size"]).save(cal)
        if name == "calibration-missing-on-one-rank" and rank == 1:
            cal = cal.with_name("missing.json")
        model, tok, gb = load(args.model, group=group, calibration=cal)
        return {"text": [r.token for r in stream_generate(model, tok, TINY_PROMPT, gb, max_tokens=args.tokens)]}
    if name == "not-shardable":
        with ranks.stage("sharding the model"):
            shard_model(tiny_gemma(), group)
        return {}
    raise ValueError(f"unknown scenario {name!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("scenario")
    p.add_argument("--model")
    p.add_argument("--tokens", type=int, default=10)
    p.add_argument("--few", action="store_true", help="gears-model: the static gears and the dynamic policy only")
    p.add_argument("--static", nargs="*", default=["high", "mid", "low"],
                   help="gears-model --few: these static gears (none: the dynamic policy alone)")
    p.add_argument("--store", choices=["separate", "nested"], help="gears-model --few: the dynamic policy's store")
    p.add_argument("--thresholds", nargs=2, type=float, help="gears-model: the dynamic policy's thresholds")
    p.add_argument("--timeout", type=int, default=300)
    args = p.parse_args()
    signal.alarm(args.timeout)  # a rank stuck anywhere ends by itself
    group = launched_group()
    rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
    result: Dict[str, Any] = {"rank": rank, "size": size}
    status = 0
    try:
        result["runs"] = scenario(args.scenario, args, group)
    except Exception as e:  # noqa: BLE001  (every failure is the result of a fault scenario)
        result.update(error=" ".join(str(e).split()), type=type(e).__name__)
        print(f"error: {result['error']}", file=sys.stderr, flush=True)
        status = 1
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main())
