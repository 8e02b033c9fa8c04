"""What a bench runs on and how it runs one configuration: the subject and the runs.

:func:`load_subject` loads the model a bench measures (the default, a folder or
hub id, or a random-weight llama of a named shape in :data:`SHAPES`) with the
prompt's token ids; :func:`continuation` decodes the high gear's greedy tokens
that every row then decodes again; :func:`run_plain`, :func:`run_routed` and
:func:`run_speculative` time one run each (mlx-lm's loop, the gearbox's and the
speculative one), stopping early at a time cap once :data:`MIN_RUN_TOKENS` are
out. :mod:`.bench` orders and repeats them.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, stream_generate as mlx_stream_generate
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..chat import encode_chat
from ..gearbox import Gearbox
from ..generation import load
from ..pipeline import stream_generate, stream_speculative_generate
from ..sources.models import resolve_model
from ..speculative.decode import SpeculativeConfig
from .speed import forcing_sampler

PROMPT = "Explain in one paragraph why the sky is blue."
#: Random-weight llama shapes for ``--shape`` (as scripts/bench_speculative.py builds them).
SHAPES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}
#: A run that hits its share of the time budget stops once it has decoded this many tokens.
MIN_RUN_TOKENS = 8


class IdTokenizer:
    """A stand-in tokenizer for random-weight models: a character per token, no EOS.

    The bench feeds token ids; mlx-lm's detokenizer only needs ``encode`` and
    ``decode`` to agree on something.
    """

    eos_token_id = None
    bos_token = None
    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def get_vocab(self) -> Dict[str, int]:
        return {f"{chr(97 + i % 26)}{i // 26}": i for i in range(self.vocab)}

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return [ord(ch) % self.vocab for ch in text]

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, *_: Any, **__: Any) -> Any:
        raise ValueError("a random-weight model has no chat template")


@dataclass
class Subject:
    """The model a bench runs on, and the prompt's token ids."""

    model: nn.Module
    tokenizer: Any
    name: str
    source: str  # "model" (a folder or the default) or "random" (a --shape)
    prompt_ids: List[int]
    dtype: str
    folder: Optional[Path] = None  # the model's folder: the nested store caches its planes there


def load_subject(model: Optional[str] = None, shape: Optional[str] = None, dtype: Optional[str] = None,
                 prompt: str = PROMPT) -> Subject:
    """The default model, a model folder or hub id, or a random-weight llama of a named shape."""
    if shape is not None:
        if shape not in SHAPES:
            raise ValueError(f"--shape must be one of {sorted(SHAPES)}, got {shape!r}")
        args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **SHAPES[shape])
        mx.random.seed(0)  # a fixed model: mlx-lm's own initialization, seeded
        m = llama.Model(args)
        m.set_dtype(getattr(mx, dtype or "bfloat16"))
        mx.eval(m.parameters())
        ids = mx.random.randint(0, args.vocab_size, (32,)).tolist()
        return Subject(m, TokenizerWrapper(IdTokenizer(args.vocab_size)), f"{shape} (random weights)", "random",
                       ids, dtype or "bfloat16")
    m, tok, _ = load(model, dtype=dtype)
    name = model or "default (SmolLM2-135M-Instruct)"
    folder = Path(resolve_model(model, dtype))
    return Subject(m, tok, name, "model", encode_chat(tok, prompt), str(_dtype_of(m)).rsplit(".", 1)[-1],
                   folder if folder.is_dir() else None)


def _dtype_of(model: nn.Module) -> Any:
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return None


# -- the runs -----------------------------------------------------------------------------


def continuation(subject: Subject, n: int, cap: Optional[float] = None) -> List[int]:
    """The high gear's greedy continuation of the prompt, ``n`` tokens (the work every row does),
    fewer where ``cap`` seconds run out first (but at least :data:`MIN_RUN_TOKENS`)."""
    steps = generate_step(mx.array(subject.prompt_ids), subject.model, max_tokens=n)
    return [int(tok) for tok, _ in itertools.islice(_steps_until(steps, cap), n)]


def _steps_until(stream: Iterator[Any], cap: Optional[float]) -> Iterator[Any]:
    """``stream``, ending once ``cap`` seconds have passed and :data:`MIN_RUN_TOKENS` items are out."""
    tic = time.perf_counter()
    for i, item in enumerate(stream, 1):
        yield item
        if cap is not None and i >= MIN_RUN_TOKENS and time.perf_counter() - tic > cap:
            return


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No warnings: the ones a bench triggers are known and recorded (the double-quantization note)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _until(stream: Iterator[Any], cap: Optional[float]) -> Any:
    """The last response of ``stream``, which stops early once ``cap`` seconds have
    passed and :data:`MIN_RUN_TOKENS` tokens are out (tokens/s is then over those)."""
    last = None
    for last in _steps_until(stream, cap):  # noqa: B007  (the last response is the run's)
        pass
    return last


def run_plain(subject: Subject, forced: Sequence[int], cap: Optional[float] = None) -> Dict[str, Any]:
    """``mlx_lm.stream_generate`` on the loaded model: no gearbox at all."""
    last = _until(mlx_stream_generate(subject.model, subject.tokenizer, mx.array(subject.prompt_ids),
                                      sampler=forcing_sampler(forced), max_tokens=len(forced)), cap)
    return {"tokens_per_s": last.generation_tps, "decode_tokens": last.generation_tokens}


def run_routed(subject: Subject, gearbox: Gearbox, policy: Any, forced: Sequence[int],
               cap: Optional[float] = None) -> Dict[str, Any]:
    """The gearbox's own decode loop (``gearbx_mlx.stream_generate``) with ``policy``."""
    with quiet():
        last = _until(stream_generate(subject.model, subject.tokenizer, subject.prompt_ids, gearbox, policy=policy,
                                      sampler=forcing_sampler(forced), max_tokens=len(forced), prompt_text=""), cap)
    s = last.session
    return {"tokens_per_s": last.generation_tps, "decode_tokens": last.generation_tokens,
            "gears": s.gear_counts(), "shifts": sum(1 for r in s.records if r.shifted)}


def run_speculative(subject: Subject, gearbox: Gearbox, draft: Any, config: SpeculativeConfig, n: int,
                    plan: Any = None, cap: Optional[float] = None) -> Dict[str, Any]:
    """``stream_speculative_generate`` (greedy: it emits the high gear's own tokens)."""
    last = _until(stream_speculative_generate(subject.model, subject.tokenizer, subject.prompt_ids, gearbox,
                                              config=config, draft=draft, plan=plan, max_tokens=n), cap)
    s = last.stats.summary()
    return {"tokens_per_s": last.generation_tps, "decode_tokens": last.generation_tokens,
            **{k: s[k] for k in ("blocks", "drafted", "accepted", "acceptance_rate", "tokens_per_block",
                                 "mean_drafted_length", "stops")}}


__all__ = ["IdTokenizer", "MIN_RUN_TOKENS", "PROMPT", "SHAPES", "Subject", "continuation", "load_subject", "quiet",
           "run_plain", "run_routed", "run_speculative"]
