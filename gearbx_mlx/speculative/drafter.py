"""Drafters: how a block's draft tokens are proposed, one strategy per draft path.

The block loop of :func:`gearbx_mlx.speculative.decode.speculative_generate_step`
is the same whatever drafts; a :class:`Drafter` owns the drafter's KV cache
and the tokens it has not consumed yet, and does three things:

* :meth:`Drafter.prefill` feeds the prompt (all but its last token);
* :meth:`Drafter.draft` proposes up to ``cap`` tokens, each fed back in turn,
  ending early after a draft whose entropy exceeds the stop;
* :meth:`Drafter.rewind` keeps what the high gear accepted: the cache is
  trimmed to the context before the last emitted token, and the emitted
  tokens it has not consumed become pending.

The paths (:data:`DRAFTER_PATHS`):

``host``
    :class:`HostDrafter`: greedy drafts from the numpy decode step around the
    C GEMV (:class:`~gearbx_mlx.speculative.host.HostForward`) on a host KV
    cache, with no MLX graph and no sync. It applies on the CPU to mlx-lm
    llama and qwen2 models with the packed kernels (``DraftModel.host``).
``mlx``
    :class:`TreeDrafter`: drafts drawn in MLX from the drafter's logits,
    greedy or sampled (the sampled drafts' log-probabilities go to the
    rejection-sampling rule). The logits come from the MLX module tree, or
    from the host forward when the cache is a host cache (sampling there).
``none``
    :class:`NoDrafter`: no drafts; every block is one plain high-gear step.

On a model sharded over several ranks the MLX tree drafts (the host step has
no collectives), and each draft is rank 0's: its token and entropy go
through the step's exchange (:class:`~gearbx_mlx.distributed.exchange.StepExchange`),
so every rank feeds back the same token and stops a block at the same draft.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..distributed.exchange import StepExchange
from ..entropy import entropy_bits, entropy_bits_np
from .draft import DraftModel
from .host import HostKVCache

#: The draft paths, fastest first where they apply.
DRAFTER_PATHS = ("host", "mlx", "none")


@dataclass
class DraftBlock:
    """One block's drafts (all lazy arrays; the verify evaluates them).

    Attributes:
        tokens: ``(k,)`` uint32 draft token ids, ``k <= cap``.
        entropies: ``(k,)`` float32 bits of the drafter's distribution at each draft.
        log_q: ``(k, V)`` the drafter's sampling log-probabilities (None when greedy).
        stop: ``"entropy"`` when a draft's entropy ended the block early, else None.
    """

    tokens: mx.array
    entropies: mx.array
    log_q: Optional[mx.array] = None
    stop: Optional[str] = None

    @staticmethod
    def empty() -> "DraftBlock":
        return DraftBlock(mx.array([], dtype=mx.uint32), mx.zeros((0,)))


def prefill(model: Any, cache: List[Any], tokens: mx.array, step: int,
            after_chunk: Optional[Callable[[], None]] = None) -> mx.array:
    """Feed all but the last of ``tokens`` in chunks of ``step``; return the last (as mlx-lm).
    A drafter computes no logits on the way (:meth:`~gearbx_mlx.speculative.draft.DraftModel.feed`).
    ``after_chunk``: called after each chunk (mlx-lm converts a float KV cache that reached its
    quantization start there)."""
    while tokens.size > 1:
        n = min(step, tokens.size - 1)
        if isinstance(model, DraftModel):
            model.feed(tokens[:n][None], cache)
        else:  # only the caches are evaluated: the logits' graph is never computed
            model(tokens[:n][None], cache=cache)
            if after_chunk is not None:
                after_chunk()
            mx.eval([c.state for c in cache])
        tokens = tokens[n:]
    return tokens


class Drafter(ABC):
    """A draft path: proposes tokens against its own KV cache (see the module doc).

    Args:
        draft: the drafter (:func:`~gearbx_mlx.speculative.draft.build_draft`).
        cache: its trimmable KV cache.
        entropy_stop: bits; a block ends after a draft above it (None: never).
        prefill_step: prompt tokens per prefill chunk.
    """

    path = ""

    def __init__(self, draft: Optional[DraftModel], cache: List[Any], entropy_stop: Optional[float],
                 prefill_step: int) -> None:
        self.model, self.cache = draft, cache
        self.entropy_stop, self.prefill_step = entropy_stop, prefill_step
        self.pending: List[int] = []  # emitted tokens the cache has not consumed yet

    def prefill(self, prompt: mx.array) -> None:
        """Feed the ``(P,)`` prompt but its last token, which stays pending."""
        self.pending = prefill(self.model, self.cache, prompt, self.prefill_step).tolist()

    @abstractmethod
    def draft(self, cap: int) -> DraftBlock:
        """Propose up to ``cap`` tokens after the pending ones (``cap`` may be 0).

        The cache consumes the pending tokens and every draft but the last.
        """

    def rewind(self, drafts: Sequence[int], emitted: Sequence[int]) -> None:
        """Keep the context up to the block's emitted tokens.

        Args:
            drafts: the block's ``k`` drafts (of which the cache consumed ``k - 1``).
            emitted: what the block emitted: accepted drafts, then the high
                gear's token (fewer when the consumer stopped early).
        """
        k, j = len(drafts), len(emitted)
        if k == 0:
            self.pending = self.pending + list(emitted)
            return
        state = getattr(self.model, "kairox", None)
        if state is not None:  # the sparse drafter's balancer learns from each verdict
            state.observe(k, next((n for n, (d, e) in enumerate(zip(drafts, emitted)) if d != e), min(k, j)))
        trim_prompt_cache(self.cache, max(k - j, 0))
        self.pending = list(emitted[max(min(j, k) - 1, 0):])

    def describe(self) -> Dict[str, Any]:
        """``{"path", "detail", "reason"}``: what drafts and why this path (for summaries and traces)."""
        return {"path": self.path, "detail": "", "reason": None}


class HostDrafter(Drafter):
    """Greedy drafts from the numpy host step: no MLX graph, no sync (``host`` path)."""

    path = "host"

    def draft(self, cap: int) -> DraftBlock:
        if cap == 0:
            return DraftBlock.empty()
        host, feed = self.model.host, self.pending
        tokens: List[int] = []
        ents: List[float] = []
        stop = None
        for _ in range(cap):
            for t in feed[:-1]:
                host.step(t, self.cache, logits=False)
            z = host.step(feed[-1], self.cache)
            tokens.append(int(z.argmax()))
            ents.append(entropy_bits_np(z))
            feed = tokens[-1:]
            if self.entropy_stop is not None and ents[-1] > self.entropy_stop and len(tokens) < cap:
                stop = "entropy"
                break
        return DraftBlock(mx.array(tokens, dtype=mx.uint32), mx.array(ents), None, stop)

    def describe(self) -> Dict[str, Any]:
        out = {"path": self.path, "detail": "numpy decode step around the C GEMV on a host KV cache "
               f"({self.model.kernel} {self.model.bits}-bit, no MLX graph)", "reason": None}
        return with_sparse_detail(out, self.model.sparse, "steps", "the C block-sparse kernel")


class TreeDrafter(Drafter):
    """Drafts drawn in MLX, greedy or sampled (``mlx`` path).

    Args:
        log_dist: the sampling distribution (None: greedy).
        single_token: feed the drafter one token per call (the packed
            kernels have a GEMV for one token only; on a GPU a multi-row
            attention call over a new key length is slow).
        exchange: on a sharded model, takes each draft's token and entropy
            from rank 0 (one small collective per draft).
    """

    path = "mlx"

    def __init__(self, draft: DraftModel, cache: List[Any], entropy_stop: Optional[float], prefill_step: int,
                 log_dist: Optional[Callable[[mx.array], mx.array]] = None, single_token: bool = False,
                 exchange: Optional[StepExchange] = None) -> None:
        super().__init__(draft, cache, entropy_stop, prefill_step)
        self.log_dist, self.single_token, self.exchange = log_dist, single_token, exchange

    def _logits(self, tokens: mx.array) -> mx.array:
        if self.single_token:
            for i in range(tokens.size - 1):
                self.model(tokens[i : i + 1][None], cache=self.cache)
            tokens = tokens[-1:]
        return self.model(tokens[None], cache=self.cache)[0, -1].astype(mx.float32)

    def draft(self, cap: int) -> DraftBlock:
        tokens: List[mx.array] = []
        log_qs: List[mx.array] = []
        ents: List[mx.array] = []
        stop = None
        inp = mx.array(self.pending, dtype=mx.uint32)
        for _ in range(cap):
            logits = self._logits(inp)
            if self.log_dist is None:
                d = mx.argmax(logits)
            else:
                lq = self.log_dist(logits[None])[0]
                d = mx.random.categorical(lq)
                log_qs.append(lq)
            h = entropy_bits(logits)
            if self.exchange is not None:
                d, h = self.exchange.share(d, h).values
            tokens.append(d)
            ents.append(h)
            if self.entropy_stop is not None:
                mx.eval(d, h)  # the stop decision needs the value now
                if h.item() > self.entropy_stop and len(tokens) < cap:
                    stop = "entropy"
                    break
            else:
                mx.async_eval(d)
            inp = d.reshape(1)
        if not tokens:
            return DraftBlock.empty()
        return DraftBlock(mx.stack(tokens).astype(mx.uint32), mx.stack(ents),
                          mx.stack(log_qs) if log_qs else None, stop)

    def describe(self) -> Dict[str, Any]:
        if isinstance(self.cache[0], HostKVCache):
            return {"path": self.path, "detail": "MLX draws the drafts; logits from the numpy host step",
                    "reason": "sampling (temp > 0): the host step drafts greedily only"}
        reason = self.model.host_reason
        if reason is None and self.model.host is not None:
            reason = "the KV cache given is the MLX tree's, not a host cache"
        out = {"path": self.path, "detail": f"MLX module tree, {self.model.kernel} {self.model.bits}-bit kernels",
               "reason": reason}
        sparse = self.model.sparse
        return with_sparse_detail(out, sparse, "one-token steps", f"gather {sparse['gather']}" if sparse else "")


def with_sparse_detail(out: Dict[str, Any], sparse: Optional[Dict[str, Any]], steps: str, how: str) -> Dict[str, Any]:
    """``out`` with an activation-sparse drafter's kept fraction in its detail and fields (unchanged if dense)."""
    if sparse:
        out["detail"] += (f"; activation-sparse FFNs (target sparsity {sparse['sparsity']:g}): {steps} "
                          f"keep {100 * sparse['kept_fraction']:.1f}% of down_proj's {sparse['group_size']}-neuron "
                          f"blocks ({how})")
        out["kept_fraction"] = sparse["kept_fraction"]
    return out


class NoDrafter(Drafter):
    """No drafts: each block is one plain high-gear step (``none`` path)."""

    path = "none"

    def __init__(self) -> None:
        super().__init__(None, [], None, 1)

    def prefill(self, prompt: mx.array) -> None:
        pass

    def draft(self, cap: int) -> DraftBlock:
        return DraftBlock.empty()

    def rewind(self, drafts: Sequence[int], emitted: Sequence[int]) -> None:
        pass

    def describe(self) -> Dict[str, Any]:
        return {"path": self.path, "detail": "the high gear decodes alone", "reason": None}


def make_drafter(
    draft: Optional[DraftModel],
    cache: Optional[List[Any]] = None,
    *,
    log_dist: Optional[Callable[[mx.array], mx.array]] = None,
    entropy_stop: Optional[float] = None,
    single_token: bool = False,
    prefill_step: int = 512,
    exchange: Optional[StepExchange] = None,
) -> Drafter:
    """The fastest draft path that applies (see the module doc).

    Args:
        draft: the drafter; None for no drafts (:class:`NoDrafter`).
        cache: the drafter's trimmable KV cache (made if None: a host cache
            where the host step applies).
        log_dist: the sampling distribution (None: greedy).
        exchange: a sharded model's exchange (drafts are then rank 0's).

    Raises:
        ValueError: a cache that cannot be trimmed.
    """
    if draft is None:
        return NoDrafter()
    cache = cache if cache is not None else make_prompt_cache(draft)
    if not can_trim_prompt_cache(cache):
        kinds = sorted({type(x).__name__ for x in cache if not x.is_trimmable()})
        raise ValueError(f"speculative decoding needs a trimmable draft_cache (got {kinds})")
    if log_dist is None and draft.host is not None and isinstance(cache[0], HostKVCache):
        return HostDrafter(draft, cache, entropy_stop, prefill_step)
    return TreeDrafter(draft, cache, entropy_stop, prefill_step, log_dist, single_token, exchange)


__all__ = ["DRAFTER_PATHS", "DraftBlock", "Drafter", "HostDrafter", "NoDrafter", "TreeDrafter", "make_drafter",
           "prefill", "with_sparse_detail"]
