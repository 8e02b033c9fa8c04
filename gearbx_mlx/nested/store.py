"""The nested store of a model: its planes, its gear views, and their disk cache.

Building the planes of a model takes seconds on a CPU (every managed matrix
is quantized three times); they are built once and cached on disk beside the
converted model (or in the package's cache folder when that folder cannot be
written), in one safetensors file keyed by the model's weight files. A later
load of the ``planes`` store reads the planes and never materializes the
managed float weights. A cache file is used only if its format version, key,
plan and every tensor's shape and dtype match what the model needs, and the
file matches the integrity record written beside it (the converted models'
record, :mod:`gearbx_mlx.sources.entries`: a same-size overwrite is caught by
its hash); a missing, damaged or foreign file is rebuilt, never trusted. A
file that cannot be written (a full disk) leaves the run going without it,
with one warning naming the file and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear

from ..atomicfile import write_text
from ..sources.entries import (
    LEGACY_STALE_S,
    check_file,
    clean_stale,
    failure_cause,
    file_record,
    in_the_way,
    remove_path,
    sha256_file,
    temporary_file,
    write_file_record,
)
from .layers import NestedWeights, is_embedding, make_view, nested_weights_of
from .planes import DEFAULT_PLAN, QUANTIZED_SOURCE_PLAN, Plane, PlaneSpec

#: Bumped whenever the file layout or the plane construction changes.
FORMAT_VERSION = 2
#: Plane counts of the gears (the high gear reads every plane of its store).
GEAR_PLANES = {"low": 1, "mid": 2}
#: Name of the cache folder beside a model.
CACHE_FOLDER = "gearbx_planes"


def plan_for(high: str, quantized_source: bool, group_size: int = 64) -> Tuple[PlaneSpec, ...]:
    """Planes to build: a float source keeps its loaded weights as the high gear
    (``high='original'``: two planes) or reads a third plane (``high='planes'``);
    an MLX 8-bit source gets a 4-bit low plane and a 4-bit residual. Plane 0
    takes the gearbox's group size (MLX's 4-bit layers: 64)."""
    plan = QUANTIZED_SOURCE_PLAN if quantized_source else DEFAULT_PLAN if high == "planes" else DEFAULT_PLAN[:2]
    return ((plan[0][0], group_size),) + tuple(plan[1:])


def build_nested(modules: Mapping[str, nn.Module], plan: Sequence[PlaneSpec],
                 low: Optional[Mapping[str, Plane]] = None) -> Dict[str, NestedWeights]:
    """``{path: NestedWeights}`` of every module (float, or MLX 8-bit); ``low``: plane 0 of
    each path made by another quantizer (:func:`gearbx_mlx.nested.lowquant.low_planes`)."""
    low = low or {}
    return {path: nested_weights_of(m, plan, low.get(path)) for path, m in modules.items()}


def gear_views(
    weights: Mapping[str, NestedWeights],
    originals: Mapping[str, nn.Module],
    high: str,
    fused: bool,
) -> Dict[str, Dict[str, nn.Module]]:
    """``{gear: {path: module}}``: low and mid views, and the high gear's modules
    (the loaded ones, or the views reading every plane)."""
    kinds = {p: is_embedding(originals[p]) for p in weights}
    out: Dict[str, Dict[str, nn.Module]] = {}
    for gear, n in GEAR_PLANES.items():
        out[gear] = {p: make_view(w, min(n, w.depth), kinds[p], fused) for p, w in weights.items()}
    if high == "original":
        out["high"] = dict(originals)
    else:
        out["high"] = {p: make_view(w, w.depth, kinds[p], fused) for p, w in weights.items()}
    return out


#: MLX's quantized layers, sharded ones (``model.shard()`` of a quantized model) included.
QUANTIZED_LAYERS = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)


def module_shape(module: nn.Module) -> Tuple[int, int]:
    """``(out, in)`` of a float or MLX-quantized linear/embedding, without evaluating it
    (of the rank's shard, for a sharded linear)."""
    rows, cols = module.weight.shape
    bits = getattr(module, "bits", None)
    return (rows, cols * 32 // bits) if isinstance(module, QUANTIZED_LAYERS) else (rows, cols)


# -- the disk cache ----------------------------------------------------------------------


def fingerprint(model_dir: Path) -> str:
    """SHA-256 over the model's weight files (names, sizes and contents).

    Hashing reads the files once (about a second per GB); the digest is
    remembered in a small sidecar file keyed by size and modification time.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no .safetensors weights: nothing to key a planes cache on")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{_file_digest(f)}\0".encode())
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    st = path.stat()
    side = path.with_name(f".{path.name}.sha256")
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    try:
        saved = json.loads(side.read_text())
        if saved.get("stamp") == stamp and isinstance(saved.get("sha256"), str):
            return saved["sha256"]
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    try:
        write_text(side, json.dumps({"stamp": stamp, "sha256": h.hexdigest()}))
    except OSError:
        pass  # a read-only model folder: hash again next time
    return h.hexdigest()


def cache_key(model_fingerprint: str, paths: Sequence[str], plan: Sequence[PlaneSpec],
              shard: Tuple[int, int] = (0, 1), low_quant: Optional[Mapping[str, Any]] = None) -> str:
    """What a planes file is valid for: the weights, the managed paths, the plan, for a
    model sharded over ``shard = (rank, ranks)`` with ``ranks > 1`` which shard, and the
    low plane's quantizer with its settings (:func:`gearbx_mlx.nested.lowquant.settings_of`)."""
    parts: list = [FORMAT_VERSION, model_fingerprint, list(paths), [list(s) for s in plan]]
    if shard[1] > 1:  # one process keeps the key it always had
        parts.append(list(shard))
    if low_quant and low_quant.get("method", "rtn") != "rtn":  # round-to-nearest keeps its key too
        parts.append({"low_quant": dict(low_quant)})
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def cache_path(model_dir: Path, key: str, fallback_dir: Path) -> Path:
    """``<model>/gearbx_planes/<key>.safetensors``, or under ``fallback_dir`` when
    the model folder cannot be written."""
    beside = Path(model_dir) / CACHE_FOLDER
    if os.access(model_dir, os.W_OK) and (not beside.exists() or os.access(beside, os.W_OK)):
        return beside / f"{key}.safetensors"
    return Path(fallback_dir) / f"{key}.safetensors"


def save_nested(path: Path, weights: Mapping[str, NestedWeights], key: str) -> Path:
    """Write every plane to ``path`` atomically (a locked temporary file, then a rename),
    with its integrity record beside it (:func:`gearbx_mlx.sources.entries.file_record`).

    Raises:
        OSError: ``path`` could not be written (a full disk, a read-only or foreign
            path): the message names the file and the cause, and one warning says the
            same before it is raised (the caller may go on without the cache).
    """
    arrays: Dict[str, mx.array] = {}
    layout: Dict[str, Any] = {}
    for p, w in weights.items():
        for i, (q, s, b) in enumerate(zip(w.weights, w.scales, w.biases)):
            arrays[f"{p}.{i}.q"], arrays[f"{p}.{i}.s"], arrays[f"{p}.{i}.b"] = q, s, b
        if "bias" in w:
            arrays[f"{p}.bias"] = w.bias
        layout[p] = {"bits": list(w.bits), "group_sizes": list(w.group_sizes), "exponents": list(w.exponents),
                     "bias": "bias" in w}
    meta = {"format": "gearbx-planes", "version": str(FORMAT_VERSION), "key": key, "layout": json.dumps(layout)}
    try:
        # The package's own cache: a file where its folder belongs, or a folder, pipe or device where
        # its file belongs, is removed (each run warned and rebuilt the planes, and said not to delete it).
        for blocker in [p for p, folder in ((path.parent, True), (path, False)) if in_the_way(p, folder)]:
            warnings.warn(f"{blocker} was in the way of the planes cache: removed", stacklevel=3)
            remove_path(blocker)
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(path.parent)
        with temporary_file(path.parent, path.name) as (tmp, fh):
            # A Python file, not a path: MLX then reports a failed write as the OSError it is.
            mx.save_safetensors(fh, arrays, metadata=meta)
            fh.flush()
            digest = sha256_file(tmp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file_record(path))  # no moment where the old record vouches for the new file
            os.replace(tmp, path)
        write_file_record(path, digest, {"key": key})
    except (OSError, RuntimeError) as e:
        cause = failure_cause(e)
        message = f"planes cache {path} not written ({cause}): going on without it"
        warnings.warn(message, stacklevel=3)
        raise OSError(getattr(e, "errno", None) or errno.EIO, message) from None
    return path


#: Temporary files of earlier versions' writers (``.<key>.XXXXXXXX.safetensors``).
_LEGACY_TMP = re.compile(r"\.[0-9a-f]{24}\.[a-z0-9_]{8}\.safetensors")


def sweep_stale(folder: Path) -> int:
    """Remove the temporaries that killed writers left in a planes folder; how many went."""
    removed = clean_stale(folder)
    now = time.time()
    for p in folder.glob(".*.safetensors") if folder.is_dir() else ():
        with contextlib.suppress(OSError):
            if _LEGACY_TMP.fullmatch(p.name) and now - p.lstat().st_mtime > LEGACY_STALE_S:
                p.unlink()
                removed += 1
    return removed


class PlanesCacheError(ValueError):
    """A planes file that does not belong to this model or is damaged."""


def load_nested(
    path: Path, key: str, shapes: Mapping[str, Tuple[int, int]], plan: Sequence[PlaneSpec]
) -> Dict[str, NestedWeights]:
    """The planes saved at ``path`` for ``key``, checked against their integrity record
    (sizes, and SHA-256 where the file was touched), each path's ``(out, in)`` and the plan.

    Raises:
        PlanesCacheError: not a regular file, no record or not matching it (a
            damaged file), unreadable, another model's or another plan's file,
            or a tensor missing or of the wrong shape.
    """
    sweep_stale(Path(path).parent)
    reason = check_file(Path(path))
    if reason is not None:  # checked before it is opened: a FIFO there must not block the run
        raise PlanesCacheError(f"planes cache {path} is not usable ({reason})")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # noqa: BLE001  (MLX raises RuntimeError/ValueError for damaged files)
        raise PlanesCacheError(f"planes cache {path} cannot be read ({e})") from None
    if meta.get("format") != "gearbx-planes" or meta.get("version") != str(FORMAT_VERSION):
        raise PlanesCacheError(f"{path} is not a planes cache of this version")
    if meta.get("key") != key:
        raise PlanesCacheError(f"planes cache {path} was made for other weights or settings")
    try:
        layout = json.loads(meta["layout"])
    except (KeyError, ValueError):
        raise PlanesCacheError(f"planes cache {path} has no readable layout") from None
    out = {}
    for p, want in shapes.items():
        entry = layout.get(p)
        want_plan = [list(s) for s in plan]
        if not isinstance(entry, dict) or [list(s) for s in zip(entry.get("bits", []), entry.get("group_sizes", []))] != want_plan:
            raise PlanesCacheError(f"planes cache {path} lacks {p} with planes {tuple(plan)}")
        planes = []
        for i, bits in enumerate(entry["bits"]):
            try:
                q, s, b = arrays[f"{p}.{i}.q"], arrays[f"{p}.{i}.s"], arrays[f"{p}.{i}.b"]
            except KeyError:
                raise PlanesCacheError(f"planes cache {path} lacks plane {i} of {p}") from None
            planes.append(Plane(q, s, b, int(bits), int(entry["group_sizes"][i]), int(entry["exponents"][i])))
        got = {pl.shape for pl in planes}
        if got != {tuple(want)}:
            raise PlanesCacheError(f"planes cache {path}: {p} has planes of shape {got}, the model's is {tuple(want)}")
        bias = arrays.get(f"{p}.bias") if entry.get("bias") else None
        out[p] = NestedWeights(planes, bias)
    return out


def cached_nested(
    planes_file: Optional[Path],
    key: Optional[str],
    sources: Mapping[str, nn.Module],
    plan: Sequence[PlaneSpec],
    build: Optional[Callable[[], Dict[str, NestedWeights]]] = None,
) -> Tuple[Dict[str, NestedWeights], str]:
    """The planes of ``sources`` read from ``planes_file`` (made for ``key``), else built by
    ``build`` (default :func:`build_nested` of ``sources``) and written there for the next run.

    A damaged or foreign file is rebuilt with one warning; a file that cannot be written
    leaves the run without the cache (:func:`save_nested` warns). None: no cache at all.

    Returns:
        ``({path: NestedWeights}, origin)``: origin ``"cache"``, ``"built"`` or
        ``"built (cache not written: ...)"``.
    """
    if planes_file is not None and key is not None and planes_file.exists():
        shapes = {p: module_shape(m) for p, m in sources.items()}
        try:
            return load_nested(planes_file, key, shapes, plan), "cache"
        except PlanesCacheError as e:
            warnings.warn(f"{e}; rebuilding it", stacklevel=3)
    nested = build() if build is not None else build_nested(sources, plan)
    origin = "built"
    if planes_file is not None and key is not None:
        try:
            save_nested(planes_file, nested, key)
        except OSError as e:
            origin = f"built (cache not written: {e})"
    return nested, origin
