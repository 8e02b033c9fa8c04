"""The one generation pipeline: one set-up, one token loop per mode, one response.

``stream_generate`` is the entry of every caller (the CLI, the Python API, the
distributed path, the server), as mlx-lm's ``stream_generate`` is for its own.
:func:`prepare` does the set-up once for every mode (checks, the prompt's ids,
sampling, the KV cache, the speculative decision, seeding, the ranks'
agreement) and returns a :class:`GenerationRun`; its :meth:`~GenerationRun.tokens`
then drives the mode's token loop:

* routed: mlx-lm's own loop through the routing proxy
  (:class:`~gearbx_mlx.routing.RoutedModel`), each step's entropy choosing
  the gear of a later step;
* speculative: the low gear drafts, the high gear verifies
  (:func:`~gearbx_mlx.speculative.decode.speculative_generate_step`); a plain
  decision decodes with the high gear alone through mlx-lm's loop.

Every response is a :class:`~gearbx_mlx.generation.GearboxResponse` that
carries the run's :class:`~gearbx_mlx.record.RunRecord` (header and summary).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from typing import Any, Dict, Generator, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generation_stream, stream_generate as mlx_stream_generate
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .config import PREFILL_STEP_SIZE
from .entropy import EntropyMonitor
from .gearbox import Gearbox
from .generation import (
    GearboxResponse,
    SamplingOptions,
    check_generation_options,
    check_prompt_ids,
    check_ranks_agree,
    collect_text,
    encode_prompt,
)
from .kvcache.option import KVOptions, check_cache_list, open_kv, options_from, plain_prompt_cache, plain_summary
from .policies import Policy, as_policy
from .record import RunRecord
from .routing import RoutedModel, RoutingSession
from .speculative.acceptance import make_log_dist
from .speculative.calibration import calibrated_stop
from .speculative.decode import (
    SpeculativeConfig,
    SpeculativeStats,
    SpeculativeToken,
    apply_plan,
    get_draft,
    single_token_drafts,
    speculative_generate_step,
)
from .speculative.draft import DraftModel
from .speculative.plan import CHOOSE, MODES as PLAN_MODES, SpeculativePlan, plan_speculative, step_costs_of
from .speculative.sparse import AUTO as SPARSE_AUTO, ffn_layers
from .speculative.sparse_plan import chosen_sparsity, plan_sparsity, stepped_measurement

#: What ``speculative=`` takes as a string: a decision mode, or ``"plain"`` (draft nothing).
SPECULATIVE_MODES = (*PLAN_MODES, "plain")


def speculative_options(value: Union[None, str, SpeculativeConfig]) -> Optional[SpeculativeConfig]:
    """``speculative=`` as a :class:`SpeculativeConfig` (None: routed decoding).

    Raises:
        ValueError: a string that is not one of :data:`SPECULATIVE_MODES`.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if value not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, a SpeculativeConfig or None, got {value!r}")
    return SpeculativeConfig(mode=value)


#: mlx-lm keywords the speculative loop reads (besides those taken out before it: the sampling and
#: KV options, prefill_step_size); the unsupported ones are refused by name, any other is unknown.
SPECULATIVE_KWARGS = frozenset({"max_tokens", "prompt_cache", "sampler", "logits_processors", "max_kv_size"})


class GenerationRun:
    """A generation set up and ready to stream (see :func:`prepare`).

    Attributes:
        ids: ``(P,)`` the prompt's token ids; record: the run's :class:`RunRecord`;
        plan: the speculative decision made at set-up (None where none was made).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, gearbox: Gearbox, ids: mx.array,
                 options: Dict[str, Any]) -> None:
        self.model, self.gearbox, self.ids = model, gearbox, ids
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        self.kwargs: Dict[str, Any] = options  # mlx-lm's keywords still to pass on
        self.kv = None
        self.plan: Optional[SpeculativePlan] = None
        self.record: Optional[RunRecord] = None
        if not gearbox.busy.acquire(blocking=False):
            raise RuntimeError("this gearbox is already generating (in another thread, or a stream of this one "
                               "not finished): one model generates one sequence at a time; finish or close() "
                               "the other stream first, or load the model again for a second one")
        self._closed = False  # from here on the gearbox is this run's until close()

    # -- the token loops ------------------------------------------------------------------
    def tokens(self) -> Generator[GearboxResponse, None, None]:
        """Stream the run's responses; the model is restored when the stream ends."""
        try:
            loop = self._routed() if self.record.mode == "routed" else self._speculative()
            yield from loop
        finally:
            self.close()

    def close(self) -> None:
        """Put the model back as it was loaded, and free the gearbox for the next run (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            # mlx-lm leaves one step running on its stream when the stream stops: finish it.
            # A process that exits right after would otherwise tear MLX's allocator down while
            # that stream's thread still frees the step's buffers (a crash at exit, now and
            # then); on a sharded model no rank may leave, or reach its next collective, while
            # another still waits in that step's.
            mx.synchronize(generation_stream)
            self.gearbox.manager.shift("high", record=False)  # outside a stream the model is the loaded one
        finally:
            try:
                if self.kv is not None:
                    self.kv.restore()
            finally:
                self.gearbox.busy.release()

    def __del__(self) -> None:
        # A run prepared and dropped unstreamed and unclosed gives the model back when it is
        # collected (at once in CPython), not at the interpreter's exit, when MLX may be gone.
        if not getattr(self, "_closed", True) and not sys.is_finalizing():
            self.close()

    def _routed(self) -> Iterator[GearboxResponse]:
        session = self.record.session
        kwargs = dict(self.kwargs)
        theirs = list(kwargs.pop("logits_processors", None) or [])
        # the entropy of the model's own logits first; the NaN guard again on what is sampled
        processors = [session.processor] + theirs + ([session.guard_after] if theirs else [])
        last = time.perf_counter()
        stream = mlx_stream_generate(RoutedModel(self.model, session), self.tokenizer, self.ids,
                                     logits_processors=processors, **kwargs)
        for n, resp in enumerate(stream):
            if n == 0:  # mlx-lm's prompt timing ends and its generation timing starts here
                session.quantize_marks["first_token"] = session.quantize_seconds
            session.commit(upto=n)
            rec = session.records[n]
            now = time.perf_counter()
            yield GearboxResponse(
                **{k: getattr(resp, k) for k in GenerationResponse.__dataclass_fields__},
                entropy=rec.entropy, smoothed_entropy=rec.smoothed, predicted_entropy=rec.predicted,
                gear=rec.gear, next_gear=rec.next_gear, shifted=rec.shifted, shift_seconds=rec.shift_seconds,
                step_seconds=now - last, index=n, nonfinite=rec.nonfinite, rank_gears=rec.rank_gears,
                ranks_agree=rec.ranks_agree, exchange_seconds=rec.exchange_seconds, run=self.record,
            )
            last = now

    def _speculative(self) -> Iterator[GearboxResponse]:
        steps = self._speculative_steps()
        detok = self.tokenizer.detokenizer
        detok.reset()
        eos = set(self.tokenizer.eos_token_ids)
        max_tokens = self.kwargs.get("max_tokens", 256)
        tic = last = time.perf_counter()
        clock = {"prompt_tps": 0.0, "tic": tic}
        info: Optional[SpeculativeToken] = None
        try:
            for n, info in enumerate(steps):
                now = time.perf_counter()
                if n == 0:
                    # A drafted block hands its tokens out together: the first token comes
                    # with the block that made it, so generation is timed from that block's
                    # start, not from its first token (which would count the block's other
                    # tokens as free). Plain decoding's first token ends the prompt, as mlx-lm's.
                    start = now - self._first_block_seconds()
                    clock.update(prompt_tps=self.ids.size / max(start - tic, 1e-9), tic=start)
                if info.token in eos:
                    break
                detok.add_token(info.token)
                if n + 1 == max_tokens:
                    break
                yield self._spec_response(info, detok.last_segment, clock, now - last, None)
                last = now
        finally:
            steps.close()  # trims both caches to the kept tokens
        if info is None:
            return
        detok.finalize()
        reason = "stop" if info.token in eos else "length"
        yield self._spec_response(info, detok.last_segment, clock, time.perf_counter() - last, reason)

    def _drafts(self) -> bool:
        """True if the stream drafts (else it is plain decoding by the high gear)."""
        rec, cfg = self.record, self.record.config
        return not (rec.draft is None or cfg.mode == "plain" or (self.plan is not None and not self.plan.speculate))

    def _first_block_seconds(self) -> float:
        """Seconds the first drafted block took (0 for plain decoding, whose first token is the prompt's)."""
        blocks = self.record.stats.blocks
        return blocks[0].seconds if self._drafts() and blocks else 0.0

    def _speculative_steps(self) -> Iterator[SpeculativeToken]:
        rec, cfg = self.record, self.record.config
        plain = not self._drafts()
        draft_cache = None
        if self.kv is not None and not plain:
            draft_cache = self.kv.handles[1].make_cache()
        ranks = self.gearbox.ranks
        return speculative_generate_step(
            self.ids, self.model, None if plain else rec.draft, cfg, max_tokens=self.kwargs.get("max_tokens", 256),
            log_dist=self.kwargs.get("log_dist"), prompt_cache=self.kwargs.get("prompt_cache"),
            monitor=EntropyMonitor(self.gearbox.vocab_size, self.gearbox.config, self.gearbox.thresholds),
            draft_cache=draft_cache, stats=rec.stats, single_token_drafts=single_token_drafts(self.gearbox.config),
            kv=self.kv, exchange=ranks.exchange if ranks is not None else None,
        )

    def _spec_response(self, info: SpeculativeToken, text: str, clock: Dict[str, float], step: float,
                       reason: Optional[str]) -> GearboxResponse:
        self.record.note(info.gear, info.entropy)
        n = info.index + 1
        return GearboxResponse(
            text=text, token=info.token, logprobs=info.logprobs, from_draft=info.accepted,
            prompt_tokens=self.ids.size, prompt_tps=clock["prompt_tps"], generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - clock["tic"], 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=reason,
            entropy=info.entropy, draft_entropy=info.draft_entropy, smoothed_entropy=info.smoothed,
            predicted_entropy=info.predicted, gear=info.gear, accepted=info.accepted, drafted=info.drafted,
            verified_by="high", block=info.block, stop=info.stop, step_seconds=step, index=info.index,
            run=self.record, **{k: (info.sparse or {}).get(k) for k in ("kept_fraction", "hot_hit_rate")},
        )


def prepare(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, mx.array, List[int]],
    gearbox: Optional[Gearbox] = None,
    *,
    speculative: Union[None, str, SpeculativeConfig] = None,
    draft: Optional[DraftModel] = None,
    plan: Optional[SpeculativePlan] = None,
    policy: Union[None, str, Policy] = None,
    lag: Optional[int] = None,
    seed: Optional[int] = None,
    prompt_text: Optional[str] = None,
    kv_calibration: Any = None,
    sampling: Optional[SamplingOptions] = None,
    kv_options: Optional[KVOptions] = None,
    **kwargs: Any,
) -> GenerationRun:
    """Set a generation up: every check and choice before the first forward pass.

    The arguments are :func:`stream_generate`'s; ``sampling`` and
    ``kv_options`` take the options already converted (the CLI's), in place of
    mlx-lm's loose keywords (``temp``, ... and ``kv_bits``, ...). The speculative decision
    (``speculative="auto"`` or ``"force"``) is measured here, so a caller can
    show ``run.plan`` before streaming. Call ``run.tokens()`` to stream, or
    ``run.close()`` to give the model back without streaming.

    Raises:
        ValueError: an option out of range, a gearbox of another model, or a
            combination the mode does not take (named in the message).
    """
    check_generation_options(seed=seed, **kwargs)
    if kwargs.get("max_tokens", 256) == 0:
        raise ValueError("max_tokens must be positive (or -1 for no limit)")
    if gearbox is not None and not isinstance(gearbox, Gearbox):
        raise TypeError(f"gearbox must be a Gearbox (gearbx_mlx.load gives one), got {type(gearbox).__name__}: "
                        "mlx-lm's other arguments (verbose, max_tokens, ...) are keywords here")
    if kwargs.get("prompt_cache") is not None:
        check_cache_list(kwargs["prompt_cache"])  # before its offsets are read below
    ids = encode_prompt(tokenizer, prompt)
    gearbox = gearbox or Gearbox(model)
    if gearbox.model is not model:
        raise ValueError("this gearbox manages another model: pass the model it was made for")
    check_prompt_ids(ids, gearbox.vocab_size)
    gearbox.config.validate()  # a dataclass a caller may have changed since it was made
    loose_sampling, loose_kv = SamplingOptions.take(kwargs), options_from(kwargs)
    if (sampling is not None and loose_sampling is not None) or (kv_options is not None and loose_kv.active):
        raise ValueError("give the sampling (or KV) options either as an object or as keywords, not both")
    sampling = sampling or loose_sampling
    if sampling is not None and sampling.top_k >= gearbox.vocab_size:
        raise ValueError(f"top_k must be below the vocabulary size ({gearbox.vocab_size}), got {sampling.top_k} "
                         "(0 keeps every token)")
    held = kwargs.get("prompt_cache") or []  # a caller's cache carries earlier turns
    kv_options = (kv_options or loose_kv).at_prompt_end(max((getattr(c, "offset", 0) for c in held), default=0)
                                                        + ids.size)
    if kv_calibration is None and gearbox.calibration is not None:
        kv_calibration = gearbox.calibration.kv
    spec = speculative_options(speculative)
    run = GenerationRun(model, tokenizer, gearbox, ids, kwargs)
    try:
        if spec is None:
            if prompt_text is None:
                prompt_text = prompt if isinstance(prompt, str) else run.tokenizer.decode(ids.tolist())
            _set_up_routed(run, sampling, kv_options, kv_calibration, policy, lag, seed, prompt_text)
        else:
            _set_up_speculative(run, spec, sampling, kv_options, kv_calibration, draft, plan, seed)
    except BaseException:
        run.close()  # every refusal leaves the model, and the gearbox, as they were
        raise
    return run


def _set_up_routed(run: GenerationRun, sampling: Optional[SamplingOptions], kv_options: KVOptions,
                   kv_calibration: Any, policy: Union[None, str, Policy], lag: Optional[int], seed: Optional[int],
                   prompt_text: str) -> None:
    kwargs, gearbox = run.kwargs, run.gearbox
    policy = as_policy(policy)  # checked before the KV option changes any module
    kwargs.setdefault("prefill_step_size", PREFILL_STEP_SIZE)
    if sampling is not None:
        if "sampler" in kwargs:
            raise ValueError("give either sampler= or temp/top_p/min_p/top_k, not both")
        kwargs["sampler"] = sampling.sampler()
    if kv_options.active and kwargs.get("max_kv_size") is not None:
        raise ValueError("max_kv_size (--max-kv-size, a rotating window cache) cannot be combined with kv_bits "
                         "(--kv-bits): neither the rotated cache nor mlx-lm's window cache quantizes a window; "
                         "drop one")
    if kwargs.get("max_kv_size") is not None and kwargs.get("prompt_cache") is None and hasattr(run.model, "make_cache"):
        # mlx-lm's make_prompt_cache calls the model's own make_cache, which takes no window (llama's
        # among them): where that makes plain growing caches, the window is made here as mlx-lm would
        own = run.model.make_cache()
        if all(type(c) is KVCache for c in own):
            kwargs["prompt_cache"] = [RotatingKVCache(max_size=kwargs["max_kv_size"], keep=4) for _ in own]
        else:
            kind = type(run.model).__module__.rsplit(".", 1)[-1]
            warnings.warn(f"max_kv_size is not applied: this model ({kind}) makes its own KV caches (windows of "
                          "its own on some layers), and mlx-lm keeps them", stacklevel=3)
    run.kv = open_kv(run.model, kv_options, kv_calibration)  # every check of the KV option runs here
    try:
        kv_summary = _use_kv(run, kv_options)
        if seed is not None:
            mx.random.seed(seed)
        session = RoutingSession(gearbox, policy, lag)
        session.kv_cache = kv_summary
        run.record = RunRecord(gearbox, "routed", kv_options=kv_options, kv_cache=kv_summary, session=session)
        if gearbox.ranks is not None:
            check_ranks_agree(gearbox, run.ids, policy=session.policy.name, lag=session.lag, seed=seed,
                              **(sampling.as_dict() if sampling else {}),
                              **{k: v for k, v in kwargs.items()
                                 if v is None or isinstance(v, (bool, int, float, str))})
        kwargs["sampler"] = session.sampler(kwargs.get("sampler") or greedy_sampler)
        session.start(prompt_text)
    except BaseException:
        run.close()
        raise
    session.quantize_marks["start"] = session.quantize_seconds


def _use_kv(run: GenerationRun, options: KVOptions) -> Dict[str, Any]:
    """Put the KV option into mlx-lm's keyword arguments; the cache's summary."""
    kv, kwargs = run.kv, run.kwargs
    if kv is None:  # mlx-lm's own float or quantized cache
        if kwargs.get("prompt_cache") is not None:
            kwargs["prompt_cache"] = plain_prompt_cache(run.model, kwargs["prompt_cache"], kwargs.get("max_kv_size"))
        if options.active:
            kwargs.update(kv_bits=options.bits, kv_group_size=options.plain_group_size,
                          quantized_kv_start=options.start)
        return plain_summary(run.model, options)
    kwargs["prompt_cache"] = kv.prompt_cache(kwargs.get("prompt_cache"))
    if options.start > 0:
        # The caches start in float; mlx-lm converts them at the start
        # (each to its own layer's bits: the arguments it passes are ignored).
        kwargs.update(kv_bits=options.bits, kv_group_size=kv.config.group_size,
                      quantized_kv_start=options.start)
    return kv.summary()


def _set_up_speculative(run: GenerationRun, spec: SpeculativeConfig, sampling: Optional[SamplingOptions],
                        kv_options: KVOptions, kv_calibration: Any, draft: Optional[DraftModel],
                        plan: Optional[SpeculativePlan], seed: Optional[int]) -> None:
    model, gearbox, kwargs = run.model, run.gearbox, run.kwargs
    if kwargs.get("prefill_step_size") is not None:
        spec = dataclasses.replace(spec, prefill_step_size=kwargs.pop("prefill_step_size"))
    unsupported = sorted(k for k in ("sampler", "logits_processors", "max_kv_size") if kwargs.get(k) is not None)
    if unsupported:
        raise ValueError(f"speculative decoding does not take {', '.join(unsupported)}: it samples with "
                         "temp/top_p/min_p/top_k and needs trimmable caches that grow without a window")
    unknown = sorted(k for k, v in kwargs.items() if k not in SPECULATIVE_KWARGS and v is not None)
    if unknown:  # mlx-lm's loop refuses a keyword it does not know; so does this one, rather than drop it
        raise TypeError(f"speculative decoding got unexpected keyword argument(s) {', '.join(unknown)}: it takes "
                        "max_tokens, prompt_cache, prefill_step_size, temp/top_p/min_p/top_k and the KV options")
    sampling = sampling or SamplingOptions()
    kwargs["log_dist"] = make_log_dist(**sampling.as_dict())
    if spec.draft_sparsity is not None:
        ffn_layers(model)  # a model the sparse drafter cannot run: refused before any drafter is built
    gearbox.manager.shift("high")  # the verifier is the loaded model itself
    if spec.draft_sparsity == SPARSE_AUTO:
        spec, draft, plan = _auto_sparsity(run, spec, draft, plan, sampling.greedy)
    if draft is None and (spec.mode != "plain" or plan is not None):
        draft = get_draft(model, gearbox, spec.draft_gear, spec.draft_scope, spec.draft_sparsity, run.tokenizer,
                          spec.sparse_options)
    elif draft is not None and draft.gear != spec.draft_gear:
        raise ValueError(f"the draft given is in the {draft.gear} gear, config says {spec.draft_gear}")
    run.kv = open_kv(model, kv_options, kv_calibration, draft=None if draft is None else draft.module,
                     plain_too=True)
    try:
        if run.kv is not None:
            kwargs["prompt_cache"] = run.kv.prompt_cache(kwargs.get("prompt_cache"))
        elif kwargs.get("prompt_cache") is not None:
            kwargs["prompt_cache"] = plain_prompt_cache(model, kwargs["prompt_cache"])
        if plan is None and spec.mode in PLAN_MODES:
            plan = _decide(run, spec, draft, sampling.greedy)
        if plan is not None:
            _, spec = apply_plan(spec, plan)
        run.plan = plan
        if gearbox.ranks is not None:
            check_ranks_agree(gearbox, run.ids, speculative=dataclasses.asdict(spec), seed=seed,
                              max_tokens=kwargs.get("max_tokens", 256), **sampling.as_dict())
        if seed is not None:  # after the plan: its measurement must not move the sampling stream
            mx.random.seed(seed)
        kv_cache = run.kv.summary() if run.kv is not None else plain_summary(model, KVOptions())
        if run.kv is not None:
            kv_cache = {**kv_cache, "caches": "high gear and drafter" if draft is not None else "high gear"}
        stats = SpeculativeStats(plan=plan.to_dict() if plan is not None else None,
                                 ranks=gearbox.ranks.size if gearbox.ranks is not None else 1, kv_cache=kv_cache)
        run.record = RunRecord(gearbox, "speculative", kv_options=kv_options, kv_cache=kv_cache, stats=stats,
                               draft=draft, plan=plan, config=spec)
    except BaseException:
        run.close()
        raise


def _auto_sparsity(run: GenerationRun, spec: SpeculativeConfig, draft: Optional[DraftModel],
                   plan: Optional[SpeculativePlan], greedy: bool) -> Tuple[SpeculativeConfig, Optional[DraftModel],
                                                                           Optional[SpeculativePlan]]:
    """``draft_sparsity="auto"``: the drafter given, a reused decision's choice, or the decision between the
    dense and sparse drafters made here (:mod:`gearbx_mlx.speculative.sparse_plan`)."""
    if draft is not None:
        return dataclasses.replace(spec, draft_sparsity=(draft.sparse or {}).get("sparsity")), draft, plan
    if plan is None:
        stop = CHOOSE if spec.draft_entropy_stop is None else spec.draft_entropy_stop
        _, draft, plan = plan_sparsity(run.model, run.gearbox, run.tokenizer, spec, run.ids.tolist(), greedy,
                                       **{"stop": stop, **spec.plan_options})
        if run.gearbox.ranks is not None:  # rank 0's choice holds for all
            plan, draft = SpeculativePlan(**run.gearbox.ranks.first(plan.to_dict())), None
    return dataclasses.replace(spec, draft_sparsity=chosen_sparsity(plan)), draft, plan


def _decide(run: GenerationRun, spec: SpeculativeConfig, draft: DraftModel, greedy: bool) -> SpeculativePlan:
    """The start-of-run decision: measure a draft step and the verifies on the prompt.

    A sparse drafter's α comes from its own one-token steps on the prompt (its prefill is dense, and a saved
    calibration measured the dense drafter)."""
    gearbox = run.gearbox
    ids = run.ids.tolist()
    own = ({"calibration": None, "measured": stepped_measurement(run.model, draft, ids, spec.max_draft)}
           if draft.sparse else {"calibration": calibrated_stop(gearbox, spec.draft_gear)})
    if run.kv is not None:  # time the caches the run makes: quantized attention, the MLX draft path
        own["caches"] = (run.kv.handles[0].make_cache, run.kv.handles[1].make_cache)
    # A gearbox's later decisions reuse its step costs for a while (an application's calls): α is the prompt's.
    own.update(step_costs=step_costs_of(gearbox), costs_context=None if run.kv is None else tuple(
        h.tag for h in run.kv.handles))
    plan = plan_speculative(
        run.model, draft, ids, spec.max_draft, greedy=greedy, mode=spec.mode,
        **{**own, "stop": CHOOSE if spec.draft_entropy_stop is None else spec.draft_entropy_stop,
           **spec.plan_options},
    )
    if gearbox.ranks is not None:  # timings differ between ranks: rank 0's decision to draft holds for all
        plan = SpeculativePlan(**gearbox.ranks.first(plan.to_dict()))
    return plan


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, mx.array, List[int]],
    gearbox: Optional[Gearbox] = None,
    **kwargs: Any,
) -> Generator[GearboxResponse, None, None]:
    """Stream tokens like ``mlx_lm.stream_generate``: routed by the gearbox, or speculatively.

    Args:
        prompt: text (encoded as is, like mlx-lm) or token ids (a list, or a 1-D MLX or NumPy array).
        gearbox: from :func:`gearbx_mlx.load`; a default one is made if None.
        kwargs: mlx-lm's (``max_tokens``, ``temp``, ``top_p``, ``min_p``,
            ``top_k``, ``min_tokens_to_keep``, ``sampler``, ``logits_processors``,
            ``prompt_cache``, ``max_kv_size``, ``prefill_step_size``,
            ``kv_bits``, ``kv_group_size``, ``quantized_kv_start``) and the package's:

            * ``speculative``: None (routed decoding), ``"auto"`` (measure on
              the prompt and draft only where it models faster), ``"force"``,
              ``"plain"`` (the high gear alone through the same loop), or a
              :class:`~gearbx_mlx.speculative.decode.SpeculativeConfig`. The
              output is then exactly the high gear's (token for token when
              greedy, in distribution when sampling).
            * ``draft``, ``plan``: a prebuilt drafter / decision (speculative).
            * ``policy``, ``lag``: the routing policy (default: the config's;
              a gear's name: that gear throughout) and 0 or 1 (routed).
            * ``seed``: seeds MLX's random generator before sampling.
            * ``prompt_text``: what the cold-start classifier reads (routed;
              default: the prompt, decoded if given as ids).
            * ``kv_rotation`` (``"auto"``, ``"srht"``, ``"srft"`` or ``"none"``
              for mlx-lm's own cache) and ``kv_calibration`` (statistics for
              the rotated cache; default: the gearbox calibration's, else from
              the weights): :mod:`gearbx_mlx.kvcache.option`. The model is
              restored when the stream ends.

    Yields:
        :class:`~gearbx_mlx.generation.GearboxResponse`, one per generated
        token; the last one has ``finish_reason`` set; ``response.run`` is
        the run's record (header and summary).
    """
    run = prepare(model, tokenizer, prompt, gearbox, **kwargs)
    yield from run.tokens()


def generate(model: nn.Module, tokenizer: Any, prompt: Union[str, mx.array, List[int]], gearbox: Optional[Gearbox] = None,
             verbose: bool = False, **kwargs: Any) -> str:
    """Generate a complete response (routed, or speculatively with ``speculative=``); with
    ``verbose``, stream it to stdout."""
    return collect_text(stream_generate(model, tokenizer, prompt, gearbox, **kwargs), verbose)


def stream_speculative_generate(model: nn.Module, tokenizer: Any, prompt: Union[str, mx.array, List[int]],
                                gearbox: Optional[Gearbox] = None, *, config: Optional[SpeculativeConfig] = None,
                                plain: bool = False, mode: Optional[str] = None,
                                **kwargs: Any) -> Generator[GearboxResponse, None, None]:
    """:func:`stream_generate` with ``speculative=``: ``config`` (its fields may also come as
    keywords: ``draft_gear``, ``max_draft``, ...), ``mode`` (``"auto"`` or ``"force"``) and
    ``plain`` (draft nothing) make the :class:`SpeculativeConfig`."""
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in SpeculativeConfig.__dataclass_fields__}
    spec = dataclasses.replace(config or SpeculativeConfig(), **fields)
    if plain or mode is not None:  # else the config's own mode stands
        spec = dataclasses.replace(spec, mode="plain" if plain and mode is None else mode)
    if "plan_options" in kwargs:
        spec = dataclasses.replace(spec, plan_options=dict(kwargs.pop("plan_options") or {}))
    return stream_generate(model, tokenizer, prompt, gearbox, speculative=spec, **kwargs)


def speculative_generate(model: nn.Module, tokenizer: Any, prompt: Union[str, mx.array, List[int]],
                         gearbox: Optional[Gearbox] = None, verbose: bool = False, **kwargs: Any) -> str:
    """The complete text of :func:`stream_speculative_generate` (the high gear's, exactly when greedy)."""
    return collect_text(stream_speculative_generate(model, tokenizer, prompt, gearbox, **kwargs), verbose)
