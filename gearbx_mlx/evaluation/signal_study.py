"""Routing signals measured against random routing at equal bytes: the routing table.

One teacher-forced pass per gear (high = the loaded weights, the reference;
mid = 8-bit; low = 4-bit; every linear layer, MLX affine group 64) over the
windows of a text gives, at every position and in every gear, the KL to the
reference, the NLL, the top-1 agreement and the cheap signals of
:mod:`.signals` (the last hidden state is captured at the model's final
norm). A routed policy is then re-selected from those rows, each position
from the row of its gear (:mod:`.permutation` explains the approximation,
which the random baseline shares): no forward pass per policy.

Each policy of :data:`.routers.SIGNALS` is calibrated (its threshold, the
learned router's weights) on a calibration text to spend the bytes of static
8-bit weights, then routed over an evaluation text the calibration never
saw, and compared at the bytes it spent there with

* the distribution of random permutations of its own gears in each window
  (same gears, same bytes; :func:`.permutation.random_distribution`), and a
  paired block bootstrap of its per-position KL minus the permutations'
  expected per-position KL (exact: a position of a window whose gears are
  shuffled is in gear g with probability n_g / S);
* a position rule (high, then low, in each window) at its bytes;
* static 8-bit weights (their bytes beside the policy's).

The specification's router (the entropy monitor with its default
thresholds, three gears) is re-selected the same way, at its own bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from ..config import GearboxConfig
from ..entropy import EntropyMonitor
from . import metrics, signals
from .routers import (
    FALLBACK,
    FEATURES,
    LEARNED,
    ROUTERS,
    Logistic,
    RouterSettings,
    SignalPolicy,
    calibrated_sign,
    fit_logistic,
    fit_threshold,
    route_fallback,
    route_lagged,
    route_windows,
    top_fraction_labels,
)
from .specs import ModelLayout, PolicySpec
from .teacher import teacher_forced
from .variants import ORIGINAL, VariantModel, variant_weight

#: Gears measured, the reference first.
PASS_GEARS = ("high", "mid", "low")
#: One character per routing state; ``f``: a low step redone in the high gear.
STATES = {"l": "low", "m": "mid", "h": "high", "f": "high"}
METRICS = ("kl", "nll", "hits")


@dataclass
class GearRows:
    """Per-position numbers of each gear over a text's windows (windows concatenated).

    Attributes:
        values: ``{gear: {"kl" | "nll" | "hits" | feature: (N,) float64}}``.
        window_steps: scored positions per window.
    """

    values: Dict[str, Dict[str, np.ndarray]]
    window_steps: int

    @property
    def positions(self) -> int:
        return len(self.values["high"]["kl"])


# -- the passes ----------------------------------------------------------------------------------


class _Seen:
    value: Optional[mx.array] = None


class _Capture(nn.Module):
    """The final norm, recording its input (the last hidden state)."""

    def __init__(self, inner: nn.Module, seen: _Seen) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def __call__(self, x: mx.array) -> mx.array:
        self.seen.value = x
        return self.inner(x)


@contextlib.contextmanager
def final_hidden(model: nn.Module) -> Iterator[_Seen]:
    """Record the input of ``model``'s final norm (``model.model.norm`` in mlx-lm's decoders) at each call."""
    owner = next((m for m in (getattr(model, "model", None), getattr(getattr(model, "language_model", None),
                                                                        "model", None)) if m is not None
                  and isinstance(getattr(m, "norm", None), nn.Module)), None)
    if owner is None:
        raise ValueError(f"{type(model).__name__}: no final norm at model.norm to read the last hidden state from")
    inner, seen = owner.norm, _Seen()
    owner.norm = _Capture(inner, seen)
    try:
        yield seen
    finally:
        owner.norm = inner


def _specs() -> Dict[str, PolicySpec]:
    return {g: PolicySpec("static-high" if g == "high" else f"static-{g}/all", "static", "all", g) for g in PASS_GEARS}


@dataclass(frozen=True)
class GearLayers:
    """How a quantized gear is put in the model's managed layers (one gear at a time).

    Attributes:
        packed: MLX's quantized layers, which hold a gear in a fraction of
            the memory but multiply many positions several times slower on a
            CPU; else the harness's fake-quantized float copies
            (:class:`~.variants.VariantModel`, fast, one float copy beside
            the model).
        reload_from: the model's folder: the float copies replace the loaded
            weights in place and the loaded weights are read back from its
            ``model*.safetensors`` after the gear (no copy beside the model:
            for a model twice whose size does not fit).

    All three compute the same numbers within float rounding.
    """

    packed: bool = False
    reload_from: Optional[Path] = None


@contextlib.contextmanager
def gear_installed(model: nn.Module, layout: ModelLayout, gear: str, group_size: int,
                   layers: GearLayers = GearLayers()) -> Iterator[None]:
    """Every managed layer of ``model`` in ``gear`` (the high gear: the loaded layers), as ``layers`` says."""
    keys = dict(zip(layout.paths, layout.keys(_specs()[gear], gear)))
    changed = {p: k for p, k in keys.items() if k != ORIGINAL}
    if any(k < 0 for k in changed.values()):
        raise ValueError(f"{gear}: only MLX affine gears are measured here, not the nested store's")
    if not changed:
        yield
        return
    modules = dict(model.named_modules())
    if layers.packed:
        originals = {p: modules[p] for p in changed}
        model.update_modules(tree_unflatten([(p, m.to_quantized(group_size=group_size, bits=changed[p]))
                                             for p, m in originals.items()]))
        try:
            yield
        finally:
            model.update_modules(tree_unflatten(list(originals.items())))
    elif layers.reload_from is not None:
        files = sorted(Path(layers.reload_from).glob("model*.safetensors"))
        if not files:
            raise ValueError(f"{layers.reload_from}: no model*.safetensors to read the loaded weights back from")
        stored = _stored(files, {f"{p}.weight": modules[p].weight for p in changed})
        for p, k in changed.items():
            modules[p].weight = variant_weight(modules[p].weight, k, group_size)
            mx.eval(modules[p].weight)
        try:
            yield
        finally:
            model.load_weights(stored, strict=False)
            mx.eval([modules[p].weight for p in changed])
    else:
        with VariantModel(model, {p: [k] for p, k in changed.items()}, group_size) as vm:
            vm.set_keys({p: (k,) for p, k in changed.items()})
            yield


def _stored(files: Sequence[Path], now: Dict[str, mx.array]) -> List[Tuple[str, mx.array]]:
    """The weights named in ``now`` as ``files`` hold them (lazily read); each must be there in its shape and dtype."""
    found = [(n, w) for f in files for n, w in mx.load(str(f)).items() if n in now]
    bad = sorted(set(now) - {n for n, _ in found}) + [n for n, w in found
                                                    if w.shape != now[n].shape or w.dtype != now[n].dtype]
    if bad:
        raise ValueError(f"{files[0].parent}: the loaded weights of {bad[:3]} cannot be read back (missing or "
                         "converted on load): measure without --in-place")
    return found


def measure_gears(model: nn.Module, windows: Sequence[Sequence[int]], layout: ModelLayout, config: GearboxConfig,
                  max_positions: int = 128, progress: Callable[[str], None] = lambda _m: None,
                  layers: GearLayers = GearLayers()) -> GearRows:
    """Run every gear of :data:`PASS_GEARS` over ``windows`` (equal-length token lists) teacher-forced.

    Gear by gear (the reference first, its distributions kept for the
    others), each window a fresh KV cache, ``max_positions`` positions per
    pass; ``layers``: see :class:`GearLayers`.
    """
    steps = len(windows[0]) - 1
    out: Dict[str, Dict[str, List[float]]] = {g: {} for g in PASS_GEARS}
    refs: Dict[Tuple[int, int], metrics.ReferenceRows] = {}
    for g in PASS_GEARS:
        with gear_installed(model, layout, g, config.group_size, layers), final_hidden(model) as seen:
            for w, tokens in enumerate(windows):
                cache = make_prompt_cache(model)
                for start in range(0, steps, max_positions):
                    n = min(max_positions, steps - start)
                    ids = mx.array([tokens[start : start + n]], dtype=mx.uint32)
                    logits = model(ids, cache=cache)[0]
                    hidden = seen.value[0]
                    mx.eval(logits, hidden)
                    ref = _append(out[g], logits, hidden, tokens[start + 1 : start + n + 1], refs.get((w, start)))
                    refs.setdefault((w, start), ref)
        progress(f"signals: {g} gear over {len(windows)} windows")
    return GearRows({g: {k: np.asarray(v, dtype=np.float64) for k, v in d.items()} for g, d in out.items()}, steps)


def _append(into: Dict[str, List[float]], logits: mx.array, hidden: mx.array, targets: Sequence[int],
            ref: Optional[metrics.ReferenceRows]) -> metrics.ReferenceRows:
    """Add one chunk's numbers of one gear; the first gear's chunk is the reference (returned)."""
    if ref is None:
        ref, nll, _ = metrics.reference(logits, targets)
        got = {"nll": nll, "kl": [0.0] * len(nll), "hits": [1.0] * len(nll)}
    else:
        got = metrics.routed(logits, targets, ref)
    feats = signals.distribution_signals(metrics.to_numpy(logits))
    feats["log_hidden_norm"] = np.log(np.maximum(signals.hidden_norm(np.array(hidden.astype(mx.float32))), 1e-30))
    for k in METRICS:
        into.setdefault(k, []).extend(float(x) for x in got[k])
    for k in FEATURES:
        into.setdefault(k, []).extend(feats[k].tolist())
    return ref


# -- routing ----------------------------------------------------------------------------------------


def feature_matrix(rows: GearRows, gear: str) -> np.ndarray:
    """``(N, len(FEATURES))`` features of ``gear`` at every position."""
    return np.stack([rows.values[gear][f] for f in FEATURES], axis=1)


def _shifted(rows: GearRows) -> np.ndarray:
    """Boolean mask of positions that have a next position in their window."""
    keep = np.ones(rows.positions, dtype=bool)
    keep[rows.window_steps - 1 :: rows.window_steps] = False
    return keep


def train_router(rows: GearRows, rule: str, fraction: float, settings: RouterSettings = ROUTERS) -> Logistic:
    """The learned router of ``rule`` on calibration ``rows``, flagging the top ``fraction`` of low-gear KL.

    Lagged: the features of step t, in the low and in the high gear (the
    router sees whichever ran), label the low gear's KL at step t+1; fallback:
    the low gear's features at step t label its KL at step t.
    """
    kl = rows.values["low"]["kl"]
    if rule == FALLBACK:
        return fit_logistic(feature_matrix(rows, "low"), top_fraction_labels(kl, fraction), settings.l2,
                            settings.newton_steps)
    keep = _shifted(rows)
    nxt = np.roll(kl, -1)[keep]
    y = top_fraction_labels(nxt, fraction)
    x = np.vstack([feature_matrix(rows, "low")[keep], feature_matrix(rows, "high")[keep]])
    return fit_logistic(x, np.concatenate([y, y]), settings.l2, settings.newton_steps)


@dataclass
class Calibrated:
    """A signal policy made concrete on a calibration text: its direction, threshold, learned weights."""

    policy: SignalPolicy
    direction: int
    threshold: float
    target_fraction: float
    calibration_fraction: float
    model: Optional[Logistic] = None

    def scores(self, rows: GearRows, gear: str) -> np.ndarray:
        """The signal of each position in ``gear`` (larger: the high gear)."""
        if self.model is not None:
            return self.model.score(feature_matrix(rows, gear))
        return self.direction * rows.values[gear][self.policy.feature]

    def trace(self, rows: GearRows) -> str:
        """The policy's states over ``rows`` (one char of :data:`STATES` per position)."""
        return _trace(self, rows, self.threshold)


def _trace(c: Calibrated, rows: GearRows, threshold: float) -> str:
    if c.policy.rule == FALLBACK:
        fire = route_fallback(c.scores(rows, "low"), threshold)
        return "".join(np.where(fire, "f", "l"))
    both = np.stack([c.scores(rows, "low"), c.scores(rows, "high")])
    high = route_windows(lambda s: route_lagged(both[:, s], threshold, c.policy.smooth), rows.positions,
                         rows.window_steps)
    return "".join(np.where(high, "h", "l"))


def target_fraction(rule: str, costs: Dict[str, float], budget: float) -> float:
    """Share of high (lagged) or fallback steps that spends ``budget`` bytes per token on average."""
    low, high = costs["low"], costs["high"]
    f = (budget - low) / (high - low if rule != FALLBACK else high)
    return float(min(max(f, 0.0), 1.0))


def calibrate(policy: SignalPolicy, rows: GearRows, costs: Dict[str, float], budget: float,
              settings: RouterSettings = ROUTERS) -> Calibrated:
    """Fit ``policy``'s direction, learned weights and threshold on calibration ``rows`` to spend ``budget``."""
    frac = target_fraction(policy.rule, costs, budget)
    kl = rows.values["low"]["kl"]
    model = train_router(rows, policy.rule, frac, settings) if policy.feature == LEARNED else None
    direction = policy.direction
    if direction == 0:
        keep = _shifted(rows)
        direction = calibrated_sign(rows.values["low"][policy.feature][keep], np.roll(kl, -1)[keep])
    c = Calibrated(policy, direction, 0.0, frac, 0.0, model)
    every = np.concatenate([c.scores(rows, "low"), c.scores(rows, "high")])
    if policy.rule == FALLBACK:
        c.threshold = float(np.quantile(c.scores(rows, "low"), 1.0 - frac))
    else:
        share = lambda th: _trace(c, rows, th).count("h") / rows.positions  # noqa: E731
        c.threshold = fit_threshold(share, frac, float(every.min()) - 1.0, float(every.max()) + 1.0,
                                    settings.bisection_steps)
    t = c.trace(rows)
    c.calibration_fraction = (t.count("h") + t.count("f")) / len(t)
    return c


def monitor_trace(rows: GearRows, vocab_size: int, config: GearboxConfig) -> str:
    """The specification's router (entropy monitor, default thresholds, three gears), re-selected."""
    chars = {"low": "l", "mid": "m", "high": "h"}
    out: List[str] = []
    for s in range(0, rows.positions, rows.window_steps):
        monitor = EntropyMonitor(vocab_size, config)
        monitor.reset("high")
        gear = "high"
        for t in range(s, s + rows.window_steps):
            out.append(chars[gear])
            gear = monitor.push(rows.values[gear]["entropy"][t]).gear
    return "".join(out)


def real_runs(model: nn.Module, windows: Sequence[Sequence[int]], layout: ModelLayout, config: GearboxConfig,
              vocab_size: int, trace: str, permutations: int = 5, seed: int = 0) -> Dict[str, object]:
    """Run a policy's state trace and ``permutations`` per-window permutations of it for real.

    Each is replayed through the harness's teacher forcing (every position's
    keys and values from its own gear, unlike re-selection); a fallback step
    replays as a high-gear step, whose keys and values a fallback keeps.
    Returns the gear sequences and each one's mean KL.
    """
    steps = len(windows[0]) - 1
    replay = trace.replace("f", "h")
    if len(replay) != steps * len(windows) or set(replay) - {"l", "m", "h"}:
        raise ValueError(f"need a trace of {steps * len(windows)} states over l, m, h, f")
    rng = np.random.default_rng(seed)
    grid = np.array(list(replay)).reshape(len(windows), steps)
    seqs = [replay] + ["".join(rng.permuted(grid, axis=1).ravel()) for _ in range(permutations)]
    specs = [PolicySpec("static-high", "static", "all", "high")] + [
        PolicySpec(f"replay-{i}", "random", "all", fractions=(("low", 1.0),), seed=i,
                   sequences=tuple(s[j : j + steps] for j in range(0, len(s), steps)))
        for i, s in enumerate(seqs)]
    rows = teacher_forced(model, [list(w) for w in windows], specs, layout, config, vocab_size, "real runs")
    return {"sequences": seqs, "mean_kl": [r.mean_kl for r in rows[1:]]}
