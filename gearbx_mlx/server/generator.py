"""mlx-lm's ``ResponseGenerator`` with the package's generation in its single-request path.

mlx-lm's generation thread takes requests from one FIFO queue. Its batched
path (``BatchGenerator``) decodes many sequences in one forward pass, but
the gears swap the managed layers of the one model for every sequence at
once: two requests in one batch would have to share each step's gear. So
batching is off (:meth:`GearResponseGenerator._is_batchable`) and requests
run one at a time, in arrival order, through ``_serve_single``, whose token
loop here calls :func:`~gearbx_mlx.server.provider.package_stream`.
"""

from __future__ import annotations

import _thread
import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from queue import Empty as QueueEmpty
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.server import CompletionRequest, GenerationContext, ResponseGenerator

from ..config import GEARS
from ..policies import make_policy
from .options import GearOptions
from .provider import GearModelProvider, RequestError, package_stream

#: Generation arguments of mlx-lm's server that speculative decoding does not take.
NOT_SPECULATIVE = ("logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty")


def not_speculative(args: Any) -> List[str]:
    """The request's fields of :data:`NOT_SPECULATIVE` that it sets: what speculative decoding
    cannot apply."""
    return [k for k in NOT_SPECULATIVE if getattr(args.logits, k)]


def plain_for_penalties(options: GearOptions, args: Any) -> GearOptions:
    """A request whose speculative mode is ``auto`` and that asks for what speculative decoding
    cannot apply (penalties, ``logit_bias``: :func:`not_speculative`) decodes plainly in the high
    gear, one of ``auto``'s own choices (its output is the same exact high gear's); ``force``
    keeps them refused."""
    if options.speculative != "auto" or not not_speculative(args):
        return options
    return dataclasses.replace(options, speculative="off", gear="high", thresholds=None)


class ServerStopping(RuntimeError):
    """The server was stopped (Ctrl-C, SIGTERM) before the request finished: its stream ends
    without ``[DONE]`` and without a finish reason, so a client cannot take it for a whole answer."""

    status = 503


@dataclass
class Response:
    """One token for the HTTP handler: mlx-lm's server ``Response`` fields plus the gearbox's.

    Attributes:
        gear: gear of the forward pass that chose the token.
        entropy: bits of the distribution the token was chosen from.
        drafted: with speculative decoding, drafts proposed in the token's block (else None).
        accepted: with speculative decoding, whether the token is an accepted draft (else None).
    """

    text: str
    token: int
    logprob: float
    finish_reason: Optional[str]
    top_tokens: Tuple[Dict[str, Any], ...]
    gear: str = "high"
    token_text: Optional[str] = None  # the token as the tokenizer spells it (top_logprobs' "token")
    entropy: float = math.nan
    drafted: Optional[int] = None
    accepted: Optional[bool] = None
    block: Optional[int] = None

    def extension(self) -> Dict[str, Any]:
        """The token's entry in the ``gearbx`` field of a choice."""
        return {"token": self.token, "gear": self.gear,
                "entropy": round(self.entropy, 6) if math.isfinite(self.entropy) else None,
                "drafted": self.drafted, "accepted": self.accepted}


@dataclass
class GearRequest(CompletionRequest):
    """mlx-lm's ``CompletionRequest`` plus the request's routing and what came back.

    ``records`` are the tokens the handler has read; ``usage`` the
    generation thread's totals (set before the stream ends); ``error`` what
    refused the request; ``check_client``, where the handler sets one, is
    called in its thread before each token is handed over and raises
    (``ConnectionResetError``) once the client has gone.
    """

    gearbx: GearOptions = field(default_factory=GearOptions)
    records: List[Response] = field(default_factory=list)
    sent: int = 0
    usage: Optional[Dict[str, Any]] = None
    error: Optional[BaseException] = None
    max_tokens_given: bool = True
    check_client: Optional[Callable[[], None]] = None

    @classmethod
    def of(cls, request: CompletionRequest, options: GearOptions) -> "GearRequest":
        return cls(**{f.name: getattr(request, f.name) for f in fields(CompletionRequest)}, gearbx=options)


def format_top_logprobs(logprobs: mx.array, n: int, tokenizer: Any) -> Tuple[Dict[str, Any], ...]:
    """The ``n`` most likely tokens as mlx-lm's server lists them (``{"id", "token", "logprob"}``)."""
    if n <= 0:
        return ()
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n].tolist()
    probs = logprobs[ids].tolist()
    return tuple({"id": i, "token": s, "logprob": g}
                 for i, s, g in zip(ids, tokenizer.convert_ids_to_tokens(ids), probs, strict=True))


def weight_bytes(records: List[Response], step_bytes: Dict[str, float], draft_gear: Optional[str]) -> int:
    """Weight bytes the decode steps read: one step of its gear per routed token; per
    speculative block, one step of the draft gear per draft and one high-gear verify."""
    if draft_gear is None:
        return int(sum(step_bytes[r.gear] for r in records))
    blocks = {r.block: r.drafted or 0 for r in records}
    return int(sum(d * step_bytes[draft_gear] + step_bytes["high"] for d in blocks.values()))


class GearResponseGenerator(ResponseGenerator):
    """mlx-lm's response generator with batching off and the package's token loop."""

    model_provider: GearModelProvider

    def _is_batchable(self, args: Any) -> bool:
        return False  # the gears are the model's: one sequence at a time (module doc)

    def _run_generate(self) -> None:
        try:
            self.model_provider.load_default()
        except Exception as e:  # noqa: BLE001  (whatever stops the load stops the server, in one line)
            self.model_provider.load_error = e
            self._generation_failed = True
            _thread.interrupt_main()  # stops the HTTP server as Ctrl-C does; main reports the error
            return
        super()._run_generate()

    def generate(self, request: CompletionRequest, generation_args: Any, progress_callback: Any = None) -> Any:
        """mlx-lm's, with each token recorded on a :class:`GearRequest` as the handler reads it."""
        try:
            ctx, tokens = super().generate(request, generation_args, progress_callback)
        except Exception as e:
            if isinstance(request, GearRequest):
                request.error = e
            raise
        if not isinstance(request, GearRequest):
            return ctx, tokens

        def recorded() -> Iterator[Response]:
            for r in tokens:
                if request.check_client is not None:
                    request.check_client()
                request.records.append(r)
                yield r

        return ctx, recorded()

    def _serve_single(self, request: Any, stream: Any) -> None:
        rqueue, request, args = request
        try:
            provider = self.model_provider
            tokenizer = provider.tokenizer
            prompt, _, _, initial_state, _ = self._tokenize(tokenizer, request, args)
            options = plain_for_penalties(request.gearbx if isinstance(request, GearRequest) else GearOptions(), args)
            self._check(prompt, args, options, getattr(request, "max_tokens_given", True))
            stop_sequences, text_sm = self._make_state_machine(provider.model_key, tokenizer, args.stop_words)
            ctx = GenerationContext(has_thinking=tokenizer.has_thinking, has_tool_calling=tokenizer.has_tool_calling,
                                    tool_parser=tokenizer.tool_parser, text_sm=text_sm,
                                    initial_state=initial_state, prompt=prompt)
            rqueue.put(ctx)
            self._stream(rqueue, request, args, options, ctx, prompt, stop_sequences.matcher())
        except Exception as e:  # noqa: BLE001  (mlx-lm's contract: the handler re-raises it)
            rqueue.put(e)

    def _check(self, prompt: List[int], args: Any, options: GearOptions, max_tokens_given: bool = True) -> None:
        """Refuse, before any forward pass, what the loaded model cannot do. A request that
        gives no ``max_tokens`` gets the server's cap, or what the context leaves after its prompt."""
        if not prompt:
            raise RequestError("the prompt has no tokens")
        vocab = self.model_provider.gearbox.vocab_size
        if args.sampling.top_k >= vocab:
            raise RequestError(f"top_k must be below the vocabulary size ({vocab}), got {args.sampling.top_k}")
        outside = [k for k in (getattr(args.logits, "logit_bias", None) or {}) if not 0 <= k < vocab]
        if outside:  # mlx-lm would index the logits past their end
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab}), got {outside[0]}")
        n = self.model_provider.context_length
        if n is not None and not max_tokens_given and len(prompt) < n:
            args.max_tokens = min(args.max_tokens, n - len(prompt))
        if n is not None and len(prompt) + args.max_tokens > n:
            raise RequestError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({args.max_tokens}) exceed the "
                               f"model's context of {n} tokens")
        if options.thresholds is not None:
            vmax = math.log2(self.model_provider.gearbox.vocab_size)
            if options.thresholds[1] > vmax:
                raise RequestError(f"gearbx.thresholds: the high threshold {options.thresholds[1]:g} is above "
                                   f"log2(vocabulary) = {vmax:.3f} bits, the largest entropy this model can have")
        if args.sampling.xtc_probability > 0:
            raise RequestError("xtc_probability is not supported by this server's sampler")
        if options.speculative != "off":
            used = not_speculative(args)
            if used:
                raise RequestError(f"{', '.join(used)} cannot be combined with speculative decoding")

    def _prompt_cache(self, prompt: List[int], options: GearOptions) -> Tuple[Optional[List[Any]], List[int]]:
        """mlx-lm's LRU prompt cache, where the KV it holds is what a fresh prefill computes:
        static high gear without speculative decoding or a quantized KV cache. Elsewhere the
        cached tokens' keys and values would come from other gears (or another cache format)."""
        cli = self.cli_args
        if options.gear != "high" or options.speculative != "off" or cli.kv_bits is not None:
            return None, prompt
        cache, rest = self.prompt_cache.fetch_nearest_cache(self.model_provider.model_key, prompt)
        if cache is None:
            return make_prompt_cache(self.model_provider.model, cli.max_kv_size), prompt
        if not rest:  # the whole prompt is cached: feed its last token again
            if not can_trim_prompt_cache(cache):
                return make_prompt_cache(self.model_provider.model, cli.max_kv_size), prompt
            trim_prompt_cache(cache, 1)
            rest = prompt[-1:]
        return cache, rest

    def _stream(self, rqueue: Any, request: Any, args: Any, options: GearOptions, ctx: GenerationContext,
                prompt: List[int], stop_matcher: Any) -> None:
        provider = self.model_provider
        gearbox, tokenizer = provider.gearbox, provider.tokenizer
        check_client = getattr(request, "check_client", None)
        if check_client is not None:  # it may have waited in the queue: gone clients are not prefilled
            check_client()
        cache, rest = self._prompt_cache(prompt, options)
        ctx.prompt_cache_count = len(prompt) - len(rest)
        spec = None if options.speculative == "off" else options.speculative
        kwargs = self._kwargs(args, options, cache, prompt, spec)
        if spec is None:
            kwargs["prompt_progress_callback"] = self._progress(rqueue, check_client)
        saved = gearbox.thresholds
        records: List[Response] = []
        last = finish = None
        stops = [w for w in (args.stop_words or []) if w]
        longest, tail = max((len(w) for w in stops), default=0), ""
        try:
            if options.thresholds is not None:
                gearbox.set_thresholds(*options.thresholds)
            for last in package_stream(provider.model, tokenizer, rest, gearbox, speculative=spec, **kwargs):
                finish = "stop" if stop_matcher.advance(last.token) else last.finish_reason
                text, told = last.text, finish
                if stops and finish is None:
                    # mlx-lm matches a stop word by its own tokens, which a word spanning tokens that the
                    # model split otherwise never meets: its text state machine then cut the word out of
                    # the text and generation ran on. The text is matched here too, and the answer ends
                    # where the stop string begins (OpenAI's rule): this token's text before it is kept,
                    # handed over as an ordinary token whose stream then ends (mlx-lm's handler drops the
                    # text of a token marked "stop", and an answer that ends unmarked ends with "stop").
                    tail = (tail + last.text)[-(longest + len(last.text)):]
                    found = [tail.find(w) for w in stops if w in tail]
                    if found:
                        finish = "stop"
                        text, told = last.text[:max(min(found) - (len(tail) - len(last.text)), 0)], None
                r = Response(text, last.token, last.logprobs[last.token].item(), told,
                             format_top_logprobs(last.logprobs, args.top_logprobs, tokenizer), gear=last.gear,
                             entropy=last.entropy, drafted=getattr(last, "drafted", None) if spec else None,
                             accepted=getattr(last, "accepted", None) if spec else None,
                             block=getattr(last, "block", None) if spec else None,
                             token_text=tokenizer.convert_ids_to_tokens([last.token])[0] if args.top_logprobs > 0
                             else None)
                records.append(r)
                rqueue.put(r)
                if ctx._should_stop or self._stop or finish is not None:
                    break
        finally:
            gearbox.set_thresholds(*saved)
        if self._stop and finish is None:
            raise ServerStopping("the server is shutting down: the answer was cut short")
        if spec is not None and last is not None and last.stats is not None:
            provider.keep_plan(spec, args.sampling.temperature == 0, last.stats.plan)
        request_usage = self._usage(records, options)
        if isinstance(request, GearRequest):
            request.usage = request_usage
        if cache is not None:
            self.prompt_cache.insert_cache(provider.model_key, prompt + [r.token for r in records], cache)
        rqueue.put(None)

    def _progress(self, rqueue: Any, check_client: Optional[Callable[[], None]] = None) -> Any:
        """mlx-lm's prompt progress callback (the handler streams ``: keepalive done/total``
        lines from it), which also stops a long prefill between its chunks when the server stops
        or the client has closed its connection (``check_client`` raises then)."""

        def progress(done: int, total: int) -> None:
            if self._stop:
                raise ServerStopping("the server is shutting down: the prompt was not finished")
            if check_client is not None and done < total:
                check_client()
            rqueue.put((done, total))

        return progress

    def _kwargs(self, args: Any, options: GearOptions, cache: Optional[List[Any]], prompt: List[int],
                spec: Optional[str]) -> Dict[str, Any]:
        """Keyword arguments of the package's generation for this request."""
        cli, s = self.cli_args, args.sampling
        kw: Dict[str, Any] = dict(max_tokens=args.max_tokens, temp=s.temperature, top_p=s.top_p, min_p=s.min_p,
                                  top_k=s.top_k, seed=args.seed, kv_bits=cli.kv_bits,
                                  kv_group_size=cli.kv_group_size, quantized_kv_start=cli.quantized_kv_start,
                                  kv_rotation=cli.kv_rotation)
        if spec is not None:
            provider = self.model_provider
            return {**kw, "config": provider.speculative, "draft": provider.draft,
                    "plan": provider.plan_for(spec, s.temperature == 0)}
        lg = args.logits
        processors = make_logits_processors(lg.logit_bias, lg.repetition_penalty, lg.repetition_context_size,
                                            lg.presence_penalty, lg.presence_context_size, lg.frequency_penalty,
                                            lg.frequency_context_size)
        kw.update(policy=make_policy(None if options.gear == "dynamic" else options.gear),
                  prompt_text=self.model_provider.tokenizer.decode(prompt), logits_processors=processors)
        if cache is not None:
            kw["prompt_cache"] = cache
        else:
            kw["max_kv_size"] = cli.max_kv_size
        return kw

    def _usage(self, records: List[Response], options: GearOptions) -> Dict[str, Any]:
        """The ``gearbx`` block of a response's usage."""
        provider = self.model_provider
        spec = options.speculative != "off"
        counts = Counter(r.gear for r in records)
        draft_gear = provider.speculative.draft_gear if spec else None
        return {
            "tokens_per_gear": {g: counts.get(g, 0) for g in GEARS},
            "weight_bytes_read": weight_bytes(records, provider.gearbox.manager.step_bytes(), draft_gear),
            "speculative": options.speculative if spec else None,
            "accepted_drafts": sum(1 for r in records if r.accepted) if spec else None,
            # the thresholds that routed the request: none for a static gear or a drafting request
            "options": {**options.to_dict(), "thresholds": None if options.gear != "dynamic" or spec
                        else list(provider.gearbox.thresholds if options.thresholds is None else options.thresholds)},
        }

    def stop_and_join(self, answer_seconds: float = 2.0) -> None:
        """Stop after the token in flight (mlx-lm's waits for the whole request), then join.

        Requests still queued get a 503 (:class:`ServerStopping`) rather than a closed
        connection: each handler is waited for, up to ``answer_seconds`` in all, to take
        its answer before the process exits."""
        self._stop = True
        self._generation_thread.join()
        waiting = []
        while True:
            try:
                rqueue, _request, _args = self.requests.get_nowait()
            except QueueEmpty:
                break
            rqueue.put(ServerStopping("the server is shutting down: the request was not started"))
            waiting.append(rqueue)
        end = time.monotonic() + answer_seconds
        while any(not q.empty() for q in waiting) and time.monotonic() < end:
            time.sleep(0.01)
        if waiting:
            time.sleep(0.1)  # the handlers write their short answers
