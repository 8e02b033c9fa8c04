"""One machine's numbers: what each gear, kernel, policy and speculative setting decodes at, and holds.

:func:`run_bench` measures, on one model and one prompt, in one process:

* the machine (:mod:`.machine`: chip and memory from the OS, versions, the
  memory bandwidth MLX reaches);
* plain decoding: ``mlx_lm.stream_generate`` on the loaded model, the
  yardstick every row is divided by (``x_plain``);
* each static gear through the gearbox, with MLX's quantized layers and with
  the packed kernels, and on the nested store (the default for float
  weights); the dynamic (entropy) policy on each;
* speculative decoding: the draft step ``c``, the verify of ``k + 1`` tokens
  ``v(k)`` and the acceptance α measured here; fixed block lengths, gated
  blocks (the best stop of the closed form), and the automatic decision
  (:func:`~gearbx_mlx.speculative.plan.plan_speculative`), from the prompt
  alone and calibrated (the statistics ``--calibrate`` saves, read off the
  high gear's continuation that every row decodes);
* resident memory of every store and of the drafter, and the process peak.

Every row decodes the same continuation of the same prompt (routed rows are
forced to the high gear's greedy tokens, speculative rows emit them), and the
rows run interleaved, round after round, with plain decoding at the start and
the end of each round, so the drift of a shared machine falls on all of them
alike; a row's speed is the median of its rounds. The result is one
JSON-ready dict (the format is ``docs/BENCHMARKS.md``, "The bench JSON");
:mod:`.bench_report` prints and compares it. The model it runs on and the
single runs it repeats are :mod:`.bench_subject`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..bindings import guard
from ..config import MAX_ROUNDS, MAX_RUN_TOKENS, GearboxConfig
from ..gearbox import Gearbox, vocab_size_of
from ..policies import PositionPolicy, StaticPolicy
from ..precision import nbytes
from ..resolver import default_kernel
from ..speculative.calibration import (
    DraftStats,
    best_replay,
    draft_stats,
    gating_table,
    modeled_speedup,
)
from ..speculative.decode import MAX_DRAFT, SpeculativeConfig, get_draft
from ..speculative.plan import CHOOSE, measure_start, plan_speculative
from .bench_checks import AUTO_FLOOR, auto_check, plain_noise
from .bench_subject import (
    MIN_RUN_TOKENS,
    PROMPT,
    SHAPES,
    IdTokenizer,
    Subject,
    continuation,
    load_subject,
    quiet,
    run_plain,
    run_routed,
    run_speculative,
)
from .machine import bandwidth, hardware, load_average, software

#: Version of the JSON layout (docs/BENCHMARKS.md, "The bench JSON"). 2: checks carry a verdict
#: judged against the plain runs' spread (``plain_noise``), and the machine names its BLAS.
FORMAT_VERSION = 2
#: The share of the budget the high gear's continuation (the tokens every row decodes) may take.
CONTINUATION_SHARE = 0.08
#: The least time a run is given, however little of the budget is left.
MIN_RUN_SECONDS = 2.0
#: Tokens of each row's untimed warm-up run (:attr:`BenchSettings.warmup`): a fixed block of
#: up to 4 drafts and its verify, then a step of the next.
WARMUP_TOKENS = 6


@dataclass(frozen=True)
class BenchSettings:
    """What a bench run measures (defaults: the full run; :data:`QUICK` for CI).

    Attributes:
        tokens: decode tokens per run (at most: see ``budget_s``).
        rounds: passes over every configuration; each row's speed is the median.
        kernels: the quantized kernels of the separate store's gear rows (``mlx``, ``packed``).
        scope: the layers the gears manage.
        draft_gear: the speculative drafter's gear.
        ks: the fixed block lengths run.
        max_draft: the block cap the automatic decision models lengths up to.
        nested: also run the gears and the dynamic policy on the nested store.
        calibrate: also run the calibrated decision (its statistics from the continuation).
        budget_s: the whole bench's time (setup included): each timed run
            stops after ``tokens`` or its share of what is left, whichever
            comes first (but not before :data:`MIN_RUN_TOKENS` tokens, nor
            :data:`MIN_RUN_SECONDS`), so a slow or busy machine decodes fewer
            tokens per run rather than running past it. None: no limit.
        prompt: the prompt (chat-templated for a real model).
        warmup: run every row once, untimed, for :data:`WARMUP_TOKENS` tokens before the
            timed rounds, so that no timed run pays a path's first use (a GPU compiles each
            new kernel and shape on it: one round of ``--quick`` on an H200 timed a first
            speculative row at 4.6 tokens/s, 38 in a five-round run). None: where the
            default device is a GPU (on the CPU a first use costs a few kernel checks).
    """

    tokens: int = 64
    rounds: int = 2
    kernels: Tuple[str, ...] = ("mlx", "packed")
    scope: str = "all"
    draft_gear: str = "low"
    ks: Tuple[int, ...] = (2, 4)
    max_draft: int = 6
    nested: bool = True
    calibrate: bool = True
    budget_s: Optional[float] = 270.0
    prompt: str = PROMPT
    warmup: Optional[bool] = None

    def warms_up(self) -> bool:
        """:attr:`warmup`, with None decided by the default device."""
        return self.warmup if self.warmup is not None else mx.default_device().type == mx.DeviceType.gpu

    def __post_init__(self) -> None:
        if not 4 <= self.tokens <= MAX_RUN_TOKENS:
            raise ValueError(f"--tokens must be from 4 to {MAX_RUN_TOKENS:,}, got {self.tokens}")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise ValueError(f"--rounds must be from 1 to {MAX_ROUNDS:,}, got {self.rounds}")
        if not self.ks or min(self.ks) < 1 or max(self.ks) > MAX_DRAFT:
            raise ValueError(f"--ks must be block lengths from 1 to {MAX_DRAFT}, got {self.ks}")
        if not 1 <= self.max_draft <= MAX_DRAFT:
            raise ValueError(f"--max-draft must be from 1 to {MAX_DRAFT}, got {self.max_draft}")
        if self.budget_s is not None and not (math.isfinite(self.budget_s) and self.budget_s > 0):
            raise ValueError(f"--budget must be a finite number of seconds > 0 (--no-budget for none), "
                             f"got {self.budget_s}")


#: The CI setting: a few seconds of decoding per row, one round, the packed kernels alone on the separate
#: store (MLX's quantized layers are the slowest rows on a CPU, and its gears take the longest to build).
QUICK = BenchSettings(tokens=16, rounds=1, kernels=("packed",), ks=(4,), max_draft=4, budget_s=120.0)


# -- the bench --------------------------------------------------------------------------------


@dataclass
class Row:
    """One configuration: how to run it once (``run(cap)``), and what it is."""

    section: str
    label: str
    run: Callable[..., Dict[str, Any]]  # run(cap, tokens=None): tokens None decodes every forced token
    meta: Dict[str, Any]
    runs: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    paired: List[float] = dataclasses.field(default_factory=list)  # each run over its neighbouring plain runs


class Clock:
    """Each run's share of the time left: ``(deadline - now) / runs left``, at least :data:`MIN_RUN_SECONDS`."""

    def __init__(self, start: float, budget_s: Optional[float], runs: int) -> None:
        self.deadline = None if budget_s is None else start + budget_s
        self.left = runs

    def cap(self) -> Optional[float]:
        if self.deadline is None:
            return None
        share = (self.deadline - time.perf_counter()) / max(self.left, 1)
        self.left -= 1
        return max(MIN_RUN_SECONDS, share)


def _continuation_stats(subject: Subject, draft: Any, forced: Sequence[int]) -> DraftStats:
    """The drafter against the high gear on the high gear's own continuation (teacher-forced)."""
    seq = list(subject.prompt_ids) + list(forced)
    full = draft_stats(subject.model, draft, seq, window=len(seq))
    keep = slice(len(subject.prompt_ids) - 1, len(seq) - 1)
    return DraftStats(*[getattr(full, f)[keep] for f in ("draft_entropy", "high_entropy", "agree", "accept_prob")])


def _gear_rows(subject: Subject, settings: BenchSettings, forced: Sequence[int], vocab: int,
               say: Callable[[str], None]) -> Tuple[Dict[str, Gearbox], Dict[str, Any], List[Row]]:
    """The gearboxes (one per kernel on the separate store, and the nested store) and their rows."""
    boxes: Dict[str, Gearbox] = {}
    prep: Dict[str, Any] = {}
    say("building the gears (quantizing once per kernel) ...")
    for k in settings.kernels:
        gb = Gearbox(subject.model, GearboxConfig(kernel=k, scope=settings.scope, store="separate",
                                                  initial_gear="high"), vocab)
        with quiet():
            prep[k] = {g: gb.prepare(g) for g in ("low", "mid")}
        boxes[k] = gb
    if settings.nested:
        say("building the nested store's planes (or reading them from the model's folder) ...")
        t0 = time.perf_counter()
        with quiet():
            boxes["nested"] = Gearbox(subject.model, GearboxConfig(kernel="packed", scope=settings.scope,
                                                                   store="nested", initial_gear="high"),
                                      vocab, planes_dir=subject.folder)
        prep["nested"] = {"planes": time.perf_counter() - t0, "origin": boxes["nested"].manager.planes_origin}

    def routed(gb: Gearbox, policy: Any) -> Callable[..., Dict[str, Any]]:
        return lambda cap, tokens=None: run_routed(subject, gb, policy, forced[:tokens], cap)

    first = boxes[settings.kernels[0]]
    rows = [Row("static", "high (gearbox)", routed(first, StaticPolicy("high")), {"gear": "high", "policy": "static"})]
    stores = [(k, k, "separate") for k in settings.kernels] + ([("nested", "packed", "nested")] if settings.nested
                                                               else [])
    for box, kernel, store in stores:
        name = "nested store" if store == "nested" else kernel
        for g in ("mid", "low"):
            # The prompt in the high gear, every decoded token in g: the table is
            # about decode speed, and quantized layers on MLX's CPU backend
            # prefill so slowly that it took most of a static row's time.
            rows.append(Row("static", f"{g}, {name}", routed(boxes[box], PositionPolicy(1, "high", g)),
                            {"gear": g, "kernel": kernel, "policy": "static", "store": store}))
    for box, kernel, store in stores:
        label = "dynamic, packed, nested store" if store == "nested" else f"dynamic, {kernel}"
        rows.append(Row("dynamic", label, routed(boxes[box], None),
                        {"policy": "entropy", "kernel": kernel, "store": store}))
    return boxes, prep, rows


def run_bench(subject: Subject, settings: BenchSettings = BenchSettings(),
              progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Measure everything of the module doc on ``subject``; the JSON-ready result.

    The timed runs: the table's first round (every row once, plain decoding
    at its start and end); the decision's pairs (plain decoding and the
    automatic rows alternate ``rounds + 1`` times, plain decoding first and
    last; each automatic run is divided by the mean of the plain runs right
    before and after its group, and the median of these ratios is its
    ``x_plain``: the drift of a shared machine between neighbours is small
    next to its drift over a round); then the table's other rounds, each only
    if the budget has room for another as long as the first (``rounds_run``).
    Before them, where ``settings.warms_up()``, every row once, untimed
    (:data:`WARMUP_TOKENS` tokens), within the budget's time.
    """
    say = progress or (lambda _: None)
    tic, created = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    model, n = subject.model, settings.tokens
    say("machine: hardware, versions, memory bandwidth ...")
    machine = {"hardware": hardware(), "software": software(), "bandwidth": bandwidth(),
               "load_average": {"start": load_average()}}
    say(f"the high gear's continuation ({n} tokens) ...")
    # Every row decodes these tokens: on a slow machine, fewer (a share of the budget, as a run's).
    forced = continuation(subject, n, None if settings.budget_s is None else CONTINUATION_SHARE * settings.budget_s)
    vocab = vocab_size_of(model)
    info = {"name": subject.name, "source": subject.source, "dtype": subject.dtype, "vocab_size": vocab,
            "weight_bytes": nbytes(model), "prompt_tokens": len(subject.prompt_ids)}

    boxes, prep, gear_rows = _gear_rows(subject, settings, forced, vocab, say)
    plain_row = Row("plain", "plain decoding (mlx-lm)",
                    lambda cap, tokens=None: run_plain(subject, forced[:tokens], cap), {"policy": "plain"})
    spec, spec_rows, auto_rows, draft = _speculative(subject, settings, forced, vocab, boxes, say)
    rows = [plain_row] + gear_rows + spec_rows
    order = rows + [plain_row]  # plain decoding brackets each round
    pairs = settings.rounds + 1
    total = settings.rounds * len(order) + pairs * len(auto_rows) + (pairs + 1 if auto_rows else 0)
    clock = Clock(tic, settings.budget_s, total)
    setup_seconds = time.perf_counter() - tic
    progress_count = [0]

    def run(row: Row, what: str) -> Dict[str, Any]:
        progress_count[0] += 1
        say(f"[{progress_count[0]}/{total}] {what}: {row.label} ...")
        return row.run(clock.cap())

    warmup = _warm_up(rows + auto_rows, say) if settings.warms_up() else None
    decide = (lambda: _pairs(plain_row, auto_rows, pairs, run)) if auto_rows else None
    rounds_run = _rounds(settings.rounds, order, clock, run, decide, say)
    plain = statistics.median(x["tokens_per_s"] for x in plain_row.runs)
    out_rows = [_summarize(row, plain) for row in rows + auto_rows]
    machine["load_average"]["end"] = load_average()
    # Plain decoding against itself, run after run: the spread every verdict is judged against.
    noise = plain_noise([x["tokens_per_s"] for x in plain_row.runs])
    checks = [auto_check(row, noise, AUTO_FLOOR) for row in out_rows if row.get("policy") == "speculative-auto"]
    return {
        "format_version": FORMAT_VERSION,
        "kind": "gearbx-bench",
        "created": created,
        "settings": dataclasses.asdict(settings),
        "machine": machine,
        "model": info,
        "plain_tokens_per_s": plain,
        "rounds_run": rounds_run,
        "rows": out_rows,
        "plain_noise": noise,
        "speculative": spec,
        "memory": _memory(subject, boxes, draft),
        "preparation_seconds": prep,
        "warmup": warmup,
        "first_use": guard.status(),
        "checks": checks,
        "seconds": time.perf_counter() - tic,
        "setup_seconds": setup_seconds,
    }


def _warm_up(rows: Sequence[Row], say: Callable[[str], None]) -> Dict[str, Any]:
    """Every row once, :data:`WARMUP_TOKENS` tokens, untimed (nothing kept): ``{"tokens", "rows", "seconds"}``."""
    tic = time.perf_counter()
    for i, row in enumerate(rows, 1):
        say(f"[warm-up {i}/{len(rows)}] {row.label} ...")
        row.run(None, WARMUP_TOKENS)
    return {"tokens": WARMUP_TOKENS, "rows": len(rows), "seconds": time.perf_counter() - tic}


def _rounds(rounds: int, order: Sequence[Row], clock: "Clock", run: Callable[[Row, str], Dict[str, Any]],
            after_first: Optional[Callable[[], None]], say: Callable[[str], None]) -> int:
    """The table's rounds: the first, then ``after_first`` (the decision's pairs, which the
    check needs), then the others while one more fits in the budget; the rounds run."""
    rounds_run, round_seconds = 0, 0.0
    for r in range(rounds):
        if r > 0 and clock.deadline is not None and time.perf_counter() + round_seconds > clock.deadline:
            say(f"the time budget leaves no room for repeat {r + 1} of {rounds}: "
                f"rows keep {rounds_run} (--budget or --no-budget gives more)")
            break
        t0 = time.perf_counter()
        for row in order:
            row.runs.append(run(row, f"repeat {r + 1}"))
        round_seconds, rounds_run = time.perf_counter() - t0, rounds_run + 1
        if r == 0 and after_first is not None:
            say("the automatic decision against plain decoding, run by run ...")
            after_first()
    return rounds_run


def _pairs(plain_row: Row, auto_rows: Sequence[Row], pairs: int,
           run: Callable[[Row, str], Dict[str, Any]]) -> None:
    """Plain decoding and the automatic rows in turn, ``pairs`` times, plain decoding first and last;
    each automatic run over the mean of the plain runs right before and after its group."""
    before = None
    for i in range(pairs + 1):
        plain_row.runs.append(run(plain_row, f"pair {min(i + 1, pairs)}"))
        after = plain_row.runs[-1]["tokens_per_s"]
        if before is not None:
            for row in auto_rows:
                row.paired.append(row.runs[-1]["tokens_per_s"] / (0.5 * (before + after)))
        before = after
        if i == pairs:
            break
        for row in auto_rows:
            row.runs.append(run(row, f"pair {i + 1}"))


def _summarize(row: Row, plain: float) -> Dict[str, Any]:
    tps = [x["tokens_per_s"] for x in row.runs]
    med = statistics.median(tps)
    last = row.runs[-1]
    extra = {k: v for k, v in last.items() if k not in ("tokens_per_s", "decode_tokens")}
    out = {"section": row.section, "label": row.label, **row.meta, "tokens_per_s": med,
           "x_plain": (statistics.median(row.paired) if row.paired else med / plain) if plain else None,
           "runs_tokens_per_s": tps, "decode_tokens": min(x["decode_tokens"] for x in row.runs),
           "runs_decode_tokens": [x["decode_tokens"] for x in row.runs], **extra}
    if row.paired:
        out["paired_x_plain"] = list(row.paired)
    return out


def _speculative_run(subject: Subject, gearbox: Gearbox, draft: Any, n: int, config: SpeculativeConfig,
                     plan: Any = None) -> Callable[..., Dict[str, Any]]:
    """A speculative row's ``run(cap, tokens=None)``: ``n`` tokens, or ``tokens``."""
    return lambda cap, tokens=None: run_speculative(subject, gearbox, draft, config, tokens or n, plan=plan, cap=cap)


def _speculative(subject: Subject, settings: BenchSettings, forced: Sequence[int], vocab: int,
                 boxes: Dict[str, Gearbox], say: Callable[[str], None]
                 ) -> Tuple[Dict[str, Any], List[Row], List[Row], Any]:
    """The drafter's measured costs and acceptance, the plans, the speculative rows
    (fixed and gated blocks) and the automatic decision's rows.

    The drafter is the one ``--speculative`` builds: every layer in the draft
    gear, views of the nested store's planes where the bench runs that store
    (the default for float weights), else with this machine's default kernel
    (sharing that gearbox's gear when the gear rows built it for every layer).
    """
    model = subject.model
    kernel = default_kernel()
    # As generate --speculative drafts: from the nested store's planes where it
    # is run (the default for float weights), else this machine's kernel's gear.
    store = "nested" if "nested" in boxes and settings.scope == "all" else "separate"
    gb = boxes["nested"] if store == "nested" else boxes.get(kernel) if settings.scope == "all" else None
    gb = gb or Gearbox(model, GearboxConfig(kernel=kernel, scope="all", store="separate", initial_gear="high"),
                       vocab)
    kernel = gb.config.kernel
    with quiet():
        draft = get_draft(model, gb, settings.draft_gear, "all")
    cap = max(settings.max_draft, max(settings.ks))
    say(f"timing a draft step and verifies of k+1 tokens (k = 1..{cap}) ...")
    measured = measure_start(model, draft, subject.prompt_ids, cap)
    cont = _continuation_stats(subject, draft, forced)
    alpha = cont.summary()["alpha_greedy"]
    c = measured.seconds["draft"] / measured.seconds["high"]
    v = [1.0] + [t / measured.seconds["high"] for t in measured.seconds["verify"]]
    cal: Optional[Dict[str, Any]] = None
    if settings.calibrate:
        # What --calibrate measures on its prompts' continuations (alpha, the
        # gating table, the best replayed stop), read off the continuation the
        # rows decode: no extra decoding, which on a slow machine would take
        # the runs' time (and random weights have no text to calibrate on).
        cal = {**cont.summary(), "n_samples": cont.n, **best_replay(cont, c, v), "source": "continuation",
               "gating": {"greedy": gating_table(cont, True), "sampled": gating_table(cont, False)}}
    plan_prompt = plan_speculative(model, draft, subject.prompt_ids, settings.max_draft, measured=measured)
    plan_cal = (plan_speculative(model, draft, subject.prompt_ids, settings.max_draft, measured=measured,
                                 calibration=cal) if cal else None)
    # The best gated blocks the closed form finds on the continuation (or the calibration).
    gated = plan_speculative(model, draft, subject.prompt_ids, settings.max_draft, measured=measured, stop=CHOOSE,
                             calibration=cal or {"gating": {"greedy": gating_table(cont, True)}}).gated
    base = SpeculativeConfig(draft_gear=settings.draft_gear, draft_scope="all")
    speculating = functools.partial(_speculative_run, subject, gb, draft, len(forced))
    rows: List[Row] = []
    for k in settings.ks:
        cfg = dataclasses.replace(base, max_draft=k)
        rows.append(Row("speculative", f"speculative, fixed k={k}", speculating(cfg),
                        {"policy": "speculative-fixed", "k": k,
                         "modeled_x_high": modeled_speedup(alpha, k, c, v[min(k, len(v) - 1)])}))
    if gated is not None:
        cfg = dataclasses.replace(base, max_draft=int(gated["k"]), draft_entropy_stop=float(gated["stop_bits"]))
        rows.append(Row("speculative", f"speculative, gated k<={gated['k']} stop {gated['stop_bits']:.2f} bits",
                        speculating(cfg), {"policy": "speculative-gated", "key": "speculative, gated",
                                           "k": int(gated["k"]), "stop_bits": gated["stop_bits"],
                                           "modeled_x_high": gated["speedup"]}))
    auto: List[Row] = []
    for name, plan in (("auto", plan_prompt), ("auto, calibrated", plan_cal)):
        if plan is None:
            continue
        cfg = dataclasses.replace(base, max_draft=settings.max_draft)
        auto.append(Row("speculative", f"speculative {name}: {plan.choice}" + (
            f" k={plan.best_k}" if plan.speculate else ""),
            speculating(cfg, plan),
            {"policy": "speculative-auto", "key": f"speculative {name}", "choice": plan.choice,
             "k": plan.best_k if plan.speculate else None,
             "stop_bits": plan.stop_bits, "modeled_x_high": plan.best_speedup}))
    spec = {
        "draft_gear": settings.draft_gear, "store": store, "kernel": kernel, "drafter": plan_prompt.drafter,
        "costs": {"high_ms": 1e3 * measured.seconds["high"], "draft_ms": 1e3 * measured.seconds["draft"],
                  "verify_ms": [1e3 * t for t in measured.seconds["verify"]], "c": c, "v": v},
        "alpha": {"prompt": measured.alpha_greedy, "prompt_positions": measured.positions,
                  "continuation": alpha, "continuation_positions": cont.n,
                  "calibration": cal.get("alpha_greedy") if cal else None},
        "plans": {"prompt": plan_prompt.to_dict(), "calibrated": plan_cal.to_dict() if plan_cal else None},
        "calibration": cal,
    }
    return spec, rows, auto, draft


def _memory(subject: Subject, boxes: Dict[str, Gearbox], draft: Any) -> Dict[str, Any]:
    """Bytes held: the loaded weights, each store's managed layers, the drafter, the process peak."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: Dict[str, Any] = {
        "weights_bytes": nbytes(subject.model),
        "stores": {k: gb.manager.memory() for k, gb in boxes.items()},
        "drafter": dict(draft.memory) if draft is not None else None,
        # ru_maxrss is in bytes on macOS, in KiB on Linux.
        "process_peak_rss_bytes": peak if sys.platform == "darwin" else peak * 1024,
        "mlx_peak_bytes": mx.get_peak_memory(),
        "mlx_active_bytes": mx.get_active_memory(),
    }
    return out


def environment_command() -> str:
    """The command line of this process, as the JSON records it."""
    return " ".join(["python", "-m", "gearbx_mlx.bench"] + sys.argv[1:])


__all__ = ["AUTO_FLOOR", "BenchSettings", "FORMAT_VERSION", "IdTokenizer", "MIN_RUN_TOKENS", "PROMPT", "QUICK",
           "SHAPES", "WARMUP_TOKENS", "Subject", "continuation", "environment_command", "load_subject", "run_bench", "run_plain",
           "run_routed", "run_speculative"]
