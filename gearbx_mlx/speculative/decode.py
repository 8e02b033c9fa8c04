"""Entropy-gated self-speculative decoding: the low gear drafts, the high gear verifies.

Each block, the drafter (:mod:`gearbx_mlx.speculative.draft`: the same model with its
managed layers quantized, its own KV cache) proposes up to ``max_draft``
tokens one by one; the high gear scores them all in one forward pass; the
prefix it agrees with is kept, the first rejected draft is replaced by the
high gear's token, and when all are accepted the high gear's next token comes
free (the bonus). Both KV caches are trimmed back with mlx-lm's
``trim_prompt_cache``. The output is exactly the high gear's: token for token
when greedy, in distribution when sampling (:mod:`gearbx_mlx.speculative.acceptance`).
One floating-point caveat: a verify multiplies k+1 rows at once, which may
round differently from one-row steps, so an exact near-tie of the top two
logits could flip (none seen on the default model over the tests' prompts).

Entropy gating (GEARBX §3 where it pays): a block ends early after a draft
whose entropy (float32, :func:`~gearbx_mlx.entropy.entropy_bits`) exceeds
``draft_entropy_stop`` (the draft is likely rejected, and every later draft
of the block with it), and is capped at ``hard_max_draft`` while the monitor,
fed the high gear's entropies of the emitted tokens, predicts a hard stretch
(§3.5 look-ahead above the high threshold). Both are calibrated in
:mod:`gearbx_mlx.speculative.calibration`.

Why not mlx-lm's ``speculative_generate_step``: fixed block length, no
per-step hook, and for ``temp > 0`` it accepts a draft only if it equals an
independent sample of the high gear (exact, but acceptance ``sum p·q``
instead of ``sum min(p, q)``). Its cache helpers, sampling filters, stream
and rewind rule are reused.

How a block is drafted is a strategy (:mod:`gearbx_mlx.speculative.drafter`);
the block loop here is the same for all. On the CPU with the packed kernels
the greedy drafter of a llama model runs its decode steps through
:class:`~gearbx_mlx.speculative.host.HostForward` (numpy around the C GEMV,
on a host KV cache) without an MLX graph or sync: on the default model a
draft step went from 24 ms (an ``mx.eval`` per packed linear) to 5 ms, c
from 0.38 to 0.08 of a high step. Elsewhere it drafts through the MLX tree.
Whether drafting can pay at all is measured before decoding
(:mod:`gearbx_mlx.speculative.plan`).

On a model sharded over several ranks every choice that steers this loop is
rank 0's on every rank (each draft, each block's verdict and entropies; one
small collective each, :mod:`gearbx_mlx.distributed.exchange`), so the ranks
draft, accept, stop and trim alike even where their logits differ in the last bits.

On a GPU: MLX-CUDA (0.32) hands a multi-row attention call over a key length
it has not seen to cuDNN, which builds a new execution plan each time, tens
of ms per verify block (measured on the H100, ~45-60 ms a block). Set
``MLX_CUDA_USE_CUDNN_SDPA=0`` before the first forward pass (the CLI does
unless it is set); drafts are fed one token per call there.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..config import PREFILL_STEP_SIZE, SCOPES
from ..distributed.exchange import StepExchange
from ..entropy import EntropyMonitor, MonitorStep, entropy_bits
from ..generation import GearboxResponse
from ..kvcache.option import KVSession
from .acceptance import read_verdict
from .draft import DraftModel, build_draft, check_draft_gear
from .drafter import make_drafter, prefill
from .kairox import KairoxOptions, build_kairox_draft
from .plan import MODES, SpeculativePlan
from .records import BlockRecord, SpeculativeStats, SpeculativeToken, sparse_step_stats
from .sparse import AUTO, THRESHOLDS_KEY, build_sparse_draft, calibration_tokens, check_sparsity

#: The longest draft block: the decision times a verify of every length up to the cap,
#: and with acceptance decaying geometrically along a block, far shorter ones pay best.
MAX_DRAFT = 64


@dataclass
class SpeculativeConfig:
    """Settings of speculative decoding (defaults live here, once).

    Attributes:
        draft_gear: ``"low"`` (4-bit by default) or ``"mid"`` (8-bit).
        max_draft: most tokens drafted per block (k).
        draft_entropy_stop: bits; a block ends after a draft whose entropy
            exceeds it. None: fixed-length blocks.
        hard_max_draft: block cap while the monitor predicts a hard stretch;
            None: no predictive cap. 0 means a plain high-gear step there.
        draft_scope: layers the drafter quantizes. ``"all"`` by default: with
            the attention projections alone (the router's default scope) the
            drafter costs nearly a full high-gear step and cannot pay.
            None: the gearbox's scope.
        prefill_step_size: prompt tokens per prefill chunk (as mlx-lm).
        mode: ``"auto"`` or ``"force"``: decide at the start of the run by
            measuring on the prompt (:mod:`gearbx_mlx.speculative.plan`):
            ``auto`` decodes plainly where drafting models below break-even;
            both pick fixed or gated blocks and the block length up to
            ``max_draft`` (a ``draft_entropy_stop`` given is kept). ``"plain"``:
            draft nothing, the high gear decodes alone through the same loop.
            None: draft with these settings as they are.
        plan_options: more arguments of ``plan_speculative`` (``stop``,
            ``exact_k``, ``measured``); ``{"stop": None}`` allows fixed blocks only.
        draft_sparsity: draft with the activation-sparse drafter, skipping
            this fraction of FFN neurons (in ``[0, 0.95]``); None: the dense
            drafter; ``"auto"``: the decision measures the dense drafter and
            sparse ones and drafts with the best
            (:mod:`gearbx_mlx.speculative.sparse_plan`).
        sparse_options: the sparse drafter's mechanisms (hot sets, the
            next-layer predictor, the balancer:
            :class:`~gearbx_mlx.speculative.kairox.KairoxOptions`); None: its defaults.
    """

    draft_gear: str = "low"
    max_draft: int = 4
    draft_entropy_stop: Optional[float] = None
    hard_max_draft: Optional[int] = None
    draft_scope: Optional[str] = "all"
    prefill_step_size: int = PREFILL_STEP_SIZE
    mode: Optional[str] = None
    draft_sparsity: Union[float, str, None] = None
    sparse_options: Optional[KairoxOptions] = None
    plan_options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_draft_gear(self.draft_gear)
        if self.mode not in (None, "plain", *MODES):
            raise ValueError(f"mode must be one of {(None, 'plain', *MODES)}, got {self.mode!r}")
        if not isinstance(self.max_draft, int) or isinstance(self.max_draft, bool) \
                or not 1 <= self.max_draft <= MAX_DRAFT:
            raise ValueError(f"max_draft must be an integer from 1 to {MAX_DRAFT}, got {self.max_draft!r}")
        s = self.draft_entropy_stop
        if s is not None and (not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0):
            raise ValueError(f"draft_entropy_stop must be a finite number of bits >= 0 or None, got {s!r}")
        h = self.hard_max_draft
        if h is not None and (not isinstance(h, int) or not 0 <= h <= self.max_draft):
            raise ValueError(f"hard_max_draft must be an integer in [0, max_draft={self.max_draft}] or None, got {h!r}")
        if self.draft_scope is not None and self.draft_scope not in SCOPES:
            raise ValueError(f"draft_scope must be one of {SCOPES} or None, got {self.draft_scope!r}")
        if self.prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")
        if self.draft_sparsity != AUTO:
            check_sparsity(self.draft_sparsity)
        elif self.mode not in MODES:
            raise ValueError(f"draft_sparsity={AUTO!r} is chosen by the start-of-run decision: mode must be one of "
                             f"{MODES}, got {self.mode!r}")
        if isinstance(self.sparse_options, dict):  # a config read back from JSON
            self.sparse_options = KairoxOptions(**self.sparse_options)
        if self.sparse_options is not None and not isinstance(self.sparse_options, KairoxOptions):
            raise ValueError(f"sparse_options must be a KairoxOptions or None, got {self.sparse_options!r}")

    @property
    def gated(self) -> bool:
        return self.draft_entropy_stop is not None or self.hard_max_draft is not None


def block_cap(config: SpeculativeConfig, monitor: Optional[EntropyMonitor], seen: Optional[MonitorStep],
              remaining: Optional[int]) -> Tuple[int, str]:
    """How many tokens the next block may draft, and the stop it ends by at that cap.

    ``remaining``: tokens left to generate (None: no limit); the verify adds one.
    """
    cap, stop = config.max_draft, "max"
    if config.hard_max_draft is not None and seen is not None and seen.predicted >= monitor.high:
        cap, stop = config.hard_max_draft, "predicted"
    if remaining is not None and remaining - 1 < cap:
        cap, stop = remaining - 1, "limit"
    return cap, stop


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft: Optional[DraftModel],
    config: Optional[SpeculativeConfig] = None,
    *,
    max_tokens: int = 256,
    log_dist: Optional[Callable[[mx.array], mx.array]] = None,
    monitor: Optional[EntropyMonitor] = None,
    prompt_cache: Optional[List[Any]] = None,
    draft_cache: Optional[List[Any]] = None,
    stats: Optional[SpeculativeStats] = None,
    single_token_drafts: bool = False,
    exchange: Optional[StepExchange] = None,
    kv: Optional[KVSession] = None,
) -> Generator[SpeculativeToken, None, None]:
    """Yield the generated tokens of speculative decoding, one :class:`SpeculativeToken` each.

    Each block the drafter (:func:`~gearbx_mlx.speculative.drafter.make_drafter`
    picks its path) proposes up to the block cap; the high gear scores its
    pending token and the drafts in one pass; the accepted prefix and one
    token of the high gear's are emitted, and both caches keep just those.

    Args:
        prompt: ``(P,)`` token ids, ``P >= 1``.
        model: the high gear (the loaded model, unmodified).
        draft: from :func:`gearbx_mlx.speculative.draft.build_draft`; None
            decodes with the high gear alone (blocks of no draft).
        max_tokens: tokens to generate (-1: no limit).
        log_dist: the sampling distribution (:func:`make_log_dist`); None: greedy.
        monitor: fed the high gear's entropy of each emitted token; it drives
            ``hard_max_draft``. A fresh one per call is the caller's job.
        prompt_cache, draft_cache: trimmable KV caches (made if None). On exit
            (also when the consumer stops early) ``prompt_cache`` holds the
            prompt and every generated token but the last, like mlx-lm's.
        stats: filled with the blocks and the draft path (``stats.drafter``).
        single_token_drafts: feed the drafter one token per call (the packed
            kernels have a GEMV for one token only).
        exchange: a sharded model's exchange: every draft and every block's
            verdict are then rank 0's (see the module doc).
        kv: the quantized KV caches' session; both caches are converted
            when they reach its ``quantized_kv_start``, as mlx-lm's loop does.
    """
    config = config or SpeculativeConfig()
    stats = stats if stats is not None else SpeculativeStats()
    if prompt.size < 1:
        raise ValueError("the prompt has no tokens")
    if draft is None:
        # Nothing drafts: mlx-lm's own pipelined loop, so that a plain decision
        # decodes as fast as plain mlx-lm (this loop syncs every block).
        yield from plain_generate_step(prompt, model, config, max_tokens=max_tokens, log_dist=log_dist,
                                       monitor=monitor, prompt_cache=prompt_cache, stats=stats, exchange=exchange)
        return
    if config.hard_max_draft is not None and monitor is None:
        raise ValueError("hard_max_draft needs a monitor (the high gear's entropy history)")
    hcache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    if not can_trim_prompt_cache(hcache):
        kinds = sorted({type(x).__name__ for x in hcache if not x.is_trimmable()})
        raise ValueError(f"speculative decoding needs a trimmable prompt_cache (got {kinds})")
    drafter = make_drafter(draft, draft_cache, log_dist=log_dist, entropy_stop=config.draft_entropy_stop,
                           single_token=single_token_drafts, prefill_step=config.prefill_step_size,
                           exchange=exchange)
    stats.drafter = drafter.describe()
    loop = _BlockLoop(model, hcache, drafter, draft.gear, config, stats, log_dist=log_dist, monitor=monitor,
                      exchange=exchange, kv=kv)
    yield from loop.run(prompt.astype(mx.uint32), max_tokens)


class _BlockLoop:
    """The state of one speculative stream: both caches, the drafter, the counters."""

    def __init__(self, model: nn.Module, hcache: List[Any], drafter: Any, draft_gear: str,
                 config: SpeculativeConfig, stats: SpeculativeStats, **hooks: Any) -> None:
        self.model, self.hcache, self.drafter, self.draft_gear = model, hcache, drafter, draft_gear
        self.config, self.stats = config, stats
        self.log_dist, self.monitor = hooks.get("log_dist"), hooks.get("monitor")
        self.exchange, self.kv = hooks.get("exchange"), hooks.get("kv")
        self.before = self.exchange.count if self.exchange is not None else 0
        self.ntoks, self.seen = 0, None  # seen: the monitor's last step

    def run(self, prompt: mx.array, max_tokens: int) -> Generator[SpeculativeToken, None, None]:
        with mx.stream(generation_stream):
            due = (lambda: self.kv.quantize_due(self.hcache)) if self.kv is not None else None
            y = prefill(self.model, self.hcache, prompt, self.config.prefill_step_size, after_chunk=due)
            self.drafter.prefill(prompt)
            while max_tokens < 0 or self.ntoks < max_tokens:
                if self.kv is not None:
                    self.kv.quantize_due(self.hcache)
                    self.kv.quantize_due(self.drafter.cache)
                tok = yield from self._block(y, max_tokens)
                y = mx.array([tok], dtype=mx.uint32)

    def _float_positions_left(self) -> Optional[int]:
        """Positions the high gear's float KV cache takes before its quantization start (None: no such
        cache). mlx-lm converts the cache after the step that reaches the start, so the positions
        after it are read quantized; a block that crossed the start would read them in float."""
        if self.kv is None or not self.hcache or not hasattr(self.hcache[0], "to_quantized"):
            return None
        left = self.kv.config.quantized_kv_start - self.hcache[0].offset
        return left if left > 0 else None

    def _block(self, y: mx.array, max_tokens: int) -> Generator[SpeculativeToken, None, int]:
        """Draft, verify and emit one block; returns the high gear's token that ends it."""
        stats, exchange = self.stats, self.exchange
        tic = time.perf_counter()
        cap, stop = block_cap(self.config, self.monitor, self.seen,
                              max_tokens - self.ntoks if max_tokens >= 0 else None)
        left = self._float_positions_left()
        if left is not None and left - 1 < cap:
            cap, stop = left - 1, "limit"
        block = self.drafter.draft(cap)
        stop, k = block.stop or stop, block.tokens.size
        logits = self.model(mx.concatenate([y, block.tokens])[None], cache=self.hcache)[0, -(k + 1):]
        logits = logits.astype(mx.float32)
        n, tok, hh = read_verdict(logits, block.tokens, block.log_q, self.log_dist, exchange,
                                  also=(block.tokens, block.entropies))
        stats.exchanges = exchange.count - self.before if exchange is not None else 0
        drafts, dh = block.tokens.tolist(), block.entropies.tolist()
        emitted = drafts[:n] + [tok]
        sparse = sparse_step_stats(self.drafter.model) if k else None
        stats.blocks.append(BlockRecord(k, n, stop, time.perf_counter() - tic))
        j = 0
        try:
            for j, t in enumerate(emitted, 1):
                self.seen = seen = self.monitor.push(hh[j - 1]) if self.monitor is not None else None
                self.ntoks += 1
                stats.tokens += 1
                yield SpeculativeToken(
                    token=t, index=self.ntoks - 1, block=len(stats.blocks) - 1, drafted=k, accepted=j <= n,
                    gear=self.draft_gear if j <= n else "high", entropy=hh[j - 1],
                    draft_entropy=dh[j - 1] if j <= k else math.nan,
                    smoothed=seen.smoothed if seen else math.nan, predicted=seen.predicted if seen else math.nan,
                    stop=stop, logprobs=logits[j - 1] - mx.logsumexp(logits[j - 1]), sparse=sparse,
                )
                if self.ntoks == max_tokens:
                    break
        finally:
            # Keep what precedes the last emitted token (the high cache took y + k drafts).
            trim_prompt_cache(self.hcache, k + 1 - j)
            self.drafter.rewind(drafts, emitted[:j])
        return tok


def plain_generate_step(
    prompt: mx.array,
    model: nn.Module,
    config: SpeculativeConfig,
    *,
    max_tokens: int = 256,
    log_dist: Optional[Callable[[mx.array], mx.array]] = None,
    monitor: Optional[EntropyMonitor] = None,
    prompt_cache: Optional[List[Any]] = None,
    stats: Optional[SpeculativeStats] = None,
    exchange: Optional[StepExchange] = None,
) -> Generator[SpeculativeToken, None, None]:
    """:func:`speculative_generate_step` with no drafter: the high gear alone, in mlx-lm's ``generate_step``.

    mlx-lm builds and queues step ``n + 1`` before it hands out token ``n``;
    the token's entropy is computed in the same queued graph (the sampler
    schedules it with the token), so reading it waits for nothing more. The
    logits are cast to float32 first, as the drafting loop scores them, so the
    tokens are the ones a verify would choose. Each token is a block of no
    draft in ``stats``. ``exchange``: a sharded model's; each step's token and
    entropy are then rank 0's on every rank (one collective, in the step's graph).
    """
    stats = stats if stats is not None else SpeculativeStats()
    exchanges_before = exchange.count if exchange is not None else 0
    stats.drafter = make_drafter(None).describe()
    pending: List[mx.array] = []

    def sampler(logprobs: mx.array) -> mx.array:
        tok = mx.argmax(logprobs, axis=-1) if log_dist is None else mx.random.categorical(log_dist(logprobs))
        h = entropy_bits(logprobs)
        if exchange is not None:
            tok, h = exchange.share(tok, h).values
        mx.async_eval(tok, h)  # with this step's graph, not after the next one
        pending.append(h)
        return tok

    steps = generate_step(prompt.astype(mx.uint32), model, max_tokens=max_tokens, sampler=sampler,
                          logits_processors=[lambda _, logits: logits.astype(mx.float32)],
                          prompt_cache=prompt_cache, prefill_step_size=config.prefill_step_size)
    tic = time.perf_counter()
    try:
        for n, (tok, logprobs) in enumerate(steps):
            h = float(pending.pop(0).item())
            seen = monitor.push(h) if monitor is not None else None
            now = time.perf_counter()
            stats.blocks.append(BlockRecord(0, 0, "max", now - tic))
            tic = now
            stats.tokens += 1
            stats.exchanges = exchange.count - exchanges_before if exchange is not None else 0
            yield SpeculativeToken(
                token=int(tok), index=n, block=n, drafted=0, accepted=False, gear="high", entropy=h,
                draft_entropy=math.nan, smoothed=seen.smoothed if seen else math.nan,
                predicted=seen.predicted if seen else math.nan, stop="max", logprobs=logprobs,
            )
    finally:
        steps.close()


# -- the drafter of a gearbox ------------------------------------------------------------

#: The response of speculative decoding is the pipeline's one response type.
SpeculativeResponse = GearboxResponse

_DRAFTS: "weakref.WeakKeyDictionary[Any, Dict[Tuple, DraftModel]]" = weakref.WeakKeyDictionary()


def get_draft(model: nn.Module, gearbox: Any, gear: str, scope: Optional[str],
              sparsity: Optional[float] = None, tokenizer: Any = None,
              options: Optional[KairoxOptions] = None) -> DraftModel:
    """The drafter of ``model`` in ``gear``, built once per gearbox and reused.

    ``sparsity``: the activation-sparse drafter at that target
    (:mod:`gearbx_mlx.speculative.sparse`), its kept fractions measured on the
    evaluation corpus's opening through ``tokenizer``, with the mechanisms of
    ``options`` (:mod:`gearbx_mlx.speculative.kairox`; None: the defaults);
    None: the dense drafter. Where the gearbox's calibration holds the sparse
    drafter's thresholds (``--calibrate --speculative --draft-sparsity``), the
    kept fractions are solved from them instead.
    """
    per_box = _DRAFTS.setdefault(gearbox, {})
    key = (gear, scope or gearbox.config.scope)
    if key not in per_box:
        gearbox.manager.shift("high")
        per_box[key] = build_draft(model, gearbox, gear, scope)
    if sparsity is None:
        return per_box[key]
    if tokenizer is None:
        raise ValueError("a sparse drafter needs the tokenizer: its kept fractions are measured on text")
    options = options or KairoxOptions()
    skey = (*key, sparsity, options)
    if skey not in per_box:
        tokens = calibration_tokens(tokenizer)
        cal = getattr(gearbox, "calibration", None)
        saved = cal.extra.get(THRESHOLDS_KEY) if cal is not None else None
        per_box[skey] = (build_kairox_draft(per_box[key], sparsity, tokens, options, saved) if options.active
                         else build_sparse_draft(per_box[key], sparsity, tokens, thresholds=saved))
    return per_box[skey]


def single_token_drafts(config: Any) -> bool:
    """Feed the drafter one token per call? Yes for the packed kernels (a GEMV
    for one token only) and on a GPU, where MLX-CUDA gives a multi-row
    attention call over a new key length to cuDNN, which builds a new
    execution plan (tens of ms) for every new shape; one row takes MLX's own
    vector kernel."""
    return config.kernel == "packed" or mx.default_device() == mx.gpu


def apply_plan(config: SpeculativeConfig, plan: SpeculativePlan) -> Tuple[bool, SpeculativeConfig]:
    """``(plain, config)`` of a run that follows ``plan``: its block cap and stop where it drafts."""
    if not plan.speculate:
        return True, dataclasses.replace(config, mode=plan.mode)
    hard = config.hard_max_draft if config.hard_max_draft is None else min(config.hard_max_draft, plan.best_k)
    return False, dataclasses.replace(config, max_draft=plan.best_k, draft_entropy_stop=plan.stop_bits,
                                      hard_max_draft=hard, mode=plan.mode)
