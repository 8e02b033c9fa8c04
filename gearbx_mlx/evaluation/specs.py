"""What the evaluation compares: policy specs, model layout and the §9 cost model.

A :class:`PolicySpec` names one row of the evaluation: a routing policy
(static, entropy, position, random, or mlx-lm's static mixed recipe) and the
scope it manages. A :class:`ModelLayout` knows the model's managed paths and
their parameter counts, and turns (spec, gear) into a variant key per path
(bit width, 0 = loaded weights) and into modeled weight bytes per token.

Cost model (§9, with MLX's real formats): a decode token reads every weight
once. A managed parameter in a ``b``-bit MLX affine gear (group 64) costs
``b/8 + 4/64`` bytes (one fp16 scale and one fp16 bias per group of 64);
the high gear and every unmanaged parameter cost 2 bytes (fp16, the paper's
reference, although this CPU runs the model in float32). A tied embedding is
counted once: the output projection reads all of it.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.convert import mixed_quant_predicate_builder

from ..config import GEARS, SCOPES, GearboxConfig
from ..gearbox import Gearbox
from ..nested.planes import DEFAULT_PLAN
from ..policies import EntropyPolicy, PositionPolicy, RandomPolicy, ReplayPolicy, StaticPolicy
from .variants import NESTED_HIGH, NESTED_MID, ORIGINAL

KINDS = ("static", "entropy", "mixed", "position", "random")
#: One character per gear in gear sequences and the stored gear traces.
GEAR_CHAR = {"low": "l", "mid": "m", "high": "h"}
CHAR_GEAR = {c: g for g, c in GEAR_CHAR.items()}
#: Bytes per parameter of the high gear and of unmanaged weights (fp16).
HIGH_BYTES = 2.0
#: The static mixed recipe compared against (mlx-lm's ``--quant-predicate``).
MIXED_RECIPE = "mixed_4_6"
#: Where a row's gears come from: separate MLX copies (low 4-bit, mid 8-bit,
#: high the loaded weights), the nested store (low = MLX 4-bit exactly, mid =
#: two planes, high the loaded weights) or the nested store whose high gear
#: reads every plane.
STORES = ("separate", "nested", "nested-planes")
#: Name suffix of a row on each store.
STORE_SUFFIX = {"separate": "", "nested": "+nested", "nested-planes": "+planes"}


def format_bytes_per_param(key: int, group_size: int) -> float:
    """Bytes per parameter of a variant key: an MLX affine format (packed bits +
    fp16 scale and bias per group), the sum of the nested planes a nested key
    reads, or fp16 for the loaded weights."""
    if key == ORIGINAL:
        return HIGH_BYTES
    if key in (NESTED_MID, NESTED_HIGH):
        planes = ((DEFAULT_PLAN[0][0], group_size),) + DEFAULT_PLAN[1:]
        return sum(b / 8 + 4 / g for b, g in planes[: 2 if key == NESTED_MID else 3])
    return key / 8 + 4 / group_size


@dataclass(frozen=True)
class PolicySpec:
    """One evaluated policy (one batch row).

    Attributes:
        name: unique label, e.g. ``dynamic-median/all``.
        kind: one of :data:`KINDS`.
        scope: ``attention`` or ``all`` (ignored by static high).
        gear: the gear of a static policy.
        thresholds: ``(low, high)`` bits of an entropy policy; None = the
            config's vocabulary-scaled defaults.
        source: where the thresholds came from (default / median / percentile).
        k: steps in the high gear at the start of each window (position).
        fractions: ``((gear, fraction), ...)`` of a random policy (with
            ``sequences``: the fractions they realize, for the record).
        seed: the random policy's seed.
        matched_to: the entropy policy a baseline was matched to.
        sequences: a random policy's gears, one string of :data:`GEAR_CHAR`
            per window (a permutation of ``matched_to``'s gears); empty = draw
            each step's gear independently with ``fractions``.
    """

    name: str
    kind: str
    scope: str = "attention"
    gear: str = "high"
    thresholds: Optional[Tuple[float, float]] = None
    source: str = ""
    k: int = 0
    fractions: Tuple[Tuple[str, float], ...] = ()
    seed: int = 0
    matched_to: Optional[str] = None
    sequences: Tuple[str, ...] = ()
    store: str = "separate"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"{self.name}: scope must be one of {SCOPES}, got {self.scope!r}")
        if self.gear not in GEARS:
            raise ValueError(f"{self.name}: gear must be one of {GEARS}, got {self.gear!r}")
        if self.store not in STORES:
            raise ValueError(f"{self.name}: store must be one of {STORES}, got {self.store!r}")
        if self.store != "separate" and self.kind == "mixed":
            raise ValueError(f"{self.name}: the mixed recipe has no nested store")
        if any(set(s) - set(CHAR_GEAR) or not s for s in self.sequences):
            raise ValueError(f"{self.name}: sequences must be non-empty strings over {sorted(CHAR_GEAR)}")

    @property
    def is_reference(self) -> bool:
        return self.kind == "static" and self.gear == "high" and self.store != "nested-planes"

    def gear_config(self, config: GearboxConfig) -> GearboxConfig:
        """The gearbox configuration that runs this row's gears for real."""
        store = "separate" if self.store == "separate" else "nested"
        return config.replace(scope=self.scope, store=store,
                              high="planes" if self.store == "nested-planes" else "original")

    @property
    def reacts(self) -> bool:
        """True if the gears depend on the entropy seen (the others' are known in advance)."""
        return self.kind == "entropy"

    def gears_used(self) -> Tuple[str, ...]:
        """Gears this policy may select (decides which variants are built)."""
        if self.kind == "static":
            return (self.gear,)
        if self.kind == "mixed":
            return ("low",)  # the recipe is installed as the low gear
        if self.kind == "position":
            return ("high", "low")
        if self.kind == "random":
            if self.sequences:
                return tuple(g for g in GEARS if any(GEAR_CHAR[g] in s for s in self.sequences))
            return tuple(g for g, f in self.fractions if f > 0)
        return GEARS

    def make_policy(self, stream: int = 0):
        """A fresh policy object (``gearbx_mlx.policies``) for this spec.

        ``stream`` (the window index) gives a random policy its own seeded
        stream, or its own replayed sequence, per window.
        """
        if self.kind == "static":
            return StaticPolicy(self.gear)
        if self.kind == "mixed":
            return StaticPolicy("low")
        if self.kind == "position":
            return PositionPolicy(self.k, "high", "low")
        if self.kind == "random":
            if self.sequences:
                if not 0 <= stream < len(self.sequences):
                    raise ValueError(f"{self.name}: no gear sequence for window {stream} "
                                     f"(it has {len(self.sequences)}): match it on the same windows")
                return ReplayPolicy([CHAR_GEAR[c] for c in self.sequences[stream]])
            return RandomPolicy(dict(self.fractions), seed=self.seed * 100_003 + stream)
        return EntropyPolicy()

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fractions"] = dict(self.fractions)
        d["thresholds"] = list(self.thresholds) if self.thresholds else None
        # The sequences are the row's gear trace (stored with the traces).
        del d["sequences"]
        if self.sequences:
            d["draw"] = "permutation of the matched policy's gears in each window"
        return d


def mixed_recipe_bits(model: nn.Module, paths: Sequence[str], group_size: int) -> Tuple[Dict[str, int], str]:
    """Bits per path of mlx-lm's ``mixed_4_6`` recipe, and where the rule came from.

    mlx-lm's own predicate (``mlx_lm.convert.mixed_quant_predicate_builder``)
    is used when importable; otherwise its rule is reproduced: 6 bits for
    ``v_proj`` and ``down_proj`` in the first and last eighth of the layers
    and every third layer between, and for ``lm_head``; 4 bits elsewhere.
    """
    modules = dict(model.named_modules())
    try:
        predicate: Callable[[str, nn.Module], Any] = mixed_quant_predicate_builder(
            MIXED_RECIPE, model, group_size
        )
        source = "mlx_lm.convert.mixed_quant_predicate_builder('mixed_4_6')"
    except ImportError:
        predicate = mixed_4_6_rule(len(model.layers), group_size)
        source = "gearbx_mlx reproduction of mlx-lm's mixed_4_6 rule (mlx_lm.convert not importable)"
    out = {}
    for p in paths:
        r = predicate(p, modules[p])
        out[p] = int(r["bits"]) if isinstance(r, dict) else 4
    return out, source


def mixed_4_6_rule(num_layers: int, group_size: int) -> Callable[[str, nn.Module], Dict[str, int]]:
    def rule(path: str, module: nn.Module) -> Dict[str, int]:
        parts = path.split(".")
        index = next((int(p) for p in parts if p.isdigit()), 0)
        more = (
            index < num_layers // 8
            or index >= 7 * num_layers // 8
            or (index - num_layers // 8) % 3 == 2
        )
        six = ("v_proj" in path or "down_proj" in path) and more or "lm_head" in path
        return {"bits": 6 if six else 4, "group_size": group_size}

    return rule


@dataclass
class ModelLayout:
    """Managed paths per scope, parameter counts, and the cost model.

    Attributes:
        scopes: managed paths of each scope (``attention`` is a subset of ``all``).
        params: weight elements of each managed path.
        total_params: every parameter of the model (a tied embedding once).
        mixed_bits: bits per path of the mixed recipe.
        mixed_source: where the mixed rule came from.
    """

    scopes: Dict[str, List[str]]
    params: Dict[str, int]
    total_params: int
    mixed_bits: Dict[str, int]
    mixed_source: str
    config: GearboxConfig

    @classmethod
    def of(cls, model: nn.Module, config: GearboxConfig, vocab_size: int) -> "ModelLayout":
        # Exactly the paths a Gearbox of each scope would swap in generation
        # (the separate store builds nothing until a gear is entered).
        scopes = {
            s: list(Gearbox(model, config.replace(scope=s, store="separate", high="original"), vocab_size).manager.paths)
            for s in SCOPES
        }
        if not set(scopes["attention"]) <= set(scopes["all"]):
            raise ValueError("attention paths are not a subset of all paths: unsupported model layout")
        if not scopes["all"]:
            raise ValueError("the model has no layer the evaluation can quantize (already quantized?)")
        modules = dict(model.named_modules())
        params = {p: int(modules[p].weight.size) for p in scopes["all"]}
        total = sum(int(v.size) for _, v in tree_flatten(model.parameters()))
        mixed, source = mixed_recipe_bits(model, scopes["all"], config.group_size)
        return cls(scopes, params, total, mixed, source, config)

    @property
    def paths(self) -> List[str]:
        """Every path that any row may vary (the ``all`` scope)."""
        return self.scopes["all"]

    def key(self, spec: PolicySpec, gear: str, path: str) -> int:
        """Variant key of ``path`` for ``spec`` in ``gear`` (0 = loaded weights)."""
        if spec.is_reference or path not in self._scope_set(spec.scope):
            return ORIGINAL
        if spec.kind == "mixed":
            return self.mixed_bits[path]
        if gear == "high":
            return NESTED_HIGH if spec.store == "nested-planes" else ORIGINAL
        if gear == "mid" and spec.store != "separate":
            return NESTED_MID
        return self.config.bits[gear]

    def keys(self, spec: PolicySpec, gear: str) -> Tuple[int, ...]:
        """Variant keys over :attr:`paths`, in order."""
        return tuple(self.key(spec, gear, p) for p in self.paths)

    def bytes_per_token(self, spec: PolicySpec, gear: str) -> float:
        """Modeled weight bytes read by one decode step of ``spec`` in ``gear``."""
        gs = self.config.group_size
        managed = sum(self.params[p] * format_bytes_per_param(self.key(spec, gear, p), gs) for p in self.paths)
        unmanaged = (self.total_params - sum(self.params.values())) * HIGH_BYTES
        return managed + unmanaged

    def sequence_bytes(self, spec: PolicySpec, counts: Dict[str, int]) -> float:
        """Modeled bytes of the steps of ``spec`` with these gear counts.

        A function of the counts alone, summed in one fixed order: two gear
        sequences that are permutations of each other cost exactly the same
        float, not merely nearly.
        """
        return sum(counts.get(g, 0) * self.bytes_per_token(spec, g) for g in GEARS)

    def bits_per_path(self, specs: Sequence[PolicySpec]) -> Dict[str, List[int]]:
        """Fake-quantized variants each path needs for these rows."""
        need: Dict[str, set] = {p: set() for p in self.paths}
        for s in specs:
            for g in s.gears_used():
                for p in self.paths:
                    k = self.key(s, g, p)
                    if k != ORIGINAL:
                        need[p].add(k)
        return {p: sorted(b) for p, b in need.items()}

    def managed_fraction(self, scope: str) -> float:
        return sum(self.params[p] for p in self.scopes[scope]) / self.total_params

    def _scope_set(self, scope: str) -> frozenset:
        cache = self.__dict__.setdefault("_sets", {})
        if scope not in cache:
            cache[scope] = frozenset(self.scopes[scope])
        return cache[scope]

    def to_dict(self) -> Dict[str, Any]:
        gs = self.config.group_size
        return {
            "total_params": self.total_params,
            "managed_params": {s: sum(self.params[p] for p in ps) for s, ps in self.scopes.items()},
            "managed_modules": {s: len(ps) for s, ps in self.scopes.items()},
            "managed_fraction": {s: self.managed_fraction(s) for s in self.scopes},
            "bytes_per_param": {
                "high": HIGH_BYTES,
                **{f"{b}-bit": format_bytes_per_param(b, gs) for b in sorted({4, 6, 8, *self.config.bits.values()})},
                "unmanaged": HIGH_BYTES,
            },
            "cost_model": (
                "§9 with MLX affine formats: managed params x (bits/8 + 4/group_size) bytes "
                "(fp16 scale and bias per group) in low/mid gears, 2 bytes (fp16) in the high "
                "gear; unmanaged params x 2 bytes; tied embedding counted once"
            ),
            "mixed_recipe": MIXED_RECIPE,
            "mixed_source": self.mixed_source,
            "mixed_bits_histogram": _histogram(self.mixed_bits.values()),
        }


def _histogram(values) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items()))


def base_specs(thresholds: Dict[str, Optional[Tuple[float, float]]], nested: bool = True,
               scopes: Sequence[str] = SCOPES) -> List[PolicySpec]:
    """The first pass: reference, static mid/low, mixed recipe, entropy policies.

    Args:
        thresholds: ``{source: (low, high) or None}`` (None = scaled defaults).
        scopes: the scopes of the static, mixed and entropy rows (default both).
        nested: add the nested store's rows over every linear layer: its mid
            gear, its high gear read from every plane, and the median-calibrated
            (else the first) entropy policy on its gears. Its low gear is MLX
            4-bit bit for bit, so ``static-low/all`` stands for it.
    """
    specs = [PolicySpec("static-high", "static", "all", "high")]
    for scope in scopes:
        specs += [
            PolicySpec(f"static-mid/{scope}", "static", scope, "mid"),
            PolicySpec(f"static-low/{scope}", "static", scope, "low"),
            PolicySpec(f"{MIXED_RECIPE}/{scope}", "mixed", scope),
        ]
        for source, th in thresholds.items():
            specs.append(PolicySpec(f"dynamic-{source}/{scope}", "entropy", scope, thresholds=th, source=source))
    if nested:
        specs += [
            PolicySpec("static-mid/all+nested", "static", "all", "mid", store="nested"),
            PolicySpec("static-high+planes", "static", "all", "high", store="nested-planes"),
        ]
        if thresholds:
            source = "median" if "median" in thresholds else next(iter(thresholds))
            specs.append(PolicySpec(f"dynamic-{source}/all+nested", "entropy", "all", thresholds=thresholds[source],
                                    source=source, store="nested"))
    return specs


def matched_specs(
    entropy_rows: Sequence[Tuple[PolicySpec, Sequence[str], float]],
    layout: ModelLayout,
    window: int,
    seed: int,
) -> List[PolicySpec]:
    """Baselines at the budget of each entropy policy (the second pass).

    For each ``(spec, gears per window, mean bytes per token)`` (gears as
    strings of :data:`GEAR_CHAR`, one per window):

    * a position rule whose k makes its bytes per token equal (high then low
      within each window of ``window`` tokens), up to the rounding of k;
    * a random router that replays, in each window, a random permutation of
      the policy's own gears in that window (seeded by ``seed`` and the
      row's index): the same gears in the same number, so the same bytes by
      construction, at positions the entropy did not choose.
    """
    out: List[PolicySpec] = []
    steps = max(window - 1, 1)
    for i, (spec, sequences, mean_bytes) in enumerate(entropy_rows):
        if not sequences or any(not s for s in sequences):
            raise ValueError(f"{spec.name}: need its gears in every window to match baselines to it")
        hi = layout.bytes_per_token(spec, "high")
        lo = layout.bytes_per_token(spec, "low")
        frac = 0.0 if hi <= lo else min(max((mean_bytes - lo) / (hi - lo), 0.0), 1.0)
        k = int(round(frac * steps))
        tag = spec.name.replace("dynamic-", "")
        out.append(PolicySpec(f"position@{tag}", "position", spec.scope, k=k, matched_to=spec.name,
                              store=spec.store))
        row_seed = seed * 1000 + i
        rng = random.Random(row_seed)
        shuffled = []
        for s in sequences:
            chars = list(s)
            rng.shuffle(chars)
            shuffled.append("".join(chars))
        total = sum(len(s) for s in sequences)
        fr = tuple((g, sum(s.count(GEAR_CHAR[g]) for s in sequences) / total) for g in GEARS)
        out.append(PolicySpec(
            f"random@{tag}", "random", spec.scope, fractions=fr, seed=row_seed, matched_to=spec.name,
            sequences=tuple(shuffled), store=spec.store,
        ))
    return out
