"""The speculative acceptance rule, greedy and sampled (one concern: exactness).

Greedy: a draft is accepted iff it is the high gear's argmax; the token after
the accepted prefix is the high gear's argmax there. Sampled (Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023): accept draft ``d`` drawn from ``q`` with probability
``min(1, p(d) / q(d))``; at the first rejection draw from
``norm(max(0, p - q))``; if all ``k`` drafts pass, draw the bonus token from
``p`` at position ``k + 1``. Every emitted token is then distributed exactly
as ``p``, the high gear's sampling distribution, whatever ``q`` is.

Both are written as lazy array programs over the whole block: one sync per
block reads how many drafts were accepted and the next token.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..distributed.exchange import StepExchange
from ..entropy import entropy_bits, entropy_bits_np


def make_log_dist(
    temp: float = 0.0, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0, min_tokens_to_keep: int = 1
) -> Optional[Callable[[mx.array], mx.array]]:
    """The sampling distribution as normalized log-probabilities, or None for greedy.

    The same filters and order as ``mlx_lm.sample_utils.make_sampler`` (top-p,
    min-p, top-k, then temperature), applied to float32 log-probabilities.
    ``(R, V)`` logits -> ``(R, V)`` log-probabilities (``-inf`` where filtered).
    """
    if not math.isfinite(temp) or temp < 0:
        raise ValueError(f"temp must be >= 0, got {temp!r}")
    if temp == 0:
        return None

    def log_dist(logits: mx.array) -> mx.array:
        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        if 0 < top_p < 1.0:
            lp = apply_top_p(lp, top_p)
        if min_p != 0.0:
            lp = apply_min_p(lp, min_p, min_tokens_to_keep)
        if top_k > 0:
            lp = apply_top_k(lp, top_k)
        z = lp / temp
        return z - mx.logsumexp(z, axis=-1, keepdims=True)

    return log_dist


def accept_block(
    logits: mx.array, drafts: mx.array, draft_log_q: Optional[mx.array], log_dist: Optional[Callable]
) -> Tuple[mx.array, mx.array]:
    """The speculative acceptance rule over one block (lazy; no sync).

    Args:
        logits: ``(k+1, V)`` high-gear logits; row i scores draft i, row k is
            the bonus position.
        drafts: ``(k,)`` drafted token ids.
        draft_log_q: ``(k, V)`` the drafter's sampling log-probabilities
            (None when greedy).
        log_dist: from :func:`make_log_dist` (None: greedy).

    Returns:
        ``(n, token)``: how many drafts are accepted (scalar) and the token
        that follows them (correction, or bonus when ``n == k``).
    """
    k = drafts.shape[0]
    if log_dist is None:
        best = mx.argmax(logits, axis=-1)
        n = mx.cumprod(best[:k] == drafts).sum() if k else mx.array(0)
        return n, best[n]
    log_p = log_dist(logits)
    if k == 0:
        return mx.array(0), mx.random.categorical(log_p[0])
    idx = drafts[:, None]
    lp_d = mx.take_along_axis(log_p[:k], idx, axis=-1)[:, 0]
    lq_d = mx.take_along_axis(draft_log_q, idx, axis=-1)[:, 0]
    # u < p/q in log space; p(d) = 0 gives -inf and always rejects.
    accept = mx.log(mx.random.uniform(shape=(k,))) < lp_d - lq_d
    n = mx.cumprod(accept).sum()
    resid = mx.maximum(mx.exp(log_p[:k]) - mx.exp(draft_log_q), 0.0)
    has_mass = resid.sum(axis=-1, keepdims=True) > 0
    # A residual with no mass means p <= q everywhere, i.e. p == q: the draft
    # is then always accepted, so this row is never used; fall back to p.
    rows = mx.concatenate([mx.where(has_mass, mx.log(resid), log_p[:k]), log_p[k:]], axis=0)
    tokens = mx.random.categorical(rows)  # one sample per row; row n is used
    return n, tokens[n]


def read_verdict(logits: mx.array, drafts: mx.array, draft_log_q: Optional[mx.array],
                 log_dist: Optional[Callable], exchange: Optional[StepExchange] = None,
                 also: Sequence[mx.array] = ()) -> Tuple[int, int, List[float]]:
    """One block's verdict, read (the block's sync): accepted drafts ``n``, the next
    token, and the high gear's entropies (bits) of the ``n + 1`` emitted positions.

    ``exchange``: a sharded model's; the verdict and the entropies are then rank
    0's on every rank. ``also``: lazy arrays to evaluate in the same sync.
    """
    n, tok = accept_block(logits, drafts, draft_log_q, log_dist)
    if exchange is not None:
        n, tok, h = exchange.share(n, tok, entropy_bits(logits)).values
        mx.eval(n, tok, h, *also)
        n = int(n.item())
        return n, int(tok.item()), h.tolist()[: n + 1]
    mx.eval(n, tok, logits, *also)
    n = int(n.item())
    # In numpy: MLX's CPU exp over (k+1) x V took ~4 ms a block on the default model.
    rows = np.asarray(logits)
    return n, int(tok.item()), [entropy_bits_np(rows[i]) for i in range(n + 1)]

