"""The command's thresholds: from ``--thresholds``, a ``--calibration`` file, or a ``--calibrate`` run.

A ``--calibrate`` without ``--calibration FILE`` keeps its result in the
package's cache, keyed by the model's weights and the settings it depends on
(:func:`gearbx_mlx.calibration.cached_calibration_path`), and a later run with
the same model and settings reuses it. The KV flags' options live here too:
the calibration of a rotated KV cache depends on them. ``generate`` and the
server share these functions.
"""

from __future__ import annotations

import argparse
import math
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

from .calibration import Calibration, cached_calibration_path, calibrate_kv
from .console import refuse_kv_flags_unused, say
from .distributed.ranks import Ranks, stage
from .kvcache.option import KVOptions
from .sources.entries import in_the_way, make_folder, remove_path, unwritable
from .speculative.calibration import CALIBRATION_KEY
from .speculative.cli import calibrate_drafter, calibrate_sparse
from .speculative.sparse import THRESHOLDS_KEY


def kv_options(args: argparse.Namespace) -> KVOptions:
    """The KV flags as :class:`KVOptions` (ValueError naming the flag)."""
    refuse_kv_flags_unused(args)
    try:
        return KVOptions(bits=args.kv_bits, group_size=args.kv_group_size,
                         quantized_kv_start=args.quantized_kv_start, rotation=args.kv_rotation)
    except ValueError as e:
        msg = str(e)
        for name in ("kv_bits", "kv_group_size", "quantized_kv_start", "kv_rotation"):
            msg = msg.replace(name, "--" + name.replace("_", "-"))
        raise ValueError(msg) from None


def check_thresholds(gearbox: Any) -> None:
    """Thresholds from a flag or a calibration file against this model's largest entropy."""
    vmax = math.log2(gearbox.vocab_size)
    low, high = gearbox.thresholds
    if high > vmax:
        raise ValueError(
            f"the high threshold {high:.6g} bits is above log2({gearbox.vocab_size}) = {vmax:.3f} bits, the "
            "largest entropy this model can have: the high gear would be unreachable (lower it, or calibrate again)"
        )


def set_thresholds(args: argparse.Namespace, model: Any, tokenizer: Any, gearbox: Any, ranks: Optional[Ranks]) -> str:
    """Set the thresholds from the flags, a calibration file or a calibration run; the stage reached.

    ``--calibrate`` without ``--calibration FILE`` keeps its result in the
    package's cache, keyed by the model's weights and the settings it depends
    on, and a later ``--calibrate`` with the same model and settings reuses it.
    """
    with stage(ranks, "setting the thresholds"):
        if args.thresholds:
            gearbox.set_thresholds(*args.thresholds)
        elif args.calibration and not args.calibrate:
            try:
                gearbox.set_calibration(Calibration.load(args.calibration))
            except ValueError as e:
                raise ValueError(f"--calibration {args.calibration}: {e}") from None
    if not args.calibrate or args.thresholds:
        return "prefill"
    cached = None if args.calibration or ranks is not None else cached_calibration_path(
        gearbox.model_dir, gearbox.model_name, _calibration_settings(args, gearbox))
    reused, damaged = False, None
    if cached is not None and (cached.exists() or cached.is_symlink()):
        try:
            if not cached.is_file():
                raise ValueError("not a regular file")
            gearbox.set_calibration(Calibration.load(cached))
            reused = True
        except (ValueError, OSError) as e:  # the package's own cache: rebuilt, not the user's to mend
            damaged = f"the saved calibration {cached} is damaged ({e})"
            remove_path(cached)
            if not os.path.lexists(cached):  # else a read-only cache keeps it: the save below says so, once
                warnings.warn(f"{damaged}: calibrating again", stacklevel=2)
                damaged = None
    if reused:
        say(args, f"reusing the calibration saved by an earlier --calibrate of this model and settings: {cached} "
                  "(delete it to calibrate again)")
    else:
        say(args, f"calibrating thresholds ({args.calibrate}) ...")
        gearbox.calibrate(tokenizer, args.calibrate)
    cal = gearbox.calibration
    if kv_options(args).rotated and cal.kv is None:
        say(args, "calibrating the KV cache's scales and offsets ...")
        cal.kv = calibrate_kv(model, tokenizer)
    if args.speculative and args.draft_gear not in (cal.extra.get(CALIBRATION_KEY) or {}):
        calibrate_drafter(args, model, tokenizer, gearbox)
    if args.speculative and getattr(args, "draft_sparsity", None) is not None and THRESHOLDS_KEY not in cal.extra:
        calibrate_sparse(args, model, tokenizer, gearbox)
    with stage(ranks, "saving the calibration"):
        target = args.calibration or cached
        if target is not None and getattr(args, "rank", 0) == 0:
            if target == cached:
                _save_cached(cal, cached, damaged)
            else:
                cal.save(target)
    return "prefill"


def _save_cached(cal: Calibration, path: Path, damaged: Optional[str] = None) -> None:
    """Keep ``cal`` at ``path`` in the package's cache for later ``--calibrate`` runs.

    The cache is a convenience: a folder that cannot take it (read-only, full, a
    file in its place, a FIFO or folder at ``path`` that cannot be removed) costs
    the later runs their reuse, not this run its calibration. One warning names
    the folder and the fixes (and ``damaged``, the entry that could not be
    replaced), the run goes on.
    """
    try:
        make_folder(path.parent)
        try:
            if in_the_way(path, folder=False):  # a FIFO, folder or device at the entry: the cache's own
                remove_path(path)
            if in_the_way(path, folder=False):  # a read-only folder keeps it (the write would refuse a pipe)
                raise OSError(f"{path.name} is in the way and cannot be removed")
            cal.save(path)
        except OSError as e:
            raise unwritable(path.parent, e, damaged) from None
    except OSError as e:
        warnings.warn(f"the calibration is used for this run but could not be saved: {e}, "
                      "or save it elsewhere with --calibration FILE", stacklevel=2)


def _calibration_settings(args: argparse.Namespace, gearbox: Any) -> Dict[str, Any]:
    """What a calibration's thresholds, KV statistics and drafter statistics depend on."""
    return {"strategy": args.calibrate, "vocab": gearbox.vocab_size, "config": gearbox.config.to_dict(),
            "draft": [args.draft_gear, args.draft_scope] if args.speculative else None}
