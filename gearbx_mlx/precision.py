"""The precision manager: the gears' modules and their swaps (§6); which modules
it manages is :mod:`.discovery`'s.

A gear shift is one ``model.update_modules`` call driven by a plan
``{module path: module}``. Two stores hold the gears' weights:

* ``separate``: each gear is quantized from the loaded weights the first time
  it is entered (§6.2) and cached; the high gear re-installs the very module
  objects that were loaded, so its logits are bit-identical to the
  unmodified model.
* ``nested``: every gear reads a prefix of one set of bit planes
  (:mod:`gearbx_mlx.nested`), built (or read from the disk cache) when the
  manager is made; a shift only installs other views of the same arrays.
  The high gear is the loaded weights (``high='original'``) or every plane
  (``high='planes'``, and the loaded weights are dropped).

On a model sharded with ``model.shard()`` (mlx.distributed) the managed
modules are MLX's sharded linears: each rank builds every gear from its own
shard (:mod:`gearbx_mlx.distributed.layers`), so the gears of a rank hold
only its shard, and a sharded-to-all gear keeps the sum over the ranks.

Memory, truthfully: MLX on Apple Silicon has one unified memory pool, and on
the Linux CPU backend there is no device pool at all, so nothing is
offloaded. :meth:`PrecisionManager.memory` counts every array the gears hold,
each once.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Deque, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import load_tokenizer

from .affine import bytes_per_weight
from .bindings import gpu
from .blockstep import compile_block_steps
from .config import GEARS, GearboxConfig, bits_for
from .discovery import (  # re-exported: callers read them here
    discover,
    nbytes,
    read_bytes,
    step_read_bytes,
)
from .distributed.layers import is_sharded, local_linear, shard_gear
from .nested.fused import FusedNestedLinear, fuse_nested_views
from .nested.layers import NestedWeights
from .nested.lowquant import calibration_tokens, low_planes, settings_of
from .nested.matmul import DEFAULT_CONFIG as NESTED_KERNELS
from .nested.planes import Plane, PlaneSpec
from .nested.store import (
    GEAR_PLANES,
    build_nested,
    cache_key,
    cache_path,
    cached_nested,
    fingerprint,
    gear_views,
    module_shape,
    plan_for,
)
from .packed.fused import fuse_modules
from .packed.layers import PackedEmbedding, PackedLinear
from .resolver import is_prequantized, resolve, weights_source
from .sources.cache import cache_dir

#: Shifts (and entries into each gear) a manager keeps the records of: the latest ones;
#: its counts and total swap time cover every shift.
SHIFTS_KEPT = 1024


@dataclass
class ShiftRecord:
    """One gear shift: from, to, and what it cost."""

    source: str
    target: str
    seconds: float  # wall time of the whole shift (quantization included)
    quantize_seconds: float  # 0 on a cached re-entry
    first_entry: bool


Quantizer = Callable[[nn.Module, int, int], nn.Module]


def mlx_quantizer(module: nn.Module, bits: int, group_size: int) -> nn.Module:
    """MLX's own quantized layers (``QuantizedLinear`` / ``QuantizedEmbedding``)."""
    if isinstance(module, nn.Embedding):
        return nn.QuantizedEmbedding.from_embedding(module, group_size, bits)
    return nn.QuantizedLinear.from_linear(module, group_size, bits)


def packed_quantizer(module: nn.Module, bits: int, group_size: int) -> nn.Module:
    """Our packed int4/int8 layers (``PackedLinear`` / ``PackedEmbedding``)."""
    if isinstance(module, nn.Embedding):
        return PackedEmbedding.from_embedding(module, bits=bits, group_size=group_size)
    return PackedLinear.from_linear(module, bits=bits, group_size=group_size)


def prime_kernels(modules: Dict[str, nn.Module]) -> int:
    """Make the first call of each CPU kernel of ``modules`` (one gear's) now: one input row
    through the first module of each type and shape, so that its first-use check
    (:mod:`gearbx_mlx.bindings.guard`: the kernel's output against the pure-MLX reference) is
    spent here, where the nested store builds every gear at load, not in the first prompt,
    where the checks of a gear's few shapes cost as much as several layers' products. Later
    modules of the same shape find the kernel trusted. (The separate store quantizes a gear
    when a generation first enters it, and checks each kernel at its first call in that
    generation, as before: checking them at its quantization would only move the work within
    the generation.) Returns the number of modules called.
    """
    seen = set()
    for m in modules.values():
        nested = getattr(m, "nested", None)
        shape = nested.shape if nested is not None else (getattr(m, "out_features", None), getattr(m, "in_features", None))
        if is_sharded(m) or not isinstance(shape[1], int) or (type(m), shape) in seen:
            continue  # a loaded float layer (no kernel), or a rank's shard (its call would be a collective)
        seen.add((type(m), shape))
        x = mx.random.normal((1, 1, shape[1]), key=mx.random.key(len(seen)))  # the caller's stream untouched
        mx.eval(m.as_linear(x) if hasattr(m, "as_linear") else m(x))
    return len(seen)


class PrecisionManager:
    """Swaps managed modules of a live model between gears.

    Args:
        model: an mlx-lm model (any ``nn.Module`` tree).
        config: scope, bits per gear, group size, kernel, telemetry-only.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Optional[GearboxConfig] = None,
        planes_dir: Optional[Path] = None,
        draft_scope: Optional[str] = None,
        draft_gear: Optional[str] = None,
    ) -> None:
        """
        Args:
            draft_scope: the layers a speculative drafter quantizes (the nested
                store's planes are built over them: one copy for both).
            draft_gear: the gear that drafts, where the run only drafts and
                verifies (it never enters another gear than that and the high
                one): with ``high='original'`` each managed layer holds the draft
                gear's planes alone, not every gear's. None: every gear's.
            planes_dir: the loaded model's folder: the nested store reads its
                planes from the disk cache there (or in the package's cache
                folder) when a valid one exists, and writes them there after
                building them.

        Raises:
            ValueError: ``store='nested'`` on a model quantized below 8 bits.
        """
        self.model = model
        self.config = config or GearboxConfig()
        c = self.config
        #: The config as resolved (store, kernel, scope) and why (:mod:`gearbx_mlx.resolver`).
        self.config, self.resolution = resolve(c, model, draft_scope)
        c = self.config
        quantized = is_prequantized(model)
        self.source = weights_source(model)
        #: The store in use (:func:`~gearbx_mlx.resolver.resolve` decided it).
        self.store = c.store
        if self.store == "nested" and self.source == "quantized" and not c.telemetry_only:
            raise ValueError(
                "the nested store re-expresses float or MLX 8-bit weights; this model is quantized below "
                "8 bits, so it has no room for finer gears: use the separate store (telemetry only)"
            )
        if c.low_quant != "rtn" and (self.store != "nested" or c.telemetry_only):
            raise ValueError(f"--low-quant {c.low_quant} builds the nested store's low gear, and this gearbox "
                             f"runs {'telemetry only' if c.telemetry_only else 'the separate store'} "
                             f"({self.resolution.as_dict()['why']['store']})")
        self.telemetry_only = c.telemetry_only or (quantized and not (self.store == "nested" and self.source == "quantized-8bit"))
        #: Why nothing is swapped (None when gears are real), for the user to read.
        self.telemetry_reason: Optional[str] = (
            "asked for (--telemetry-only)" if c.telemetry_only
            else "the model is already quantized below 8 bits, so there are no finer weights to route to"
            if self.telemetry_only else None
        )
        #: Weight bytes of the model as loaded, and of what one of its decode steps reads.
        self.model_bytes = nbytes(model)
        self.loaded_read_bytes = step_read_bytes(model)
        #: Bytes ``scope="all"`` would manage, taken before any gear is installed (a
        #: nested high gear replaces the loaded modules, which would hide them later).
        every = set() if self.telemetry_only else set(discover(model, "all", c.group_size,
                                                                quantized=self.source != "float")[0])
        self.managed_bytes_scope_all = sum(nbytes(m) for p, m in model.named_modules() if p in every)
        if self.telemetry_only:
            self.paths, self.skipped = [], []
        else:
            self.paths, self.skipped = discover(model, c.scope, c.group_size, quantized=self.source != "float")
        modules = dict(model.named_modules())
        # The very objects that were loaded: the high gear restores these (unless it reads planes).
        self.originals: Dict[str, nn.Module] = {p: modules[p] for p in self.paths}
        # What the gears are built from: each module itself, or the rank's shard of a sharded linear.
        self.sources: Dict[str, nn.Module] = {
            p: local_linear(m) if is_sharded(m) else m for p, m in self.originals.items()}
        #: Bytes of the managed modules as loaded (kept: a nested high gear lets them go).
        self.managed_loaded_bytes = sum(nbytes(m) for m in self.originals.values())
        self._start_in_high(planes_dir, draft_gear)
        # A static high gear that reads the loaded weights never enters another gear: no planes until asked.
        if self.store == "nested" and self.paths and not (c.static_gear == "high" and c.high == "original"):
            self._build_nested(planes_dir)

    def _start_in_high(self, planes_dir: Optional[Path], draft_gear: Optional[str]) -> None:
        """The state of a manager in the high gear, before any other gear or plane is built."""
        c = self.config
        self.cache: Dict[str, Dict[str, nn.Module]] = {"high": self.originals}
        self.gear = "high"
        # Swap seconds (quantization excluded) of the latest entries into each gear, and the
        # latest shifts: bounded, so a server's process does not grow by a record a shift;
        # the counts and totals below cover every one.
        self.swaps: Dict[str, Deque[float]] = {g: deque(maxlen=SHIFTS_KEPT) for g in GEARS}
        self.entry_counts: Dict[str, int] = {g: 0 for g in GEARS}
        self.quantize_seconds: Dict[str, float] = {}
        self.history: Deque[ShiftRecord] = deque(maxlen=SHIFTS_KEPT)
        self.shift_count = 0
        self.swap_seconds_total = 0.0
        self._trees: Dict[str, Tuple[Dict[str, nn.Module], Dict[str, object]]] = {}
        self._quantizer: Quantizer = packed_quantizer if c.kernel == "packed" else mlx_quantizer
        self.nested: Optional[Dict[str, NestedWeights]] = None
        self.planes_seconds = 0.0  # building (or reading) the nested planes
        self.planes_file: Optional[Path] = None
        self.planes_origin = ""  # "built", "cache", or "built (cache not written: ...)"
        self.low_quant_seconds = 0.0  # of planes_seconds, the low quantizer's (0 for rtn or a cache hit)
        #: Where the nested store's planes are cached (the loaded model's folder), if anywhere.
        self.planes_dir = planes_dir
        if draft_gear is not None:
            bits_for(draft_gear, c)  # validates the name
        self._draft_gear = draft_gear

    def _build_nested(self, planes_dir: Optional[Path]) -> None:
        c = self.config
        if c.bits != {"low": 4, "mid": 8}:
            raise ValueError(f"the nested store's gears are 4-bit and 4+4-bit planes; bits={c.bits} needs store='separate'")
        tic = time.perf_counter()
        plan = self._plans(plan_for(c.high, self.source == "quantized-8bit", c.group_size))
        if c.low_quant != "rtn" and self.source != "float":
            raise ValueError(f"--low-quant {c.low_quant} quantizes float weights; this model is {self.source}")
        key = None
        if planes_dir is not None:
            key = cache_key(fingerprint(planes_dir), self.paths, plan, self._shard(), settings_of(c.low_quant))
            self.planes_file = cache_path(planes_dir, key, cache_dir() / "planes")
        self.nested, self.planes_origin = cached_nested(
            self.planes_file, key, self.sources, plan,
            lambda: build_nested(self.sources, plan, self._low_planes(planes_dir)))
        views = gear_views(self.nested, self.originals, c.high, fused=c.kernel == "packed")
        if gpu.gpu_backend() is not None:
            views = self._gpu_views(views)
        self.cache = {g: {p: shard_gear(m, self.originals[p]) for p, m in mods.items()} for g, mods in views.items()}
        mx.eval([w.parameters() for w in self.nested.values()])
        if c.kernel == "packed" and mx.default_device().type == mx.DeviceType.cpu:
            # The C kernels' view of each matrix's planes, checked now with the planes rather
            # than in the first prefill (where it would cost as much as a few layers' products),
            # and the float32 matrix per shape that a prefill unpacks a gear into.
            for w in self.nested.values():
                w.product.cpu_prepared()
                w.product.reserve_dense()
            for mods in self.cache.values():
                prime_kernels(mods)
        self.planes_seconds = time.perf_counter() - tic
        self._no_gear_dearer_than_high()
        if c.high == "planes":
            # The high gear reads the planes: install it now, and let the loaded weights go.
            self.model.update_modules(self._tree("high"))
            self.originals, self.sources = {}, {}

    def _low_planes(self, planes_dir: Optional[Path]) -> Optional[Dict[str, Plane]]:
        """Plane 0 of every managed path by the config's ``low_quant`` (None: round-to-nearest,
        made with the other planes); the calibration text is tokenized with the model's own
        tokenizer, read from its folder."""
        method = self.config.low_quant
        if method == "rtn":
            return None
        if planes_dir is None:
            raise ValueError(f"--low-quant {method} reads the model's tokenizer from its folder: load a local model")
        tic = time.perf_counter()
        tokens = calibration_tokens(load_tokenizer(Path(planes_dir)))
        low = low_planes(self.model, self.paths, method, tokens, self.config.group_size)
        self.low_quant_seconds = time.perf_counter() - tic
        return low

    def _plans(self, plan: Tuple[PlaneSpec, ...]) -> Tuple[PlaneSpec, ...]:
        """The planes to build: ``plan``, or in a run that only drafts and verifies (see
        ``draft_gear``) the draft gear's planes alone, where the high gear reads the loaded
        weights: that run never reads the others, and on a float model the residual planes
        cost most of a build's time and memory."""
        if self._draft_gear is None or self.config.high != "original":
            return plan
        return plan[: GEAR_PLANES.get(self._draft_gear, len(plan))]

    def _no_gear_dearer_than_high(self) -> None:
        """A gear that reads more bytes than the high gear is not offered: it runs the high gear's
        modules (on an MLX 8-bit model the mid planes, 4+4 bits with their scales, outweigh the
        loaded 8-bit layers), and the resolution says so."""
        if self.config.high != "original":
            return
        high = sum(read_bytes(m) for m in self.cache["high"].values())
        for gear in ("mid", "low"):
            if gear in self.cache and sum(read_bytes(m) for m in self.cache[gear].values()) >= high:
                self.cache[gear] = self.cache["high"]
                self.resolution = dataclasses.replace(self.resolution, why=self.resolution.why + (
                    (gear, "its planes read no fewer bytes than the loaded weights: it runs the high gear's"),))

    def _gpu_views(self, views: Dict[str, Dict[str, nn.Module]]) -> Dict[str, Dict[str, nn.Module]]:
        """On a GPU: every gear's fused groups (q/k/v, gate/up) in one launch each, their planes
        stacked once for all gears (each member's planes become row slices of its group's, so the
        separate copies go), and each block's one-token step compiled per gear; per
        :data:`~gearbx_mlx.nested.matmul.DEFAULT_CONFIG`. Sharded layers keep their own views."""
        if NESTED_KERNELS.gpu_fuse_groups and not any(is_sharded(m) for m in self.originals.values()):
            groups: dict = {}
            views = {g: fuse_nested_views(mods, groups) for g, mods in views.items()}
            for mods in views.values():
                for p, m in mods.items():
                    if isinstance(m, FusedNestedLinear):
                        self.nested[p] = m["nested"]
        if NESTED_KERNELS.gpu_block_steps:
            compile_block_steps(self.model)
        return views

    def _shard(self) -> Tuple[int, int]:
        """``(rank, ranks)`` of the group the managed layers are sharded over; ``(0, 1)`` if none."""
        for m in self.originals.values():
            if is_sharded(m):
                return m.group.rank(), m.group.size()
        return 0, 1

    # -- quantization -------------------------------------------------------
    def prepare(self, gear: str) -> float:
        """Quantize ``gear``'s modules if not yet cached; return seconds spent."""
        bits = bits_for(gear, self.config)
        if gear in self.cache or self.telemetry_only:
            return 0.0  # a nested store built every gear with its planes
        if self.store == "nested":  # deferred (a static high gear): every gear at once
            self._build_nested(self.planes_dir)
            return self.planes_seconds
        tic = time.perf_counter()
        built = {
            p: self._quantizer(m, bits, self.config.group_size) for p, m in self.sources.items()
        }
        mx.eval([m.parameters() for m in built.values()])
        if self.config.kernel == "packed":
            # q/k/v and gate/up in one GPU launch each (a no-op where they
            # cannot fuse; on the CPU each member computes its own rows).

            built = fuse_modules(built)
        built = {p: shard_gear(m, self.originals[p]) for p, m in built.items()}
        dt = time.perf_counter() - tic
        self.cache[gear] = built
        self.quantize_seconds[gear] = dt
        return dt

    # -- shifting -----------------------------------------------------------
    def shift(self, gear: str, record: bool = True) -> Optional[ShiftRecord]:
        """Install ``gear``'s modules; None if already there (idempotent).

        ``record=False``: a restore, not a routing decision (the loaded weights put back when a
        stream ends): neither an entry of the gear nor a shift in the summary.
        """
        bits_for(gear, self.config)  # validates the name
        if gear == self.gear:
            return None
        tic = time.perf_counter()
        first = gear not in self.cache and not self.telemetry_only
        q_dt = self.prepare(gear) if first else 0.0
        if not self.telemetry_only and self.paths:
            self.model.update_modules(self._tree(gear))
        dt = time.perf_counter() - tic
        shifted = ShiftRecord(self.gear, gear, dt, q_dt, first)
        self.gear = gear
        if not record:
            return shifted
        if not self.telemetry_only:  # a telemetry-only "shift" swaps nothing: no cost to report
            self.swaps[gear].append(dt - q_dt)
            self.entry_counts[gear] += 1
        self.history.append(shifted)
        self.shift_count += 1
        self.swap_seconds_total += shifted.seconds - shifted.quantize_seconds
        return shifted

    def _tree(self, gear: str) -> Dict[str, object]:
        """The nested update of ``gear``'s modules, built once per cached gear
        (flattening and unflattening the paths cost ten times the swap itself)."""
        mods = self.cache[gear]
        held = self._trees.get(gear)
        if held is None or held[0] is not mods:
            held = (mods, tree_unflatten(list(mods.items())))
            self._trees[gear] = held
        return held[1]

    # -- reporting ----------------------------------------------------------
    def installed(self) -> Dict[str, nn.Module]:
        """The modules now in the tree at the managed paths."""
        modules = dict(self.model.named_modules())
        return {p: modules[p] for p in self.paths}

    def memory(self) -> Dict[str, int]:
        """Bytes of the managed layers: what each built gear reads, and what is resident.

        ``<gear>_bytes``: the arrays a forward pass in that gear reads (for a
        nested view, the planes it reads); ``active_bytes``: the installed
        gear's; ``resident_total``: every array any built gear holds, each
        counted once (shared planes and biases too) — on unified memory
        nothing is offloaded, so this is what the managed layers hold;
        ``fp16_bytes``: the managed weights at 2 bytes each, the yardstick of
        the ratios people quote.
        """
        out = {f"{g}_bytes": sum(read_bytes(m) for m in mods.values()) for g, mods in self.cache.items()}
        out["active_bytes"] = out.get(f"{self.gear}_bytes", 0)
        seen: Dict[int, int] = {}
        for mods in self.cache.values():
            for m in mods.values():
                for _, v in tree_flatten(m.parameters()):
                    seen[id(v)] = v.nbytes
        out["resident_total"] = sum(seen.values())
        out["fp16_bytes"] = 2 * self.managed_parameters()
        return out

    def step_bytes(self) -> Dict[str, float]:
        """Weight bytes one decode step reads in each gear (§9, MLX's formats).

        The loaded model reads :attr:`loaded_read_bytes`; a gear reads the
        same minus the managed modules as loaded plus what its own modules
        read: where the gear is built, its modules (for a nested view, the
        planes it reads); else the affine format's size (``bits/8`` per weight
        plus a scale and a bias per group, in the weights' float dtype).
        """
        base = self.loaded_read_bytes - self.managed_loaded_bytes
        out: Dict[str, float] = {}
        for gear in ("high", "mid", "low"):
            if gear in self.cache:
                built = float(sum(read_bytes(m) for m in self.cache[gear].values()))
            else:
                bits = bits_for(gear, self.config)
                built = 0.0
                for m in self.originals.values():
                    rows, cols = module_shape(m)
                    scale = m.weight.dtype.size if mx.issubdtype(m.weight.dtype, mx.floating) else 2
                    built += rows * cols * bytes_per_weight(bits, self.config.group_size, scale)
            out[gear] = base + built
        return out

    def managed_share(self) -> float:
        """Share of the loaded model's step bytes that the gears manage."""
        return self.managed_loaded_bytes / self.loaded_read_bytes if self.loaded_read_bytes else 0.0

    def managed_parameters(self) -> int:
        """Number of weight elements in the managed modules (for §9 cost model)."""
        if self.nested is not None:
            return sum(w.shape[0] * w.shape[1] for w in self.nested.values())
        return sum(module_shape(m)[0] * module_shape(m)[1] for m in self.originals.values())

    def entries(self) -> Dict[str, Dict[str, object]]:
        """Per gear: one-time quantization seconds, entries, median swap seconds (of the
        latest :data:`SHIFTS_KEPT` entries)."""
        out = {}
        for g, swaps in self.swaps.items():
            ordered = sorted(swaps)
            out[g] = {
                "quantize_seconds": self.quantize_seconds.get(g),
                "entries": self.entry_counts[g],
                "swap_median_seconds": ordered[len(ordered) // 2] if ordered else None,
            }
        return out

    def summary(self) -> Dict[str, object]:
        return {
            "gear": self.gear,
            "store": self.store,
            "high": self.config.high if self.store == "nested" else "original",
            "planes_seconds": self.planes_seconds,
            "planes_origin": self.planes_origin,
            "managed_modules": len(self.paths),
            "skipped_modules": self.skipped,
            "telemetry_only": self.telemetry_only,
            "shifts": self.shift_count,
            "quantize_seconds": dict(self.quantize_seconds),
            "swap_seconds": self.swap_seconds_total,
            "entries": self.entries(),
            "memory": self.memory(),
            "model_bytes": self.model_bytes,
            "step_bytes": self.step_bytes(),
            "managed_share": self.managed_share(),
        }
