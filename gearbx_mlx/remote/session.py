"""Entropy telemetry and per-prompt routing over OpenAI-compatible servers (§12.3).

The server is opaque: its weights cannot be swapped mid-answer, and it reports
only the top-k log-probabilities of each token. From those, every token gets
entropy bounds (:mod:`.bounds`): ``lower <= H <= upper``, where
``upper`` is §12.3's uniform-residual estimate. The trace's ``entropy`` is the
lower bound (the header says so and gives k); ``entropy_upper`` is beside it.

Routing is per prompt, among variants (``--variant low=URL,MODEL ...``).
Before prompt n is sent:

1. the cold-start classifier (§11) gives a gear ``c_n`` from the prompt text;
2. a session-level :class:`EntropyMonitor` (same thresholds, window and
   hysteresis as the token monitor; minimum duration one prompt) has been fed
   one value per answered prompt, the mean per-token ``entropy`` of that
   answer; its gear after answers 1..n-1 is ``s_n`` (none before an answer);
3. the routed gear is the more precise of ``c_n`` and ``s_n``: a hard prompt
   is never sent to a cheap variant because the session so far was easy, and
   a session whose answers proved uncertain keeps the precise variant until
   their entropy falls back below the thresholds (with hysteresis);
4. a gear with no variant of its own is served by the nearest more precise
   variant, else the nearest less precise one.

Within an answer a token-level monitor, reset to the routed gear, records per
token the gear a local gearbox would have used (``gear``: telemetry only, as
in telemetry-only mode); ``variant`` is the gear of the variant that served it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..classifier import classify_prompt
from ..config import GEAR_INDEX, GEARS, GearboxConfig
from ..entropy import EntropyMonitor, scaled_thresholds
from ..telemetry.trace import sigint_deferred
from .bounds import entropy_bounds
from .openai_client import Chunk, TokenInfo, api_base, parse_chunk
from .transport import HTTPStatusError, Limits, Request, check_key_transport

DEFAULT_TOP_K = 10  # within every server's cap (mlx-lm 11, OpenAI 20)


@dataclass(frozen=True)
class Variant:
    gear: str
    url: str  # the server's .../v1 base
    model: Optional[str]  # sent as "model"; None lets the server pick its default


def parse_variants(specs: Sequence[str]) -> Dict[str, Variant]:
    """``GEAR=URL[,MODEL]`` (or ``URL[,MODEL]`` for every gear) -> ``{gear: Variant}``."""
    if not specs:
        raise ValueError("give at least one --variant [GEAR=]URL[,MODEL], e.g. --variant http://127.0.0.1:8080")
    out: Dict[str, Variant] = {}
    for spec in specs:
        gear, sep, rest = spec.partition("=")
        if not sep or "://" in gear:
            gears, rest = list(GEARS), spec
        elif gear in GEARS:
            gears = [gear]
        else:
            raise ValueError(f"--variant {spec!r}: gear must be one of {GEARS}")
        url, _, model = rest.partition(",")
        for g in gears:
            if g in out and len(gears) == 1:
                raise ValueError(f"--variant: the {g} gear is given twice")
            out[g] = Variant(g, api_base(url), model.strip() or None)
    return out


def variant_for(variants: Dict[str, Variant], gear: str) -> Variant:
    """The variant serving ``gear``: its own, else the nearest more precise, else less."""
    i = GEAR_INDEX[gear]
    for g in list(GEARS[i:]) + list(reversed(GEARS[:i])):
        if g in variants:
            return variants[g]
    raise ValueError("no variants configured")


def more_precise(a: str, b: Optional[str]) -> str:
    return a if b is None or GEAR_INDEX[a] >= GEAR_INDEX[b] else b


def resolve_vocab_size(variants: Dict[str, Variant], given: Optional[int]) -> Tuple[int, str]:
    """``V`` from ``--vocab-size``, else from the variants' model folders (mlx-lm
    servers name models by path). Returns ``(V, where it came from)``."""
    if given is not None:
        if given < 2:
            raise ValueError(f"--vocab-size must be >= 2, got {given}")
        return given, "--vocab-size"
    found = {}
    for v in variants.values():
        cfg = Path(v.model).expanduser() / "config.json" if v.model else None
        if cfg is not None and cfg.is_file():
            size = _config_vocab(cfg)
            if size:
                found[v.model] = size
    if not found or len(found) < len({v.model for v in variants.values()}):
        raise ValueError(
            "cannot tell the model's vocabulary size (the entropy bounds need it): "
            "pass --vocab-size N (e.g. 49152 for SmolLM2, 151936 for Qwen2.5)"
        )
    if len(set(found.values())) > 1:
        raise ValueError(f"the variants have different vocabularies {found}: route among one model family")
    return next(iter(found.values())), "model config.json"


def _config_vocab(path: Path) -> Optional[int]:
    """``vocab_size`` of a model's ``config.json`` (or its ``text_config``); None if absent."""
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e} (pass --vocab-size N instead)") from None
    if not isinstance(c, dict):
        raise ValueError(f"{path} is not a JSON object (pass --vocab-size N instead)")
    text = c.get("text_config")
    size = c.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise ValueError(f"{path}: vocab_size {size!r} is not an integer >= 2 (pass --vocab-size N instead)")
    return size


@dataclass
class PromptResult:
    """One answered prompt."""

    index: int
    prompt: str
    variant: str
    classifier_gear: str
    classifier_score: float
    session_gear: Optional[str]
    text: str = ""
    tokens: int = 0
    entropies: List[float] = field(default_factory=list)
    seconds: float = 0.0
    streamed: bool = True
    finish_reason: Optional[str] = None

    def record(self) -> Dict[str, Any]:
        return {"index": self.index, "prompt": self.prompt, "variant": self.variant,
                "classifier": {"gear": self.classifier_gear, "score": self.classifier_score},
                "session_gear": self.session_gear, "tokens": self.tokens,
                "mean_entropy": statistics.fmean(self.entropies) if self.entropies else None,
                "seconds": self.seconds, "streamed": self.streamed, "finish_reason": self.finish_reason}


@dataclass(frozen=True)
class SessionOptions:
    """How a :class:`RemoteSession` asks (every default in one place).

    Attributes:
        top_k: how many log-probabilities to ask for per token (1..20).
        max_tokens: tokens per answer.
        sampling: ``temperature``, ``top_p``, ``seed`` sent with each request.
        stream: ``auto`` (stream; fall back to one JSON answer if the server
            streams no logprobs, as mlx-lm 0.32 does), ``on`` or ``off``.
        system_prompt: sent first in each conversation (chat endpoint).
        history: send earlier prompts and answers along (chat endpoint only).
        connect_timeout, read_timeout, deadline: seconds to connect, without
            progress, and for a whole answer (:class:`~.transport.Limits`).
        api_key: sent as a bearer token; over plain http only to this machine
            unless ``allow_plain_http_key``.
    """

    top_k: int = DEFAULT_TOP_K
    max_tokens: int = 256
    sampling: Optional[Dict[str, Any]] = None
    stream: str = "auto"
    system_prompt: Optional[str] = None
    history: bool = True
    connect_timeout: float = 5.0
    read_timeout: float = 120.0
    deadline: float = Limits.deadline
    api_key: Optional[str] = None
    allow_plain_http_key: bool = False

    def check(self) -> None:
        """One clear error for a bad value."""
        if not 1 <= self.top_k <= 20:
            raise ValueError(f"top_k must be in 1..20 (servers cap it; mlx-lm at 11), got {self.top_k}")
        if self.stream not in ("auto", "on", "off"):
            raise ValueError(f"stream must be auto, on or off, got {self.stream!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {m!r}")


class RemoteSession:
    """A conversation with one or more server variants, routed per prompt.

    Args:
        variants: ``{gear: Variant}`` from :func:`parse_variants`.
        vocab_size: the model's vocabulary size ``V``.
        config: window, hysteresis, minimum duration, default thresholds.
        thresholds: ``(low, high)`` in the model's bits; default: scaled (§3.4).
        on_token: called with each token record as it arrives.
        on_text: called with answer text whose tokens are not known one by one
            (mlx-lm without greedy decoding) and the gear in force.
        say: where notes go (stderr by default).
        options: :class:`SessionOptions` fields (``top_k=``, ``max_tokens=``,
            ...), or ``options=SessionOptions(...)``.
    """

    def __init__(
        self,
        variants: Dict[str, Variant],
        vocab_size: int,
        config: Optional[GearboxConfig] = None,
        thresholds: Optional[Tuple[float, float]] = None,
        *,
        on_token: Optional[Callable[[Dict[str, Any]], None]] = None,
        on_text: Optional[Callable[[str, str], None]] = None,
        say: Optional[Callable[[str], None]] = None,
        **options: Any,
    ) -> None:
        given = options.pop("options", None) or SessionOptions()
        try:
            o = dataclasses.replace(given, **options)
        except TypeError as e:  # an unknown keyword
            raise TypeError(f"RemoteSession: {e}") from None
        o.check()
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
        self.options = o
        self.limits = Limits(connect_timeout=o.connect_timeout, idle_timeout=o.read_timeout, deadline=o.deadline)
        if o.api_key:
            for v in variants.values():
                check_key_transport(v.url, o.allow_plain_http_key)
        self.variants = variants
        self.vocab_size = vocab_size
        self.config = config or GearboxConfig()
        self.thresholds = thresholds or scaled_thresholds(self.config, vocab_size)
        self.sampling = {"temperature": 0.0, **(o.sampling or {})}
        self.greedy = self.sampling["temperature"] == 0
        self.on_token = on_token or (lambda rec: None)
        self.on_text = on_text or (lambda text, gear: None)
        self.say = say or (lambda msg: print(f"[gearbx] {msg}", file=sys.stderr, flush=True))
        self.monitor = EntropyMonitor(vocab_size, self.config, self.thresholds)
        self.session_monitor = EntropyMonitor(
            vocab_size, self.config.replace(min_gear_duration=1), self.thresholds
        )
        self.messages: List[Dict[str, str]] = []
        self.results: List[PromptResult] = []
        self.records: List[Dict[str, Any]] = []
        self._no_stream_logprobs: set = set()  # URLs that stream text only
        self._completions: set = set()  # URLs without a chat endpoint

    # -- routing ----------------------------------------------------------------
    def route(self, prompt: str) -> Tuple[str, Any, Optional[str]]:
        """``(routed gear, classifier verdict, session gear)`` for the next prompt."""
        pc = classify_prompt(prompt)
        session = self.session_monitor.gear if self.results else None
        return more_precise(pc.gear, session), pc, session

    # -- one prompt ---------------------------------------------------------------
    def ask(self, prompt: str) -> PromptResult:
        """Send ``prompt`` to its variant, record every token, return the result.

        A failure part-way leaves the tokens received so far in ``records``
        (and in the trace, through ``on_token``) and re-raises.
        """
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        gear, pc, session = self.route(prompt)
        variant = variant_for(self.variants, gear)
        res = PromptResult(len(self.results), prompt, variant.gear, pc.gear, pc.score, session)
        self.results.append(res)
        if not self.results[:-1]:
            self.session_monitor.reset(gear)
        self.monitor.reset(gear)
        self.say(f"prompt {res.index}: {variant.gear} variant ({variant.model or 'server default'} at "
                 f"{variant.url}); classifier {pc.gear} ({pc.score:.2f}), session {session or '-'}")
        tic = last = time.perf_counter()
        with contextlib.closing(self._chunks(variant, prompt)) as chunks:
            for chunk, streamed in chunks:
                now = time.perf_counter()
                res.streamed = streamed
                res.finish_reason = chunk.finish_reason or res.finish_reason
                # The client's own cap: a server that streams past max_tokens is cut off.
                room = self.options.max_tokens - res.tokens
                tokens = chunk.tokens[:room]
                res.text += chunk.text if len(tokens) == len(chunk.tokens) else "".join(t.text or "" for t in tokens)
                # A chunk's time is spread over its tokens (a whole answer's, when not streamed).
                for tok in tokens:
                    self._token(tok, res, (now - last) / len(tokens))
                if chunk.text and not any(t.text is not None for t in chunk.tokens):
                    self.on_text(chunk.text, self.monitor.gear)  # token texts unknown: show the answer's
                last = now if tokens else last
                if len(chunk.tokens) > room:
                    self.say(f"{variant.url} sent more than {self.options.max_tokens} tokens (--max-tokens): "
                             "stopped reading its answer")
                    res.finish_reason = "length"
                    break
        res.seconds = time.perf_counter() - tic
        if res.entropies:
            self.session_monitor.push(statistics.fmean(res.entropies))
        if self.options.history:
            self.messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": res.text}]
        return res

    def _token(self, tok: TokenInfo, res: PromptResult, seconds: float) -> None:
        if not tok.top:
            raise ValueError("the server sent a token without top_logprobs: it may not support them")
        b = entropy_bounds([p for _, _, p in tok.top], self.vocab_size)
        gear = self.monitor.gear  # in force when this token was produced
        last = self.records[-1] if self.records else None
        prev = last["gear"] if last and last["prompt"] == res.index else None  # shifts within an answer
        step = self.monitor.push(b.lower)
        rec = {
            "index": len(self.records), "prompt": res.index, "token": tok.token_id, "text": tok.text,
            "logprob": tok.logprob, "entropy": b.lower, "entropy_upper": b.upper,
            "residual_mass": b.residual, "top_k": b.k, "smoothed_entropy": step.smoothed,
            "predicted_entropy": step.predicted, "gear": gear, "variant": res.variant,
            "shift": prev is not None and gear != prev, "shift_seconds": 0.0, "step_seconds": seconds,
        }
        with sigint_deferred():  # recorded and traced together, whatever Ctrl-C does
            self.records.append(rec)
            res.tokens += 1
            res.entropies.append(b.lower)
            self.on_token(rec)

    # -- requests -----------------------------------------------------------------
    def _body(self, prompt: str, chat: bool, stream: bool, legacy_logprobs: bool) -> Dict[str, Any]:
        body: Dict[str, Any] = {"max_tokens": self.options.max_tokens, "stream": stream, **self.sampling}
        if chat:
            system = [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
            body["messages"] = system + self.messages + [{"role": "user", "content": prompt}]
            body.update(logprobs=True, top_logprobs=self.options.top_k)
        else:
            body["prompt"] = prompt
            body.update({"logprobs": self.options.top_k} if legacy_logprobs else {"logprobs": True, "top_logprobs": self.options.top_k})
        return body

    def _open(self, variant: Variant, prompt: str, stream: bool) -> Request:
        """Open a request, falling back from chat to completions on 404 and
        between the two completions ``logprobs`` forms on 400."""
        attempts = ([] if variant.url in self._completions else [(True, False)]) + [(False, True), (False, False)]
        for n, (chat, legacy) in enumerate(attempts):
            body = self._body(prompt, chat, stream, legacy)
            if variant.model:
                body["model"] = variant.model
            path = "/chat/completions" if chat else "/completions"
            req = Request(variant.url + path, body, self.limits, api_key=self.options.api_key, max_tokens=self.options.max_tokens,
                          allow_plain_http_key=self.options.allow_plain_http_key)
            try:
                return req.open()
            except HTTPStatusError as e:
                last = n == len(attempts) - 1
                if chat and e.status == 404 and not last:
                    self.say(f"{variant.url} has no chat endpoint: using /completions (no history)")
                    self._completions.add(variant.url)
                    continue
                if not chat and e.status in (400, 422) and not last:
                    continue
                raise
        raise AssertionError("unreachable")

    def _chunks(self, variant: Variant, prompt: str) -> Iterator[Tuple[Chunk, bool]]:
        mode = "off" if variant.url in self._no_stream_logprobs else self.options.stream
        if mode != "off":
            seen_tokens = False
            with contextlib.closing(self._open(variant, prompt, stream=True).events()) as events:
                for event in events:
                    chunk = self._parse(event, variant)
                    if not chunk.has_logprobs:
                        if mode == "on" or seen_tokens:
                            raise ValueError(
                                f"{variant.url} streamed text without logprobs: it does not stream "
                                "them (mlx-lm 0.32 does not); use --stream off or auto"
                            )
                        self.say(f"{variant.url} streams no logprobs (as mlx-lm 0.32's server): "
                                 "asking again without streaming")
                        self._no_stream_logprobs.add(variant.url)
                        break
                    seen_tokens = seen_tokens or bool(chunk.tokens)
                    yield chunk, True
                else:
                    return
        answer = self._open(variant, prompt, stream=False).json()
        yield self._parse(answer, variant), False

    def _parse(self, event: Dict[str, Any], variant: Variant) -> Chunk:
        try:
            return parse_chunk(event, self.greedy)
        except ValueError as e:
            raise ValueError(f"malformed answer from {variant.url}: {e}") from None

    # -- telemetry --------------------------------------------------------------------
    def header(self) -> Dict[str, Any]:
        c = self.config
        return {
            "source": "remote", "model": ", ".join(sorted({v.model or v.url for v in self.variants.values()})),
            "variants": {g: {"url": v.url, "model": v.model} for g, v in self.variants.items()},
            "vocab_size": self.vocab_size,
            "entropy_is_lower_bound": True, "top_k": self.options.top_k,
            "entropy_bound": {"entropy": "lower bound (residual packed at the k-th probability)",
                              "entropy_upper": "upper bound (§12.3: residual spread uniformly)"},
            "thresholds": {"low": self.thresholds[0], "high": self.thresholds[1]},
            "window": c.window, "hysteresis": c.hysteresis, "min_gear_duration": c.min_gear_duration,
            "routing": "per-prompt", "telemetry_only": True, "sampling": self.sampling,
            "max_tokens": self.options.max_tokens,
        }

    def summary(self, interrupted: bool = False, error: Optional[str] = None) -> Dict[str, Any]:
        ents = [r["entropy"] for r in self.records]
        counts = {g: sum(1 for r in self.records if r["gear"] == g) for g in GEARS}
        served = {g: sum(1 for r in self.records if r["variant"] == g) for g in GEARS}
        return {
            "interrupted": interrupted, "error": error,
            "finish_reason": self.results[-1].finish_reason if self.results else None,
            "generation_tokens": len(self.records), "tokens_per_gear": counts, "tokens_per_variant": served,
            "shifts": sum(1 for r in self.records if r["shift"]),
            "mean_entropy": statistics.fmean(ents) if ents else None,
            "mean_entropy_upper": statistics.fmean(r["entropy_upper"] for r in self.records) if ents else None,
            "prompts": [r.record() for r in self.results], "telemetry_only": True,
        }
