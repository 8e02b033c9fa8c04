"""The sparse drafter's host step: the dense host step with each ``down_proj`` over its kept blocks.

:class:`~gearbx_mlx.speculative.host.HostForward` runs a llama-shaped
drafter's decode step in numpy around the C GEMV. The activation-sparse
drafter is that step with one change per layer: ``down_proj`` is
:class:`~gearbx_mlx.bindings.sparse_cpu.TopBlocksProduct`, one C call that
picks the ``keep`` blocks of largest ``sum |h|`` (as
:func:`~gearbx_mlx.speculative.sparse.top_blocks` does) and reads only their
columns of the packed weight, in place. No MLX graph, no sync, no gather copy.

Every token the host step feeds is a one-token step, so unlike the MLX tree
(whose multi-token prefills go dense) the prompt and the re-fed accepted
tokens also run sparse: the drafter's own KV entries are the sparse
drafter's. Exactness does not depend on it (the verifier is the high gear).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import mlx.nn as nn
import numpy as np

from ..bindings import cpu as cpu_kernels, guard, sparse_cpu
from .host import HostForward, host_support

#: Index of ``down_proj`` in a layer's tuple of :attr:`HostForward.layers`.
DOWN_SLOT = 8
#: The kernel's name in the first-use warning and :func:`~gearbx_mlx.bindings.guard.status`.
FAMILY = "C block-sparse GEMV"
#: First-use check: the fast kernel against its scalar C oracle, relative to ``max |y|``.
FIRST_USE_RTOL = 1e-4


def first_use_ok(prepared: sparse_cpu.PreparedSparse, path: str) -> bool:
    """Whether the fast kernel of ``path`` agrees with its scalar oracle on a random row and half the
    blocks of ``prepared`` (a kernel never used on this machine is checked before it drafts)."""
    x = np.random.default_rng(0).standard_normal(prepared.in_features).astype(np.float32)
    blocks = np.arange(0, prepared.blocks, 2, dtype=np.int32)
    fast = np.array(prepared.gemv(x, blocks, path=path, bias=False))
    ref = np.array(prepared.gemv(x, blocks, path="intdot_ref" if path == "intdot" else "ref", bias=False))
    return bool(np.isfinite(fast).all() and np.abs(fast - ref).max() <= FIRST_USE_RTOL * max(np.abs(ref).max(), 1e-6))


def sparse_host(module: nn.Module, parts: Sequence[Any], keep: Sequence[int],
                paths: Sequence[str]) -> Tuple[Optional[HostForward], Optional[str]]:
    """The host step of the sparse drafter ``module`` and None, or None and why it does not apply.

    Args:
        module: the sparse drafter's tree (its layers' ``mlp`` expose ``gate_proj``, ``up_proj``, ``down_proj``).
        parts: each layer's ``down_proj`` as one MLX affine quantization (``QuantParts``).
        keep: blocks kept per layer (a layer keeping all of them stays dense).
        paths: the C path of each layer's sparse product (``"float"`` or ``"intdot"``).
    """
    reason = host_support(module)
    if reason is None:
        reason = next((r for r in map(sparse_cpu.unsupported, parts) if r is not None), None)
    if reason is None:
        bad = sorted(p for p in set(paths) if not first_use_ok(sparse_cpu.prepared_sparse(parts[0]), p))
        if bad:
            reason = "the C block-sparse kernel failed its first-use check against its scalar oracle"
            for path in bad:
                guard.record_failure(FAMILY, f"{FAMILY} ({path})", "it disagrees with its scalar C oracle")
    if reason is not None:
        return None, reason
    host = HostForward(module, cpu_kernels.require())
    for i, (p, k, path) in enumerate(zip(parts, keep, paths)):
        prepared = sparse_cpu.prepared_sparse(p)
        if k < prepared.blocks:
            row = host.layers[i]
            host.layers[i] = row[:DOWN_SLOT] + (sparse_cpu.TopBlocksProduct(prepared, k, path),) + row[DOWN_SLOT + 1:]
    return host, None


__all__ = ["DOWN_SLOT", "FAMILY", "FIRST_USE_RTOL", "first_use_ok", "sparse_host"]
